"""Drive an OLMoE engine binary through one full protocol session on a tiny checkpoint.

Used by ``make -C engines test-olmoe`` and ``sanitize-olmoe`` (the same session under ASan/UBSan). The checkpoint
is ``$COLIBRI_OLMOE_TINY`` when set, else a tiny random OLMoE built here with transformers (nothing is committed).

    python3 olmoe_session.py ENGINE_BINARY
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from session_env import use_packages

import numpy as np

use_packages("colibri-olmoe")

from colibri.model import read_config  # noqa: E402
from colibri.records import ResolvedModel  # noqa: E402
from colibri_olmoe.plugin import engine_hparams  # noqa: E402

passed = failed = 0


def check(cond: bool, what: str) -> None:
    global passed, failed
    if cond:
        passed += 1
    else:
        failed += 1
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
            raise SystemExit(f"engine exited early with code {self.proc.wait()}")
        return json.loads(line)

    def until(self, ev: str, id_: int | None = None) -> list[dict]:
        seen = []
        while True:
            e = self.event()
            seen.append(e)
            if e["ev"] == ev and (id_ is None or e.get("id") == id_):
                return seen


def main() -> int:
    binary = sys.argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.environ.get("COLIBRI_OLMOE_TINY")
        if not model_dir:
            from colibri.testing.tiny import tiny_model

            model_dir = str(tiny_model("olmoe", Path(tmp), seed=1, num_kv_heads=2, norm_topk_prob=True,
                                       tie_word_embeddings=True).path)
        model = ResolvedModel(Path(model_dir), "olmoe", "olmoe", read_config(Path(model_dir)))
        vocab = model.config["vocab_size"]
        argv = [binary, "--model", model_dir, "--ctx", "64", "--slots", "2", "--cap", "1", "--threads", "2",
                *engine_hparams(model)]
        s = Session(argv)
        ready = s.event()
        check(ready["ev"] == "ready" and ready["vocab"] == vocab, f"ready: {ready}")

        prompt = [(i * 37 + 11) % (vocab - 2) + 2 for i in range(40)]
        s.send({"op": "submit", "id": 1, "slot": 0, "prompt": prompt, "max_tokens": 8, "logits": True})
        s.send({"op": "submit", "id": 2, "slot": 1, "prompt": prompt[:5], "max_tokens": 6, "temperature": 0.8,
                "top_p": 0.9, "top_k": 20, "seed": 3})
        events = s.until("done", 1)
        events += s.until("done", 2) if not any(e["ev"] == "done" and e["id"] == 2 for e in events) else []
        logits = [e for e in events if e["ev"] == "logits" and e["id"] == 1]
        tokens1 = [e["tok"] for e in events if e["ev"] == "token" and e["id"] == 1]
        check(len(logits) == 40 and all(len(e["values"]) == vocab for e in logits), "40 rows of prompt logits")
        check(len(tokens1) == 8, "8 greedy tokens")
        check(any(e["ev"] == "keepalive" for e in events), "keepalive during a 2-chunk prefill")
        check(len([e for e in events if e["ev"] == "token" and e["id"] == 2]) == 6, "6 sampled tokens on slot 1")

        for bad in ("{", "[]", '{"op":"submit","id":9,"prompt":[-1]}', '{"op":"nope"}', "\x00\xff"):
            s.send(bad)
            e = s.event()
            check(e["ev"] == "error" and e["code"] == "bad_request", f"bad_request for {bad!r}: {e}")
        s.send({"op": "submit", "id": 3, "prompt": list(range(2, 70))})
        e = s.event()
        check(e["ev"] == "error" and e["code"] == "context_exceeded", f"context_exceeded: {e}")

        follow = prompt + tokens1[:4] + [5]
        s.send({"op": "submit", "id": 4, "slot": 0, "prompt": follow, "max_tokens": 5, "forced": [7, 8]})
        events = s.until("done", 4)
        forced = [e["tok"] for e in events if e["ev"] == "token"]
        check(forced[:2] == [7, 8] and len(forced) == 5, f"forced tokens are reported as token events: {forced}")
        check(events[0]["ev"] == "accept" and events[0]["reused_tokens"] == 44, f"prefix reuse: {events[0]}")
        s.send({"op": "submit", "id": 5, "slot": 0, "prompt": prompt[:3], "max_tokens": 1000})
        s.send({"op": "cancel", "id": 5})
        done = s.until("done", 5)[-1]
        check(done["reason"] == "cancelled", f"cancel: {done}")
        s.send({"op": "submit", "id": 6, "slot": 1, "prompt": (prompt * 2)[:50], "max_tokens": 100})
        done = s.until("done", 6)[-1]
        check(done["reason"] == "length" and done["generated_tokens"] == 64 - 50 + 1, f"length at ctx: {done}")

        # "logits": "f32": the same rows as base64 little-endian float32, bit for bit (every row length, including
        # a vocab whose byte count is not a multiple of 3, exercises the encoder's padding under the sanitizers)
        s.send({"op": "reset", "slot": 0})
        s.send({"op": "submit", "id": 14, "slot": 0, "prompt": prompt, "max_tokens": 1, "logits": "f32"})
        binary_rows = [e for e in s.until("done", 14) if e["ev"] == "logits"]
        check([e["pos"] for e in binary_rows] == [e["pos"] for e in logits], "f32 rows at the same positions")
        check(all(np.array_equal(np.frombuffer(base64.b64decode(b["f32"]), "<f4"), np.float32(t["values"]))
                  for b, t in zip(binary_rows, logits)), "f32 logits equal the JSON numbers bit for bit")
        s.send({"op": "submit", "id": 15, "slot": 0, "prompt": prompt[:3], "logits": "f64"})
        e = s.event()
        check(e["ev"] == "error" and e["code"] == "bad_request" and "f32" in e["message"], f"logits f64: {e}")
        # the sampler's processors, log-probabilities, the debug distribution and the mask of constrained decoding
        s.send({"op": "submit", "id": 16, "slot": 1, "prompt": prompt[:6], "max_tokens": 4, "temperature": 0.9,
                "min_p": 0.05, "repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": -0.5,
                "logit_bias": [[3, 5.0], [4, -100]], "logprobs": 20, "dist": True, "top_k": 30, "forced": [3, 3]})
        events = s.until("done", 16)
        tokens = [e for e in events if e["ev"] == "token"]
        dists = [np.frombuffer(base64.b64decode(e["probs"]), "<f4") for e in events if e["ev"] == "dist"]
        check(len(tokens) == 4 and all(len(t["top"]) == 20 and t["logprob"] <= 0 for t in tokens), "logprobs")
        check(len(dists) == 4 and all(abs(float(d.sum()) - 1) < 1e-4 and d[4] == 0 for d in dists), "dist")
        words = (vocab + 31) // 32
        allow = np.zeros(words, "<u4")
        allow[0] = 1 << 9
        s.send({"op": "submit", "id": 17, "slot": 1, "prompt": prompt[:6], "max_tokens": 2, "temperature": 1.0,
                "constrained": True})
        s.send({"op": "mask", "id": 17, "allow": base64.b64encode(allow.tobytes()).decode()})
        first = [e for e in s.until("token", 17) if e["ev"] == "token"]
        check(first[-1]["tok"] == 9, f"the mask decides: {first}")
        s.send({"op": "mask", "id": 17, "allow": "AAAA"})
        e = s.event()
        check(e["ev"] == "error" and "allow" in e["message"], f"a mask of the wrong size: {e}")
        s.send({"op": "mask", "id": 17, "allow": base64.b64encode(bytes(4 * words)).decode()})
        e = s.event()
        check(e["ev"] == "error" and e["id"] == 17 and "no token" in e["message"], f"an empty mask: {e}")
        for bad in ({"min_p": 2}, {"logit_bias": [[vocab, 1]]}, {"logprobs": 21}, {"constrained": 1}):
            s.send({"op": "submit", "id": 18, "prompt": prompt[:3], **bad})
            e = s.event()
            check(e["ev"] == "error" and e["code"] == "bad_request", f"bad_request for {bad}: {e}")
        s.send({"op": "stats"})
        stats = s.until("stats")[-1]
        check(all(m > 0 for m in stats["misses"]), f"misses in every layer at cap 1: {stats}")
        s.send({"op": "shutdown"})
        rc = s.proc.wait(timeout=300)
        check(rc == 0, f"exit code {rc}")

        # Every expert read at load on the I/O threads, then the hot set with lookahead prefetch, then set dueling
        # (the default of a partial cache): same tokens.
        for extra in (["--cap", "0", "--preload", "on"],
                      ["--cap", "2", "--pin", "on", "--repin-every", "1", "--prefetch", "on", "--lookahead", "on",
                       "--io-stages", "2", "--hotset", os.path.join(tmp, "hotset")],
                      ["--cap", "3", "--pin", "duel", "--repin-every", "1", "--prefetch", "on",
                       "--hotset", os.path.join(tmp, "hotset-duel")]):
            s = Session([binary, "--model", model_dir, "--ctx", "64", "--threads", "2", *extra,
                         *engine_hparams(model)])
            ready = s.event()
            check(ready["ev"] == "ready" and (ready["preloaded_bytes"] > 0) == ("--preload" in extra),
                  f"ready with {extra}: {ready}")
            s.send({"op": "submit", "id": 1, "prompt": prompt, "max_tokens": 8})
            got = [e["tok"] for e in s.until("done", 1) if e["ev"] == "token"]
            check(got == tokens1, f"tokens with {extra}: {got} != {tokens1}")
            s.send({"op": "shutdown"})
            rc = s.proc.wait(timeout=300)
            check(rc == 0, f"exit code {rc} with {extra}")
    print(f"olmoe_session: {passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
