"""Refused prompts cost their bytes, not a tokenization: the bytes-per-token bound, and huge prompts under load."""

from __future__ import annotations

import sys
from pathlib import Path

import concurrent.futures
import json
import os
import random
import threading
import time

import httpx
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

sys.path.insert(0, str(Path(__file__).parent))  # the harness beside this file (importlib mode)
from serve_harness import start_server, tokenizer_dir_fixture

from colibri.server.prompt_bound import CONSERVATIVE_FACTOR, prompt_bound


model_dir = tokenizer_dir_fixture("serve-bound")


def test_the_byte_level_bound_is_exact_and_holds_on_adversarial_text(model_dir):
    backend = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    bound = prompt_bound(backend)
    assert bound.exact
    vocab = backend.get_vocab(with_added_tokens=False)
    decoded = sorted((backend.decode([i]) for i in vocab.values()), key=lambda t: -len(t.encode()))
    longest = decoded[0]
    assert bound.bytes_per_token == max(4, max(len(backend.id_to_token(i)) for i in vocab.values()),
                                        max(len(t.content.encode()) for t in backend.get_added_tokens_decoder()
                                            .values()))
    rng = random.Random(7)
    texts = [longest * 50, " " * 5000, "\u00e9\U0001F600" * 300, "".join(rng.choice(decoded[:40]) for _ in range(400)),
             "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(2000)), "<|user|>" * 100]
    for text in texts:
        tokens = len(backend.encode(text, add_special_tokens=False).ids)
        assert tokens >= bound.min_tokens(len(text.encode())), (text[:20], tokens)


def _tokenizer(model, normalizer=None, pre=None, added=()):
    tok = Tokenizer(model)
    if normalizer is not None:
        tok.normalizer = normalizer
    if pre is not None:
        tok.pre_tokenizer = pre
    if added:
        tok.add_special_tokens(list(added))
    return tok


def test_steps_that_can_shrink_text_make_the_bound_bounded_or_conservative():
    from tokenizers import AddedToken

    vocab = {"<unk>": 0, "a": 1, "b": 2, "ab": 3, "abab": 4}
    bpe = lambda **kw: models.BPE(vocab=vocab, merges=[("a", "b"), ("ab", "ab")], unk_token="<unk>", **kw)  # noqa: E731
    plain = prompt_bound(_tokenizer(bpe()))
    assert plain.exact and plain.bytes_per_token == 5   # "<unk>" is the longest spelling
    nfkc = prompt_bound(_tokenizer(bpe(), normalizer=normalizers.NFKC()))
    assert nfkc.exact and nfkc.bytes_per_token == 4 * 5
    replace = prompt_bound(_tokenizer(bpe(), normalizer=normalizers.Replace("abc", "x")))
    assert replace.exact and replace.bytes_per_token == 3 * 5
    for shrinking in (_tokenizer(bpe(), normalizer=normalizers.Strip()),
                      _tokenizer(bpe(), pre=pre_tokenizers.Whitespace()),
                      _tokenizer(bpe(fuse_unk=True)),
                      _tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>")),
                      _tokenizer(bpe(), added=[AddedToken("<s>", rstrip=True, special=True)])):
        bound = prompt_bound(shrinking)
        assert not bound.exact and bound.bytes_per_token >= CONSERVATIVE_FACTOR * 5


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_concurrent_megabyte_prompts_are_refused_without_costing_memory(model_dir):
    server = start_server(model_dir, ctx=256, slots=1, max_queue=8, max_body=2 * 1024 * 1024)
    try:
        words = " ".join(f"word{i % 977}" for i in range(150_000))[:1_000_000]   # ~1 MB of ordinary text
        bodies = [
            ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": words}]}),
            ("/v1/completions", {"model": "m", "prompt": words, "max_tokens": 4}),
            ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": words}]}),
        ] * 2
        payloads = [(path, json.dumps(body).encode()) for path, body in bodies]
        client = httpx.Client(timeout=60, limits=httpx.Limits(max_connections=16))
        client.get(server.base + "/health")
        peak = [0]
        done = threading.Event()

        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], rss_bytes())
                time.sleep(0.002)

        baseline = rss_bytes()
        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            with concurrent.futures.ThreadPoolExecutor(len(payloads)) as pool:
                responses = list(pool.map(lambda pb: client.post(server.base + pb[0], content=pb[1], headers={
                    "content-type": "application/json"}), payloads, timeout=60))
        finally:
            done.set()
            sampler.join()
        for r in responses:
            assert r.status_code == 400, r.text[:200]
            assert "context" in r.text and "bytes" in r.text
        assert server.app.state.metrics.started == 0
        # The bodies themselves (6 MB, held by both the client and the server here) and their JSON strings are
        # the whole cost; tokenizing just one of them would take hundreds of megabytes.
        assert peak[0] - baseline < 96 * 1024 * 1024, (peak[0] - baseline) / 2**20
    finally:
        server.stop()
