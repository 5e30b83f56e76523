"""A stand-in engine speaking docs/protocol.md, for testing the Python client without a C build.

Tokens are a deterministic function of the prompt (so tests can predict them); slots keep their tokens and reuse
the longest common prefix as a real engine does. ``FAKE_ENGINE_MODE`` picks a misbehaviour:

  normal            behave
  sigkill_on_load   SIGKILL itself before ``ready`` (what the OOM killer looks like)
  fatal_on_load     write a ``fatal`` event and exit 2
  never_ready       write nothing and sleep
  exit_mid_stream   after FAKE_EXIT_AFTER tokens (default 2) write to stderr and exit 3
  sigsegv_mid_stream  after FAKE_EXIT_AFTER tokens, die of SIGSEGV

``FAKE_TOKEN_DELAY`` (seconds) slows generation so cancel can be tested.
"""

import json
import os
import queue
import signal
import sys
import threading
import time

MODE = os.environ.get("FAKE_ENGINE_MODE", "normal")
EXIT_AFTER = int(os.environ.get("FAKE_EXIT_AFTER", "2"))
DELAY = float(os.environ.get("FAKE_TOKEN_DELAY", "0"))


def parse_args(argv):
    opts = {"ctx": 64, "slots": 1, "cap": 0, "threads": 1, "vocab": 256}
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in ("--model", "--ctx", "--slots", "--cap", "--threads"):
            opts[a[2:]] = argv[i + 1] if a == "--model" else int(argv[i + 1])
            i += 2
        elif a in ("--prefetch", "--lookahead", "--pin", "--preload", "--io", "--io-stages", "--io-threads",
                   "--prefill-chunk", "--moe-union", "--experts-k", "--experts-top-p"):
            opts[a[2:]] = argv[i + 1]   # streaming options: accepted like the real engine, no effect on tokens
            i += 2
        elif a == "--set":
            key, _, value = argv[i + 1].partition("=")
            opts[key] = int(value) if value.lstrip("-").isdigit() else value
            i += 2
        else:
            print(f"unknown argument {a}", file=sys.stderr)
            sys.exit(2)
    return opts


def emit(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def next_token(prompt, generated, vocab):
    return (sum(prompt) * 31 + len(generated) * 7 + 3) % vocab


def main():
    opts = parse_args(sys.argv[1:])
    print("fake engine loading", file=sys.stderr, flush=True)
    if MODE == "sigkill_on_load":
        print("allocating expert cache", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if MODE == "fatal_on_load":
        emit({"ev": "fatal", "code": "load_failed", "message": "tensor model.norm.weight missing"})
        sys.exit(2)
    if MODE == "never_ready":
        time.sleep(3600)
    vocab = int(opts["vocab"])
    emit({"ev": "ready", "family": "fake", "vocab": vocab, "ctx": opts["ctx"], "slots": opts["slots"],
          "cap": opts["cap"], "threads": opts["threads"], "isa": "scalar", "dense_bytes": 1, "kv_bytes": 1,
          "expert_cache_bytes": 1})

    inbox: "queue.Queue" = queue.Queue()
    cancelled = set()

    def read_stdin():
        for line in sys.stdin:
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                emit({"ev": "error", "id": None, "code": "bad_request", "message": "not JSON"})
                continue
            if msg.get("op") == "cancel":
                cancelled.add(msg.get("id"))
            inbox.put(msg)
        inbox.put(None)

    threading.Thread(target=read_stdin, daemon=True).start()
    slots = {i: [] for i in range(opts["slots"])}
    totals = {"requests": 0, "generated": 0}
    emitted_total = 0
    while True:
        msg = inbox.get()
        if msg is None or msg.get("op") == "shutdown":
            return 0
        op = msg.get("op")
        if op == "cancel":
            continue
        if op == "reset":
            slots[int(msg.get("slot", 0))] = []
            continue
        if op == "stats":
            emit({"ev": "stats", **totals, "hits": [0], "misses": [0], "bytes_read": [0]})
            continue
        if op != "submit":
            emit({"ev": "error", "id": msg.get("id"), "code": "bad_request", "message": f"unknown op {op!r}"})
            continue
        rid, slot, prompt = msg["id"], int(msg.get("slot", 0)), list(msg.get("prompt", []))
        if slot not in slots:
            emit({"ev": "error", "id": rid, "code": "bad_request", "message": f"slot {slot} out of range"})
            continue
        if not prompt or len(prompt) + 1 > opts["ctx"]:
            emit({"ev": "error", "id": rid, "code": "context_exceeded",
                  "message": f"prompt of {len(prompt)} tokens does not fit ctx {opts['ctx']}"})
            continue
        held = slots[slot]
        reused = 0
        while reused < min(len(held), len(prompt) - 1) and held[reused] == prompt[reused]:
            reused += 1
        emit({"ev": "accept", "id": rid, "slot": slot, "prompt_tokens": len(prompt), "reused_tokens": reused})
        if msg.get("logits"):
            for pos in range(len(prompt)):
                emit({"ev": "logits", "id": rid, "pos": pos,
                      "values": [float((prompt[pos] + j) % 5) for j in range(vocab)]})
        seq = list(prompt)
        generated = []
        # FAKE_ENGINE_FORCED (JSON ids) forces every generation when the request itself forces nothing
        forced = msg.get("forced") or json.loads(os.environ.get("FAKE_ENGINE_FORCED") or "null")
        reason = "length"
        stop = set(msg.get("stop", []))
        max_tokens = min(int(msg.get("max_tokens", 16)), opts["ctx"] - len(prompt))
        while len(generated) < max_tokens:
            if rid in cancelled:
                reason = "cancelled"
                break
            if DELAY:
                time.sleep(DELAY)
            tok = next_token(prompt, generated, vocab)
            if forced is not None and len(generated) < len(forced):
                tok = forced[len(generated)]
            generated.append(tok)
            seq.append(tok)
            emit({"ev": "token", "id": rid, "tok": tok})
            emitted_total += 1
            if MODE in ("exit_mid_stream", "sigsegv_mid_stream") and emitted_total >= EXIT_AFTER:
                print("expert read failed: I/O error", file=sys.stderr, flush=True)
                if MODE == "sigsegv_mid_stream":
                    os.kill(os.getpid(), signal.SIGSEGV)
                sys.exit(3)
            if tok in stop:
                reason = "stop"
                break
        if rid in cancelled:
            reason = "cancelled"
        slots[slot] = seq
        totals["requests"] += 1
        totals["generated"] += len(generated)
        emit({"ev": "done", "id": rid, "reason": reason, "prompt_tokens": len(prompt),
              "prefilled_tokens": len(prompt) - reused, "generated_tokens": len(generated),
              "prefill_tps": 1000.0, "decode_tps": 100.0, "expert_hits": 30, "expert_misses": 10,
              "hit_rate": 0.75, "bytes_read": 123456, "reads": 10, "rss_bytes": 50 * 1024 * 1024})


if __name__ == "__main__":
    sys.exit(main())
