"""Drive a family engine binary through one full protocol session on a tiny checkpoint of one model type.

Used by ``make -C engines test-FAMILY`` and ``sanitize-FAMILY`` (the same session under ASan/UBSan) for the
families beyond OLMoE (whose own session is olmoe_session.py): each runs a type that reaches that engine's own
paths, e.g. qwen3_next's recurrent state, glm_moe_dsa's sparse indexer. The checkpoint is a tiny random one built
here with transformers (nothing is committed).

    python3 family_session.py FAMILY MODEL_TYPE ENGINE_BINARY      e.g.  qwen qwen3_next build/colibri-qwen
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from session_env import use_packages

FAMILY, KIND, BINARY = sys.argv[1:4] if len(sys.argv) == 4 else sys.exit(__doc__)
PACKAGE = "colibri_" + FAMILY.replace("-", "_")
use_packages(f"colibri-{FAMILY}")

from colibri.model import read_config  # noqa: E402
from colibri.records import ResolvedModel  # noqa: E402
from colibri.testing.tiny import tiny_model  # noqa: E402

engine_hparams = importlib.import_module(f"{PACKAGE}.plugin").engine_hparams
CTX = 64
failures: list[str] = []
checks = 0


def check(cond: bool, what: str) -> None:
    global checks
    checks += 1
    if not cond:
        failures.append(what)
        print(f"FAIL: {what}", file=sys.stderr)


class Session:
    def __init__(self, argv: list[str]):
        # Prefetching on: the sanitizers then also watch the I/O thread and the staging-buffer swaps.
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "COLIBRI_PREFETCH": "1"})

    def send(self, line: str | dict) -> None:
        self.proc.stdin.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
        self.proc.stdin.flush()

    def event(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"{FAMILY} engine exited early with code {self.proc.wait()}")
        return json.loads(line)

    def until(self, ev: str, id_: int | None = None) -> list[dict]:
        seen = []
        while True:
            seen.append(self.event())
            if seen[-1]["ev"] == ev and (id_ is None or seen[-1].get("id") == id_):
                return seen


def run(model_dir: Path) -> None:
    config = read_config(model_dir)
    vocab = config["vocab_size"]
    model = ResolvedModel(model_dir, FAMILY, config["model_type"], config)
    s = Session([BINARY, "--model", str(model_dir), "--ctx", str(CTX), "--slots", "2", "--cap", "1",
                 "--threads", "2", *engine_hparams(model)])
    ready = s.event()
    check(ready["ev"] == "ready" and ready["vocab"] == vocab, f"ready: {ready}")

    # Two slots at once, one greedy with prompt logits over two prefill chunks, one sampled.
    prompt = [(i * 37 + 11) % (vocab - 2) + 2 for i in range(40)]
    s.send({"op": "submit", "id": 1, "slot": 0, "prompt": prompt, "max_tokens": 8, "logits": True})
    s.send({"op": "submit", "id": 2, "slot": 1, "prompt": prompt[:5], "max_tokens": 6, "temperature": 0.8,
            "top_p": 0.9, "top_k": 20, "seed": 3})
    events = s.until("done", 1)
    if not any(e["ev"] == "done" and e.get("id") == 2 for e in events):
        events += s.until("done", 2)
    logits = [e for e in events if e["ev"] == "logits" and e["id"] == 1]
    tokens1 = [e["tok"] for e in events if e["ev"] == "token" and e["id"] == 1]
    check(len(logits) == 40 and all(len(e["values"]) == vocab for e in logits), "40 rows of prompt logits")
    check(len(tokens1) == 8, "8 greedy tokens")
    check(len([e for e in events if e["ev"] == "token" and e["id"] == 2]) == 6, "6 sampled tokens on slot 1")

    for bad in ("{", "[]", '{"op":"submit","id":9,"prompt":[-1]}', '{"op":"nope"}', "\x00\xff"):
        s.send(bad)
        e = s.event()
        check(e["ev"] == "error" and e["code"] == "bad_request", f"bad_request for {bad!r}: {e}")
    s.send({"op": "submit", "id": 3, "prompt": list(range(2, CTX + 6))})
    e = s.event()
    check(e["ev"] == "error" and e["code"] == "context_exceeded", f"context_exceeded: {e}")

    # A follow-up turn reuses the slot: all of a KV prefix, or a recurrent model's end-of-prompt checkpoint.
    follow = prompt + tokens1[:4] + [5]
    s.send({"op": "submit", "id": 4, "slot": 0, "prompt": follow, "max_tokens": 5, "forced": [7, 8]})
    events = s.until("done", 4)
    forced = [e["tok"] for e in events if e["ev"] == "token"]
    check(forced[:2] == [7, 8] and len(forced) == 5, f"forced tokens are reported as token events: {forced}")
    check(events[0]["ev"] == "accept" and events[0]["reused_tokens"] >= len(prompt), f"prefix reuse: {events[0]}")
    s.send({"op": "submit", "id": 5, "slot": 0, "prompt": prompt[:3], "max_tokens": 1000})
    s.send({"op": "cancel", "id": 5})
    done = s.until("done", 5)[-1]
    check(done["reason"] == "cancelled", f"cancel: {done}")
    s.send({"op": "submit", "id": 6, "slot": 1, "prompt": (prompt * 2)[:50], "max_tokens": 100})
    done = s.until("done", 6)[-1]
    check(done["reason"] == "length" and done["generated_tokens"] == CTX - 50 + 1, f"length at ctx: {done}")
    # decide: the options' logits at marked rows (the very values of the prompt logits above), a pinned state the
    # next decide on the slot reuses (a recurrent one from its checkpoint at the pin), bad fields refused
    s.send({"op": "decide", "id": 7, "slot": 0, "prompt": prompt, "marks": [40, 33, 5],
            "options": [[2, 3], [4], [5, 6, 7]], "pin": 20})
    events = s.until("done", 7)
    decision = [e for e in events if e["ev"] == "decision"]
    check(len(decision) == 1 and events[-1]["reason"] == "decided", f"decide: {events[-2:]}")
    check(decision[0]["scores"][0] == [logits[39]["values"][2], logits[39]["values"][3]] and
          decision[0]["scores"][1] == [logits[32]["values"][4]] and len(decision[0]["scores"][2]) == 3,
          f"decide scores are the prompt logits: {decision[0]}")
    s.send({"op": "decide", "id": 8, "slot": 0, "prompt": prompt[:20] + [9, 10, 11], "marks": [23],
            "options": [[2]], "pin": 20})
    events = s.until("done", 8)
    check(events[0]["reused_tokens"] == 20 and events[-1]["prefilled_tokens"] == 3, f"pinned reuse: {events}")
    for bad in ({"marks": [0], "options": [[1]]}, {"marks": [3], "options": [[vocab]]},
                {"marks": [3], "options": [[1]], "pin": 999}, {"marks": [3, 4], "options": [[1]]}):
        s.send({"op": "decide", "id": 9, "slot": 0, "prompt": prompt, **bad})
        e = s.event()
        check(e["ev"] == "error" and e["code"] == "bad_request", f"bad decide {bad}: {e}")
    saved_kv(s, prompt, vocab, model_dir.parent)
    s.send({"op": "stats"})
    stats = s.until("stats")[-1]
    check(all(m > 0 for m in stats["misses"]), f"misses in every MoE layer at cap 1: {stats}")
    s.send({"op": "shutdown"})
    rc = s.proc.wait(timeout=300)
    check(rc == 0, f"exit code {rc}")


def saved_kv(s: Session, prompt: list[int], vocab: int, tmp: Path) -> None:
    """kv_save / kv_load (docs/protocol.md "Saved KV"): slot 0 saved, forgotten, restored from the file; the
    continuation equals a full prefill on slot 1; a damaged file is refused with a warning; bad paths refused."""
    path = tmp / "slot.kv"
    s.send({"op": "reset", "slot": 0})
    s.send({"op": "submit", "id": 20, "slot": 0, "prompt": prompt[:30], "max_tokens": 4, "kv_save": str(path)})
    events = s.until("done", 20)
    saved = events[-1].get("kv_saved_tokens")
    check(saved == 33 and path.stat().st_size == events[-1]["kv_saved_bytes"], f"kv_save: {events[-1]}")
    follow = prompt[:30] + [e["tok"] for e in events if e["ev"] == "token"] + [9, 10]
    s.send({"op": "reset", "slot": 0})
    s.send({"op": "submit", "id": 21, "slot": 0, "prompt": follow, "max_tokens": 4, "kv_load": str(path)})
    loaded = s.until("done", 21)
    check(loaded[0].get("kv_loaded") == 33 and loaded[-1]["prefilled_tokens"] == len(follow) - 33,
          f"kv_load: {loaded[0]}")
    s.send({"op": "reset", "slot": 1})
    s.send({"op": "submit", "id": 22, "slot": 1, "prompt": follow, "max_tokens": 4})
    fresh = s.until("done", 22)
    tokens = [[e["tok"] for e in run if e["ev"] == "token"] for run in (loaded, fresh)]
    check(tokens[0] == tokens[1], f"a loaded prefix continues as a full prefill does: {tokens}")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 4
    path.write_bytes(bytes(data))
    s.send({"op": "reset", "slot": 0})
    s.send({"op": "submit", "id": 23, "slot": 0, "prompt": follow, "max_tokens": 4, "kv_load": str(path)})
    damaged = s.until("done", 23)
    check(damaged[0].get("kv_loaded") == 0 and "checksum" in damaged[0].get("kv_warning", "") and
          [e["tok"] for e in damaged if e["ev"] == "token"] == tokens[1], f"a corrupt file is refused: {damaged[0]}")
    for bad in ({"kv_load": 3}, {"kv_save": ""}, {"kv_load": "x" * 5000}, {"kv_identity": "x" * 65}):
        s.send({"op": "submit", "id": 24, "slot": 0, "prompt": prompt[:3], **bad})
        e = s.event()
        check(e["ev"] == "error" and e["code"] == "bad_request", f"bad kv field {bad}: {e}")


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        run(tiny_model(KIND, Path(tmp), seed=1).path)
    print(f"{FAMILY} ({KIND}) session: {checks - len(failures)} passed, {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
