"""The engine process client against a fake engine speaking the protocol: results, concurrency, death."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from colibri.engine import Engine, EngineRequestError
from colibri.errors import EngineError

FAKE = Path(__file__).with_name("fake_engine.py")


def fake_argv(*extra: str, vocab: int = 256, ctx: int = 64, slots: int = 2) -> list[str]:
    return [sys.executable, str(FAKE), "--model", "/nowhere", "--ctx", str(ctx), "--slots", str(slots),
            "--cap", "0", "--threads", "1", "--set", f"vocab={vocab}", *extra]


def expected_tokens(prompt: list[int], n: int, vocab: int = 256) -> list[int]:
    return [(sum(prompt) * 31 + i * 7 + 3) % vocab for i in range(n)]


def test_generate_returns_tokens_stats_and_logits():
    with Engine(fake_argv()) as eng:
        assert eng.ready["vocab"] == 256
        res = eng.generate([5, 6, 7], max_tokens=5, logits=True)
        assert res.tokens == expected_tokens([5, 6, 7], 5)
        assert res.stats["reason"] == "length" and res.stats["generated_tokens"] == 5
        assert len(res.logits) == 3 and len(res.logits[0]) == 256
        assert res.accept["reused_tokens"] == 0


def test_stop_token_and_forced_tokens():
    with Engine(fake_argv()) as eng:
        first = expected_tokens([1, 2], 3)
        res = eng.generate([1, 2], max_tokens=10, stop=[first[2]])
        assert res.tokens == first and res.stats["reason"] == "stop"
        res = eng.generate([1, 2], max_tokens=3, forced=[9, 8, 7])
        assert res.tokens == [9, 8, 7]


def test_prefix_reuse_reported_and_reset_forgets_it():
    with Engine(fake_argv()) as eng:
        eng.generate([1, 2, 3, 4], max_tokens=2, slot=1)
        again = eng.generate([1, 2, 3, 4, 9], max_tokens=1, slot=1)
        assert again.accept["reused_tokens"] == 4 and again.stats["prefilled_tokens"] == 1
        eng.reset(1)
        fresh = eng.generate([1, 2, 3, 4, 9], max_tokens=1, slot=1)
        assert fresh.accept["reused_tokens"] == 0


def test_request_error_is_raised_and_engine_lives_on():
    with Engine(fake_argv(ctx=8)) as eng:
        with pytest.raises(EngineRequestError) as info:
            eng.generate(list(range(20)), max_tokens=1)
        assert info.value.code == "context_exceeded"
        assert eng.generate([1], max_tokens=1).tokens == expected_tokens([1], 1)
        assert eng.stats()["requests"] == 1


def test_concurrent_requests_on_different_slots():
    results: dict[int, list[int]] = {}

    def worker(eng: Engine, slot: int) -> None:
        for k in range(5):
            prompt = [slot, k, 3]
            results[(slot, k)] = eng.generate(prompt, max_tokens=4, slot=slot).tokens

    with Engine(fake_argv(slots=4)) as eng:
        threads = [threading.Thread(target=worker, args=(eng, s)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
    assert len(results) == 20
    for (slot, k), toks in results.items():
        assert toks == expected_tokens([slot, k, 3], 4)


def test_cancel_ends_with_cancelled(monkeypatch):
    monkeypatch.setenv("FAKE_TOKEN_DELAY", "0.02")
    with Engine(fake_argv()) as eng:
        req = eng.submit([1, 2], max_tokens=60)
        seen = 0
        for ev in req:
            if ev["ev"] == "token":
                seen += 1
                if seen == 2:
                    req.cancel()
        assert req.stats["reason"] == "cancelled"
        assert 2 <= len(req.tokens) < 60


def test_sigkill_during_load_names_the_oom_killer(monkeypatch):
    monkeypatch.setenv("FAKE_ENGINE_MODE", "sigkill_on_load")
    start = time.monotonic()
    with pytest.raises(EngineError) as info:
        Engine(fake_argv(), ready_timeout=30)
    assert time.monotonic() - start < 20
    text = info.value.one_line()
    assert "SIGKILL while loading" in text and "OOM killer" in text and "lower --ram" in text
    assert "allocating expert cache" in text          # the stderr tail


def test_fatal_on_load_reports_the_engine_message(monkeypatch):
    monkeypatch.setenv("FAKE_ENGINE_MODE", "fatal_on_load")
    with pytest.raises(EngineError) as info:
        Engine(fake_argv(), ready_timeout=30)
    assert "load_failed" in info.value.message and "model.norm.weight missing" in info.value.message


def test_never_ready_times_out(monkeypatch):
    monkeypatch.setenv("FAKE_ENGINE_MODE", "never_ready")
    start = time.monotonic()
    with pytest.raises(EngineError) as info:
        Engine(fake_argv(), ready_timeout=1.5)
    assert "did not become ready within 1.5 s" in info.value.message
    assert time.monotonic() - start < 15


@pytest.mark.parametrize("mode,expect", [("exit_mid_stream", "exited with code 3 while running"),
                                         ("sigsegv_mid_stream", "killed by SIGSEGV while running")])
def test_death_mid_stream_fails_every_pending_request(monkeypatch, mode, expect):
    monkeypatch.setenv("FAKE_ENGINE_MODE", mode)
    monkeypatch.setenv("FAKE_EXIT_AFTER", "3")
    eng = Engine(fake_argv())
    try:
        first = eng.submit([1, 2], max_tokens=10)
        queued = eng.submit([3, 4], max_tokens=10, slot=1)
        for req in (first, queued):
            with pytest.raises(EngineError) as info:
                req.wait(timeout=20)
            assert expect in info.value.message
            assert "expert read failed: I/O error" in info.value.one_line()
        assert len(first.tokens) == 3
        with pytest.raises(EngineError):
            eng.submit([1], max_tokens=1)
        with pytest.raises(EngineError):
            eng.stats()
    finally:
        eng.close()


def test_missing_binary_is_a_clear_error(tmp_path):
    with pytest.raises(EngineError) as info:
        Engine([str(tmp_path / "colibri-nothing")])
    assert "cannot start engine" in info.value.message


def test_close_is_idempotent_and_pending_requests_end():
    eng = Engine(fake_argv())
    eng.close()
    eng.close()
    assert not eng.alive
    with pytest.raises(EngineError):
        eng.generate([1], max_tokens=1)


def test_finished_requests_are_retired_even_if_never_read():
    with Engine(fake_argv()) as eng:
        abandoned = [eng.submit([i, 1], max_tokens=2) for i in range(5)]
        eng.generate([9], max_tokens=1)                 # served after the others: they are all done by now
        assert eng._pending == {}
        assert abandoned[3].wait(timeout=5).tokens == expected_tokens([3, 1], 2)   # still readable afterwards
