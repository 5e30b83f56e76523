"""Drive colibri-decision's JEV engine through a protocol session on tiny checkpoints of both layouts (a saved
JevForDecision, and a qwen3_5_text LM with a JEV head beside it), built here with transformers.

Used by ``make -C engines test-jev`` and ``sanitize-jev`` (the same under ASan/UBSan): the engine announces only
``decide``, scores option rows, reuses a pinned recurrent state, and refuses generation.

    python3 jev_session.py ENGINE_BINARY
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from session_env import use_packages

BINARY = sys.argv[1] if len(sys.argv) == 2 else sys.exit(__doc__)
use_packages("colibri-decision")

from colibri.model import read_config  # noqa: E402
from colibri.records import ResolvedModel  # noqa: E402
from colibri.testing.tiny import tiny_model  # noqa: E402
from colibri_decision import jev  # noqa: E402
from colibri_decision.jev_tiny import TINY_MODELS  # noqa: E402


def session(model_dir: Path) -> None:
    model = ResolvedModel(model_dir, "decision", "jev", read_config(model_dir))
    proc = subprocess.Popen([BINARY, "--model", str(model_dir), "--ctx", "64", "--slots", "2", "--threads", "2",
                             *jev.engine_args(model)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def send(request: dict) -> None:
        proc.stdin.write(json.dumps(request) + "\n")
        proc.stdin.flush()

    def until(ev: str, id_: int | None = None) -> list[dict]:
        seen = []
        while True:
            line = proc.stdout.readline()
            if not line:
                raise SystemExit(f"jev engine exited early with code {proc.wait()}")
            seen.append(json.loads(line))
            if seen[-1]["ev"] == ev and (id_ is None or seen[-1].get("id") == id_):
                return seen

    ready = until("ready")[-1]
    assert ready["abilities"] == ["decide"], ready
    prompt = [(i * 37 + 11) % 500 + 2 for i in range(40)]
    send({"op": "decide", "id": 1, "slot": 0, "prompt": prompt, "marks": [40, 33, 5],
          "options": [[0, 1], [2, 3, 4], [8, 9, 10]], "pin": 20})
    decision = [e for e in until("done", 1) if e["ev"] == "decision"][0]
    assert all(x is not None for row in decision["scores"] for x in row), decision
    send({"op": "decide", "id": 2, "slot": 0, "prompt": prompt[:20] + [9, 10, 11], "marks": [23], "options": [[0]],
          "pin": 20})
    events = until("done", 2)
    assert events[0]["reused_tokens"] == 20 and events[-1]["prefilled_tokens"] == 3, events
    send({"op": "submit", "id": 3, "slot": 1, "prompt": prompt, "max_tokens": 2})
    assert until("error")[-1]["code"] == "bad_request"
    send({"op": "shutdown"})
    assert proc.wait(timeout=300) == 0


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        for kind in TINY_MODELS:
            session(tiny_model(kind, Path(tmp), seed=1).path)
            print(f"jev ({kind}) session: passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
