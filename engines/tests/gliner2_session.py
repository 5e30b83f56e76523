"""Drive the colibri-gliner2 engine binary (a decision-only encoder) through a whole protocol session on a tiny
GLiNER2 checkpoint: decides at 1 and 2 threads agree to the bit, and every malformed or refused request is one
error event naming its field while the engine keeps serving.

Used by ``make -C engines test-gliner2`` and ``sanitize-gliner2`` (the same session under ASan/UBSan). The
checkpoint is built here with the gliner2 package's classes (colibri_decision.tiny_gliner2; nothing committed).

    python3 gliner2_session.py ENGINE_BINARY
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from session_env import use_packages

use_packages("colibri-decision")

from colibri.model import resolve_model  # noqa: E402
from colibri.decision import parse_questions  # noqa: E402
from colibri.tokenizer import load_tokenizer_dir  # noqa: E402
from colibri_decision import gliner2, plugin  # noqa: E402
from colibri_decision.tiny_gliner2 import build_gliner2  # noqa: E402

QUESTIONS = {"tone": {"type": "choice", "instructions": "Tone?", "criteria": {"calm": None, "pushy": "pressure"}},
             "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["low", "mid", "high"]}}
# (request, the words its error must hold); the engine answers each and goes on
BAD = [
    ({"op": "decide", "id": 1, "prompt": [1, 2], "marks": [3], "options": [[0]]}, "marks"),
    ({"op": "decide", "id": 2, "prompt": [1, 2], "marks": [1], "options": [[1]]}, "options"),
    ({"op": "decide", "id": 3, "prompt": [1, 99999], "marks": [1], "options": [[0]]}, "prompt"),
    ({"op": "decide", "id": 4, "prompt": [1] * 300, "marks": [1], "options": [[0]]}, "exceeds the context"),
    ({"op": "decide", "id": 5, "prompt": [1, 2], "marks": [], "options": []}, "mark"),
    ({"op": "decide", "id": 6, "slot": 9, "prompt": [1], "marks": [1], "options": [[0]]}, "slot"),
    ({"op": "submit", "id": 7, "prompt": [1, 2]}, "only decides"),
    ({"op": "fly", "id": 8}, "unknown op"),
]


def session(binary: str, model_dir: Path, threads: int, hparams: tuple[str, ...], lines: list[str]) -> list[dict]:
    argv = [binary, "--model", str(model_dir), "--ctx", "256", "--slots", "2", "--cap", "0", "--threads",
            str(threads), *hparams]
    done = subprocess.run(argv, input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise SystemExit(f"FAIL: engine exited {done.returncode}: {done.stderr[-2000:]}")
    return [json.loads(line) for line in done.stdout.splitlines()]


def main(binary: str) -> int:
    with tempfile.TemporaryDirectory(prefix="colibri-gliner2-session-") as tmp:
        tiny = build_gliner2(Path(tmp) / "gliner2")
        model = resolve_model(tiny.path)
        tok = load_tokenizer_dir(tiny.path)
        encoded = gliner2.build_input(tok.backend, "Please answer TODAY, or else!",
                                      parse_questions(QUESTIONS, gliner2.LABELS))
        decide = {"op": "decide", "id": 100, "slot": 1, "prompt": encoded.ids, "marks": encoded.marks,
                  "options": [[0]] * len(encoded.marks), "pin": 3}
        lines = [json.dumps(decide), "{not json", *(json.dumps(b) for b, _ in BAD), json.dumps({"op": "stats"}),
                 json.dumps({**decide, "id": 101}), json.dumps({"op": "shutdown"})]
        failures = 0
        scores = []
        for threads in (1, 2):
            events = session(binary, tiny.path, threads, plugin.build_env(model=model, plan=None).args, lines)
            ready = events[0]
            ok = ready["ev"] == "ready" and ready["abilities"] == ["decide"] and ready["outputs"] == 1
            decisions = [e for e in events if e["ev"] == "decision"]
            ok = ok and len(decisions) == 2 and decisions[0]["scores"] == decisions[1]["scores"]
            ok = ok and len(decisions[0]["scores"]) == len(encoded.marks)
            errors = {e["id"]: e["message"] for e in events if e["ev"] == "error"}
            for request, words in BAD:
                if words not in errors.get(request["id"], ""):
                    print(f"FAIL: {request} -> {errors.get(request['id'])!r}, expected {words!r}")
                    ok = False
            ok = ok and any(e["ev"] == "error" and e["id"] is None for e in events)   # the malformed line
            ok = ok and any(e["ev"] == "stats" and e["decides"] == 1 for e in events)
            scores.append(decisions[0]["scores"] if decisions else None)
            print(f"{'ok' if ok else 'FAIL'}: {threads} thread(s): decides, bad requests answered, stats, shutdown")
            failures += not ok
        if scores[0] != scores[1]:
            print("FAIL: 1 and 2 threads give different scores")
            failures += 1
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
