"""The streaming switches from the CLI to the engine's argv, their validation, and how results are labelled."""

from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from colibri.errors import UsageError
from colibri.launch import Streaming
from colibri.planner import STAGING_SLACK_BYTES, staging_stages, streaming_split
from colibri.records import ResourcePlan
from colibri.server.app import LossyLabel
from colibri.streaming import stats_line


def test_auto_switches_follow_the_cache():
    auto = Streaming()
    assert auto.engine_args(partial_cache=True) == ("--prefetch", "on", "--pin", "duel", "--io", "auto")
    assert auto.engine_args(partial_cache=False) == ("--prefetch", "off", "--pin", "off", "--io", "auto",
                                                     "--preload", "on")
    assert Streaming(preload=False).engine_args(partial_cache=False)[-2:] == ("--io", "auto")
    assert Streaming(lookahead=True, preload=True).engine_args(partial_cache=True)[-4:] == (
        "--lookahead", "on", "--preload", "on")
    forced = Streaming(prefetch=False, pin=True, io="direct", experts_k=4, experts_top_p=0.9)
    assert forced.engine_args(partial_cache=True) == ("--prefetch", "off", "--pin", "on", "--io", "direct",
                                                      "--experts-k", "4", "--experts-top-p", "0.9")
    assert Streaming(experts_top_p=1.0).engine_args(True)[-2:] == ("--io", "auto")   # 1.0 keeps every expert
    assert staging_stages(8) == 16 and staging_stages(1) == 4


def plan_with_spare(slots: int, spare_buffers: float, layers: int = 16, expert: int = 1 << 20) -> ResourcePlan:
    cache = slots * layers * expert
    ram = 1000 + cache + int(spare_buffers * (expert + STAGING_SLACK_BYTES))
    return ResourcePlan(ram_bytes=ram, dense_bytes=1000, kv_bytes=0, state_bytes=0, reserve_bytes=0,
                        expert_bytes=expert, experts_per_layer=64, moe_layers=layers, cache_slots_per_layer=slots,
                        cache_bytes=cache, routed_bytes_per_token=0, disk_bandwidth=0.0,
                        disk_bound_tokens_per_s=0.0, fits=True, min_ram_bytes=0)


def test_staging_buffers_come_from_the_slack_before_the_cache():
    # the rounding to whole slots left 6.5 buffers: 6 stages, the cache keeps its 14 slots
    assert streaming_split(plan_with_spare(14, 6.5), top_k=8) == (14, 6)
    # more slack than the pool wants: 2 x top-k
    assert streaming_split(plan_with_spare(14, 40), top_k=8) == (14, 16)
    # too little slack for 4: a slot per layer goes, and its 16 buffers are all used
    assert streaming_split(plan_with_spare(14, 2.5), top_k=8) == (13, 16)
    # one slot per layer stays, whatever the slack
    assert streaming_split(plan_with_spare(1, 0), top_k=8) == (1, 4)


@pytest.mark.parametrize("bad, flag", [(Streaming(io="mmap"), "--io mmap"), (Streaming(experts_k=0), "--experts-k"),
                                       (Streaming(experts_top_p=1.5), "--experts-top-p")])
def test_bad_values_name_their_flag(bad, flag):
    with pytest.raises(UsageError, match=flag):
        bad.check()


def test_stats_line_shows_switches_phases_and_lossy_routing():
    stats = {"prefilled_tokens": 4, "prefill_tps": 10.0, "generated_tokens": 2, "decode_tps": 5.0, "hit_rate": 0.5,
             "io": "direct", "prefetch": True, "pin": True, "pinned_experts": 6, "prefetch_issued": 10,
             "prefetch_used": 7, "lookahead_recall": 0.625, "io_wait_s": 0.5, "expert_s": 1.0, "attention_s": 0.25,
             "other_s": 0.25, "lossy": "experts-k=2"}
    line = stats_line(stats)
    assert "io direct, prefetch on, pin on (6 pinned), prefetched 7/10 used, lookahead recall 62%" in line
    assert "time: I/O wait 0.50s, experts 1.00s, attention 0.25s, other 0.25s" in line
    assert line.endswith("LOSSY routing: experts-k=2")
    duel = stats_line({**stats, "policy": "duel", "duel_lru_layers": 1})
    assert "prefetch on, policy duel (6 pinned, LRU leads 1 layer), prefetched" in duel
    assert "policy lru, prefetched" in stats_line({**stats, "pin": False, "policy": "lru"})
    assert "LOSSY" not in stats_line({**stats, "lossy": ""})


def test_every_response_of_a_lossy_server_is_labelled():
    app = Starlette(routes=[Route("/x", lambda request: PlainTextResponse("hi"))])
    client = TestClient(LossyLabel(app, "experts-k=4"))
    assert client.get("/x").headers["x-colibri-lossy"] == "experts-k=4"


def test_prefill_chunk_grows_only_when_experts_stream_and_the_scratch_allows():
    from types import SimpleNamespace

    from colibri.launch import prefill_chunk
    from colibri.records import Geometry

    def facts(heads):
        return SimpleNamespace(geometry=Geometry("m", "a", "b", num_heads=heads))

    assert prefill_chunk(facts(16), 4096, partial_cache=False) is None      # all resident: the engine's 32
    assert prefill_chunk(facts(16), 4096, partial_cache=True) == 128        # 128 x 16 x 4096 x 4 B = 32 MiB
    assert prefill_chunk(facts(128), 4096, partial_cache=True) is None      # 64 MiB allows 32: no gain, default
    assert prefill_chunk(facts(64), 4096, partial_cache=True) == 64
