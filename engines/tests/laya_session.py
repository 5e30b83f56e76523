"""Drive the Laya engine (colibri-decision's decide-only encoder engine) through one protocol session on a tiny
Laya checkpoint built with laya's classes: ``make -C engines test-laya`` / ``sanitize-laya`` (under ASan/UBSan).

    python3 laya_session.py ENGINE_BINARY
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

from session_env import use_packages

BINARY = sys.argv[1] if len(sys.argv) == 2 else sys.exit(__doc__)
use_packages("colibri-decision")

from colibri.records import ResolvedModel  # noqa: E402
from colibri.testing.tiny import tiny_model  # noqa: E402
from colibri_decision.laya import engine_hparams  # noqa: E402

CTX = 64
failures: list[str] = []


def check(cond: bool, what: str) -> None:
    if not cond:
        failures.append(what)
        print(f"FAIL: {what}", file=sys.stderr)


def run(model_dir: Path) -> None:
    argv = [BINARY, "--model", str(model_dir), "--ctx", str(CTX), "--slots", "2", "--threads", "2",
            *engine_hparams(ResolvedModel(model_dir, "decision", "laya", {}))]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def send(message: dict | str) -> None:
        proc.stdin.write((message if isinstance(message, str) else json.dumps(message)) + "\n")
        proc.stdin.flush()

    def event() -> dict:
        line = proc.stdout.readline()
        if not line:
            raise SystemExit(f"laya engine exited early with code {proc.wait()}")
        return json.loads(line)

    ready = event()
    check(ready["ev"] == "ready" and ready["abilities"] == ["decide"], f"ready: {ready}")
    prompt = [0] + [(i * 37 + 11) % 500 + 5 for i in range(40)] + [1]
    # three options at rows 10, 20, 30 read as a choice, then the same rows as a noul: two head passes
    send({"op": "decide", "id": 1, "slot": 0, "prompt": prompt, "marks": [11, 21, 31], "options": [[0], [0], [2]]})
    events = [event() for _ in range(3)]
    check([e["ev"] for e in events] == ["accept", "decision", "done"], f"decide events: {events}")
    scores = events[1]["scores"]
    check(len(scores) == 3 and all(len(s) == 1 and math.isfinite(s[0]) for s in scores), f"scores: {scores}")
    check(events[2]["reason"] == "decided" and events[2]["prefilled_tokens"] == len(prompt), f"done: {events[2]}")
    # the same rows again on the other slot give the same bits (nothing is kept between sequences)
    send({"op": "decide", "id": 2, "slot": 1, "prompt": prompt, "marks": [11, 21, 31], "options": [[0], [0], [2]]})
    again = [event() for _ in range(3)]
    check(again[1].get("scores") == scores and again[0]["reused_tokens"] == 0, f"repeat: {again}")
    for bad, code in (({"op": "submit", "id": 3, "prompt": prompt}, "bad_request"),
                      ({"op": "decide", "id": 4, "prompt": prompt, "marks": [5], "options": [[3]]}, "bad_request"),
                      ({"op": "decide", "id": 5, "prompt": prompt, "marks": [0], "options": [[0]]}, "bad_request"),
                      ({"op": "decide", "id": 6, "prompt": list(range(CTX + 1)), "marks": [1], "options": [[0]]},
                       "context_exceeded")):
        send(bad)
        e = event()
        if e["ev"] == "accept":
            e = event()
        check(e["ev"] == "error" and e["code"] == code, f"{code} for {bad['op']} {bad.get('options')}: {e}")
    send({"op": "shutdown"})
    rc = proc.wait(timeout=300)
    check(rc == 0, f"exit code {rc}")


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        run(tiny_model("laya", Path(tmp), seed=1, num_hidden_layers=3, head_layers=2).path)
    print(f"laya session: {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
