"""A protocol-speaking stand-in engine for the server tests: several slots decoding at once, prefix reuse,
keep-alives during a slow prefill, cancel, and deterministic tokens that decode to real text.

Unlike ``fake_engine.py`` (one sequence at a time, for the client's own tests) this one interleaves the
sequences of different slots, which is what the server's scheduler, disconnect and load tests need.

The next token is a hash of the whole sequence so far (prompt + generated), so the same conversation always
continues the same way, whatever slot or cache state it meets — the property a real greedy engine has.
Tokens below ``--set first_text_id=N`` (the tokenizer's special tokens) are never produced, except the first
``stop`` id, which is produced when the hash says so (``--set eos_every=N``: about one step in N).

Environment: ``SERVE_FAKE_TOKEN_DELAY`` seconds per decode step, ``SERVE_FAKE_PREFILL_DELAY`` seconds per
prefilled prompt token (keep-alives every 0.1 s meanwhile), ``SERVE_FAKE_LOAD_DELAY`` seconds before ``ready``.
"""

import hashlib
import json
import os
import queue
import sys
import threading
import time

TOKEN_DELAY = float(os.environ.get("SERVE_FAKE_TOKEN_DELAY", "0"))
PREFILL_DELAY = float(os.environ.get("SERVE_FAKE_PREFILL_DELAY", "0"))
LOAD_DELAY = float(os.environ.get("SERVE_FAKE_LOAD_DELAY", "0"))


def parse_args(argv):
    opts = {"ctx": 256, "slots": 1, "cap": 0, "threads": 1, "vocab": 512, "first_text_id": 4, "eos_every": 0}
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in ("--model", "--ctx", "--slots", "--cap", "--threads"):
            opts[a[2:]] = argv[i + 1] if a == "--model" else int(argv[i + 1])
        elif a == "--set":
            key, _, value = argv[i + 1].partition("=")
            opts[key] = int(value)
        else:
            print(f"unknown argument {a}", file=sys.stderr)
            sys.exit(2)
        i += 2
    return opts


_out = threading.Lock()


def emit(obj):
    with _out:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()


def next_token(seq, opts, stop, temperature, seed):
    material = ",".join(map(str, seq)) + (f"|{seed}" if temperature > 0 else "")
    h = int.from_bytes(hashlib.sha256(material.encode()).digest()[:8], "little")
    if stop and opts["eos_every"] and h % opts["eos_every"] == 0:
        return stop[0]
    span = opts["vocab"] - opts["first_text_id"]
    return opts["first_text_id"] + (h >> 8) % span


class Sequence:
    def __init__(self, msg, reused, opts):
        self.id = msg["id"]
        self.slot = int(msg["slot"])
        self.prompt = list(msg["prompt"])
        self.seq = list(self.prompt)
        self.reused = reused
        self.to_prefill = len(self.prompt) - reused
        self.prefill_left = self.to_prefill * PREFILL_DELAY
        self.max_tokens = min(int(msg.get("max_tokens", 16)), opts["ctx"] - len(self.prompt))
        self.stop = [int(t) for t in msg.get("stop", [])]
        self.temperature = float(msg.get("temperature", 0))
        self.seed = int(msg.get("seed", 0))
        self.generated = 0
        self.forced = [int(t) for t in msg.get("forced") or []]   # teacher forcing: these are the next tokens


