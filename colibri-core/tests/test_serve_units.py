"""Units of coli serve that need no server: stop sequences, the slot scheduler, request parsing, CLI helpers."""

from __future__ import annotations

import asyncio

import pytest

from colibri.cli.serve import check_bind, is_loopback, parse_size
from colibri.errors import UsageError
from colibri.server.errors import APIError
from colibri.server.generation import conversation_key
from colibri.server.scheduler import SlotScheduler
from colibri.server.textgen import StopMatcher
from colibri.server.validation import parse_chat, parse_completion, parse_messages


def feed_all(stops, pieces):
    matcher = StopMatcher(stops)
    shown = [matcher.feed(p) for p in pieces]
    return shown, matcher.flush(), matcher.matched


def test_stop_split_across_deltas_is_held_then_cut():
    shown, tail, matched = feed_all(["END"], ["hello E", "N", "D more"])
    assert shown == ["hello ", "", ""] and tail == "" and matched == "END"


def test_false_start_of_a_stop_is_released():
    shown, tail, matched = feed_all(["END"], ["a E", "Nx", "b"])
    assert "".join(shown) + tail == "a ENxb" and matched is None
    assert shown[0] == "a " and shown[1] == "ENx"


def test_earliest_of_several_stops_wins_and_held_tail_flushes_at_the_end():
    shown, _, matched = feed_all(["xyz", "b"], ["aaxy", "zb"])
    assert "".join(shown) == "aa" and matched == "xyz"
    shown, tail, matched = feed_all(["STOP"], ["the ST"])
    assert shown == ["the "] and tail == "ST" and matched is None


def run(coro):
    return asyncio.run(coro)


def test_scheduler_keeps_a_conversation_on_its_slot():
    async def scenario():
        s = SlotScheduler(slots=2, max_queue=2, queue_timeout=1)
        a = await s.acquire("A")
        b = await s.acquire("B")
        assert {a.slot, b.slot} == {0, 1}
        a.release()
        b.release()
        again_b = await s.acquire("B")
        again_a = await s.acquire("A")
        assert again_b.slot == b.slot and again_a.slot == a.slot and again_a.reused_owner
        again_a.release()
        again_b.release()

    run(scenario())


def test_scheduler_queue_is_fifo_bounded_and_times_out():
    async def scenario():
        s = SlotScheduler(slots=1, max_queue=2, queue_timeout=0.3)
        held = await s.acquire(None)
        order = []

        async def waiter(name):
            lease = await s.acquire(name)
            order.append(name)
            await asyncio.sleep(0.01)
            lease.release()

        first = asyncio.create_task(waiter("first"))
        await asyncio.sleep(0.01)
        second = asyncio.create_task(waiter("second"))
        await asyncio.sleep(0.01)
        with pytest.raises(APIError) as full:
            await s.acquire("third")
        assert full.value.status == 429 and full.value.code == "queue_full"
        assert int(full.value.headers["Retry-After"]) >= 1
        held.release()
        await asyncio.gather(first, second)
        assert order == ["first", "second"] and s.busy == 0 and s.queued == 0
        blocker = await s.acquire(None)
        with pytest.raises(APIError) as late:
            await s.acquire(None)
        assert late.value.code == "queue_timeout" and s.queued == 0
        blocker.release()
        assert s.busy == 0

    run(scenario())


def test_pinned_waiter_lets_others_pass():
    async def scenario():
        s = SlotScheduler(slots=2, max_queue=4, queue_timeout=2)
        zero = await s.acquire(None, pinned=0)
        one = await s.acquire(None, pinned=1)
        pinned = asyncio.create_task(s.acquire(None, pinned=0))
        await asyncio.sleep(0.01)
        free = asyncio.create_task(s.acquire(None))
        await asyncio.sleep(0.01)
        one.release()
        got = await asyncio.wait_for(free, 1)
        assert got.slot == 1 and not pinned.done()
        zero.release()
        assert (await asyncio.wait_for(pinned, 1)).slot == 0

    run(scenario())