def main():
    opts = parse_args(sys.argv[1:])
    time.sleep(LOAD_DELAY)
    emit({"ev": "ready", "family": "fake", "vocab": opts["vocab"], "ctx": opts["ctx"], "slots": opts["slots"],
          "cap": opts["cap"], "threads": opts["threads"], "isa": "scalar", "dense_bytes": 1, "kv_bytes": 1,
          "expert_cache_bytes": 1})
    inbox = queue.Queue()

    def read_stdin():
        for line in sys.stdin:
            try:
                inbox.put(json.loads(line))
            except json.JSONDecodeError:
                emit({"ev": "error", "id": None, "code": "bad_request", "message": "not JSON"})
        inbox.put(None)

    threading.Thread(target=read_stdin, daemon=True).start()
    cached = {i: [] for i in range(opts["slots"])}
    running = {}     # slot -> Sequence
    generated_total = 0

    def finish(s, reason):
        # the KV holds every token that was fed: the prompt and all generated tokens but the last
        cached[s.slot] = s.seq[:-1] if s.generated else list(s.prompt)
        del running[s.slot]
        emit({"ev": "done", "id": s.id, "reason": reason, "prompt_tokens": len(s.prompt),
              "prefilled_tokens": s.to_prefill, "generated_tokens": s.generated, "prefill_tps": 500.0,
              "decode_tps": 50.0, "expert_hits": 3 * s.generated, "expert_misses": s.generated,
              "hit_rate": 0.75, "bytes_read": 1000 * s.generated, "reads": s.generated, "rss_bytes": 1 << 20})

    while True:
        try:
            msg = inbox.get(timeout=None if not running else 0.0)
        except queue.Empty:
            msg = "step"
        if msg is None:
            return 0
        if msg != "step":
            op = msg.get("op")
            if op == "shutdown":
                return 0
            if op == "cancel":
                for s in list(running.values()):
                    if s.id == msg.get("id"):
                        finish(s, "cancelled")
            elif op == "reset":
                cached[int(msg.get("slot", 0))] = []
            elif op == "stats":
                g = generated_total   # one MoE layer of 4 experts, 2 cached: expert 0 takes half the accesses
                emit({"ev": "stats", "generated": g, "expert_hits": 3 * g, "expert_misses": g,
                      "hit_rate": 0.75 if g else 0.0, "expert_bytes_read": 1000 * g, "rss_bytes": 1 << 20,
                      "layers": [0], "hits": [3 * g], "misses": [g], "bytes_read": [1000 * g], "reads": [g],
                      "experts": [4], "cache_slots": [2], "uses": [[2 * g, g, g, 0]], "resident": [[1, 2, 0, 0]]})
            elif op == "submit":
                rid, slot, prompt = msg.get("id"), msg.get("slot"), msg.get("prompt") or []
                if slot not in cached:
                    emit({"ev": "error", "id": rid, "code": "bad_request", "message": f"slot {slot} out of range"})
                elif slot in running:
                    emit({"ev": "error", "id": rid, "code": "busy", "message": f"slot {slot} is busy"})
                elif not prompt or len(prompt) >= opts["ctx"]:
                    emit({"ev": "error", "id": rid, "code": "context_exceeded",
                          "message": f"prompt of {len(prompt)} tokens does not fit ctx {opts['ctx']}"})
                elif any(not isinstance(t, int) or t < 0 or t >= opts["vocab"] for t in prompt):
                    emit({"ev": "error", "id": rid, "code": "bad_request", "message": "token id out of range"})
                else:
                    held = cached[slot]
                    reused = 0
                    while reused < min(len(held), len(prompt) - 1) and held[reused] == prompt[reused]:
                        reused += 1
                    running[slot] = Sequence(msg, reused, opts)
                    emit({"ev": "accept", "id": rid, "slot": slot, "prompt_tokens": len(prompt),
                          "reused_tokens": reused})
            else:
                emit({"ev": "error", "id": msg.get("id"), "code": "bad_request", "message": f"unknown op {op!r}"})
            continue
        # one decode step for every running sequence (a prefill step for those still prefilling)
        step = max(TOKEN_DELAY, 0.1 if any(s.prefill_left > 0 for s in running.values()) else 0)
        if step:
            time.sleep(step)
        for s in list(running.values()):
            if s.prefill_left > 0:
                s.prefill_left -= step
                emit({"ev": "keepalive", "id": s.id, "done": 0, "total": s.to_prefill})
                continue
            if s.generated >= s.max_tokens:
                finish(s, "length")
                continue
            tok = s.forced[s.generated] if s.generated < len(s.forced) else next_token(
                s.seq, opts, s.stop, s.temperature, s.seed)
            s.seq.append(tok)
            s.generated += 1
            generated_total += 1
            emit({"ev": "token", "id": s.id, "tok": tok})
            if tok in s.stop:
                finish(s, "stop")
            elif s.generated >= s.max_tokens:
                finish(s, "length")


if __name__ == "__main__":
    sys.exit(main())