def test_cancelled_waiter_leaves_the_queue():
    async def scenario():
        s = SlotScheduler(slots=1, max_queue=1, queue_timeout=5)
        held = await s.acquire(None)
        task = asyncio.create_task(s.acquire(None))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert s.queued == 0
        held.release()
        assert s.busy == 0

    run(scenario())


def test_conversation_key_follows_the_opening_messages():
    base = [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"}]
    later = parse_chat({"messages": base + [{"role": "assistant", "content": "a"},
                                            {"role": "user", "content": "u2"}]}, "m", 1)
    first = parse_chat({"messages": base}, "m", 1)
    other = parse_chat({"messages": [{"role": "user", "content": "different"}]}, "m", 1)
    assert conversation_key(first) == conversation_key(later) != conversation_key(other)
    assert conversation_key(parse_chat({"messages": base, "user": "ada"}, "m", 1)) == "user:ada"


def test_parsers_flatten_and_default():
    spec = parse_chat({"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                                      {"type": "text", "text": "b"}]},
                                    {"role": "user", "content": "q"}], "max_completion_tokens": 5,
                       "stop": "X"}, "served", 1)
    assert spec.messages[0] == {"role": "system", "content": "ab"} and spec.max_tokens == 5
    assert spec.stop == ["X"] and spec.model == "served" and spec.temperature is None
    assert parse_completion({"prompt": ["one prompt"]}, "m", 1).prompt_text == "one prompt"
    assert parse_completion({"prompt": [[1, 2, 3]]}, "m", 1).prompt_ids == [1, 2, 3]
    assert parse_completion({"prompt": "x"}, "m", 1).max_tokens == 16
    assert parse_completion({"prompt": ["a", [5, 6]]}, "m", 1).prompt_batch == [("a", None), (None, [5, 6])]
    with pytest.raises(APIError) as err:
        parse_completion({"prompt": ["a", 5]}, "m", 1)
    assert err.value.param == "prompt"
    msgs = parse_messages({"max_tokens": 3, "system": [{"type": "text", "text": "sys"}],
                           "messages": [{"role": "user", "content": "hi"}], "metadata": {"user_id": "u"}}, "m", 1)
    assert msgs.messages[0] == {"role": "system", "content": "sys"} and msgs.user == "u"
    prefill = parse_messages({"max_tokens": 3, "messages": [{"role": "user", "content": "hi"},
                                                            {"role": "assistant", "content": "pre"}]}, "m", 1)
    assert prefill.continue_final and prefill.messages[-1] == {"role": "assistant", "content": "pre"}
    empty = parse_messages({"max_tokens": 3, "messages": [{"role": "user", "content": "hi"},
                                                          {"role": "assistant", "content": ""}]}, "m", 1)
    assert not empty.continue_final and empty.messages == [{"role": "user", "content": "hi"}]


def test_cli_helpers():
    assert parse_size("1MiB") == 1024 * 1024 and parse_size("512k") == 512 * 1024 and parse_size("2048") == 2048
    assert parse_size("8G", "--kv-disk-budget") == 8 * 1024 ** 3 and parse_size("1.5GiB") == 3 * 1024 ** 3 // 2
    for bad in ("", "-1", "1TiB", "lots"):
        with pytest.raises(UsageError):
            parse_size(bad)
    with pytest.raises(UsageError, match="--kv-disk-budget"):
        parse_size("much", "--kv-disk-budget")
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and is_loopback("127.8.0.1")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.5") and not is_loopback("myhost")
    check_bind("127.0.0.1", None)
    check_bind("0.0.0.0", "key")
    with pytest.raises(UsageError, match="API key"):
        check_bind("::", None)


@pytest.mark.parametrize("flag, value", [("--header-timeout", "0"), ("--body-timeout", "-1"),
                                         ("--max-connections", "0"), ("--max-connections-per-client", "0")])
def test_cli_refuses_bad_connection_limits_in_one_line(monkeypatch, flag, value):
    from typer.testing import CliRunner

    from colibri.cli import app

    result = CliRunner().invoke(app, ["serve", "--model", "/nonexistent", flag, value])
    assert result.exit_code == 1
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and flag in lines[0], result.output
