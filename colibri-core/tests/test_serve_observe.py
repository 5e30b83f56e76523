"""``GET /experts``, ``GET /profile`` and the dashboard's static files, over the fake engine (127.0.0.1 only).

The real engine's per-expert counts are checked against its own counters in colibri-olmoe's engine tests; the
browser test (test_dashboard_browser.py) drives the page itself."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))  # the harness beside this file (importlib mode)
from serve_harness import build_tokenizer_dir, start_server

KEY = "sekrit-observe"
AUTH = {"Authorization": f"Bearer {KEY}"}
GB = 1e9
MESSAGES = [{"role": "user", "content": "Name three birds."}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tokenizer_dir(tmp_path_factory.mktemp("serve-observe") / "tiny-chat")


@pytest.fixture(scope="module")
def served(model_dir):
    running = start_server(model_dir, ctx=256, slots=2, api_key=KEY, disk_bandwidth=2 * GB,
                           disk_bandwidth_source="--disk-bw", routed_bytes_per_token=4000)
    try:
        yield running
    finally:
        running.stop()


def chat(base: str, max_tokens: int, messages=MESSAGES) -> dict:
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    reply = httpx.post(base + "/v1/chat/completions", json=body, headers=AUTH, timeout=30)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_the_observing_routes_need_the_key_and_the_page_does_not(served):
    for path in ("/experts", "/profile"):
        refused = httpx.get(served.base + path, timeout=10)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "missing_api_key"
        assert httpx.get(served.base + path, headers={"Authorization": "Bearer nope"},
                         timeout=10).status_code == 401
        assert httpx.get(served.base + path, headers=AUTH, timeout=10).status_code == 200
    for path, media in (("/", "text/html"), ("/ui/dashboard.js", "text/javascript"), ("/ui/dashboard.css",
                                                                                       "text/css")):
        page = httpx.get(served.base + path, timeout=10)
        assert page.status_code == 200 and page.headers["content-type"].startswith(media)
        # the page may reach its own server only: no external script, style, image or connection
        csp = page.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "connect-src 'self'" in csp and "script-src 'self'" in csp
        assert not re.search(r"https?://", page.text), f"{path} names an external address"
    html = httpx.get(served.base + "/", timeout=10).text
    assert 'src="/ui/dashboard.js"' in html and 'href="/ui/dashboard.css"' in html
    assert httpx.get(served.base + "/ui/other.js", headers=AUTH, timeout=10).status_code == 404


def test_profile_keeps_each_request_with_its_disk_bound(served):
    first = chat(served.base, 6)
    conversation = [*MESSAGES, {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                    {"role": "user", "content": "And three fish?"}]
    second = chat(served.base, 4, conversation)
    profile = httpx.get(served.base + "/profile?n=2", headers=AUTH, timeout=10).json()
    assert profile["model"] == "tiny-chat" and profile["slots"] == 2 and profile["busy_slots"] == []
    assert profile["queued"] == 0 and profile["engine"] == "ready"
    assert profile["disk"] == {"bandwidth_bytes_per_s": 2 * GB, "source": "--disk-bw",
                               "routed_bytes_per_token": 4000, "cold_tokens_per_s": 2 * GB / 4000}
    older, newer = profile["requests"]
    assert newer["seq"] == older["seq"] + 1 and older["route"] == newer["route"] == "chat"
    for record, reply in ((older, first), (newer, second)):
        usage = reply["usage"]
        assert record["prompt_tokens"] == usage["prompt_tokens"]
        assert record["generated_tokens"] == usage["completion_tokens"]
        assert record["cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
        # the fake engine reports 50 tok/s at a 0.75 hit rate: the disk allows 2e9 / (0.25 * 4000) tok/s
        assert record["decode_tps"] == 50.0 and record["hit_rate"] == 0.75
        assert record["disk_bound_tps"] == pytest.approx(2e6)
        assert record["share_of_disk_bound"] == pytest.approx(50.0 / 2e6)
        assert record["bytes_read"] == 1000 * usage["completion_tokens"]
    assert newer["cached_tokens"] >= older["prompt_tokens"], "the second turn reused the first turn's prefix"
    assert profile["totals"]["generated_tokens"] >= older["generated_tokens"] + newer["generated_tokens"]
    assert len(httpx.get(served.base + "/profile?n=1", headers=AUTH, timeout=10).json()["requests"]) == 1
    for bad in ("0", "x", "100000"):
        refused = httpx.get(served.base + f"/profile?n={bad}", headers=AUTH, timeout=10)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "n"


def test_experts_reports_each_layer_from_the_engine_stats(served):
    before = httpx.get(served.base + "/experts", headers=AUTH, timeout=10).json()
    chat(served.base, 5, [{"role": "user", "content": "Something else entirely."}])
    after = httpx.get(served.base + "/experts", headers=AUTH, timeout=10).json()
    (layer,) = after["layers"]
    assert layer["layer"] == 0 and layer["experts"] == 4 and layer["cache_slots"] == 2
    assert layer["resident"] == [1, 2, 0, 0] and layer["hit_rate"] == 0.75
    assert sum(layer["uses"]) > sum(before["layers"][0]["uses"]), "a new request must show in the use counts"
    assert after["expert_hits"] == layer["hits"] and after["rss_bytes"] == 1 << 20


def test_experts_is_503_while_the_engine_loads(model_dir):
    running = start_server(model_dir, api_key=KEY, wait=False, env={"SERVE_FAKE_LOAD_DELAY": "3"})
    try:
        loading = httpx.get(running.base + "/experts", headers=AUTH, timeout=10)
        assert loading.status_code == 503 and loading.json()["error"]["code"] == "engine_unavailable"
        assert httpx.get(running.base + "/profile", headers=AUTH, timeout=10).json()["engine"] == "loading"
    finally:
        running.stop()


def test_a_record_takes_the_decode_phase_for_the_disk_bound():
    from colibri.server.observe import DiskBound, Profile

    profile = Profile(DiskBound(1e9, "--disk-bw", 1000), keep=2)
    done = {"reason": "length", "prompt_tokens": 10, "prefilled_tokens": 4, "generated_tokens": 8,
            "prefill_tps": 100.0, "decode_tps": 40.0, "hit_rate": 0.5, "bytes_read": 9000,
            "io_wait_s": 1.0, "expert_s": 2.0, "attention_s": 0.5, "other_s": 0.5,
            "decode": {"hit_rate": 0.9, "bytes_read": 800, "io_wait_s": 0.1, "expert_s": 0.3, "attention_s": 0.1,
                       "other_s": 0.0}}
    for _ in range(3):
        profile.record(done, "messages", 1, user="u")
    (older, newer) = profile.last(5)
    assert profile.count == 3 and (older["seq"], newer["seq"]) == (2, 3), "only the newest `keep` are kept"
    assert newer["cached_tokens"] == 6 and newer["io_wait_share"] == 0.25 and newer["decode"]["io_wait_share"] == 0.2
    # the prompt's misses do not dilute it: 1e9 / ((1 - 0.9) x 1000) tok/s
    assert newer["disk_bound_tps"] == pytest.approx(1e7) and newer["share_of_disk_bound"] == pytest.approx(4e-6)
    assert (newer["route"], newer["slot"], newer["user"]) == ("messages", 1, "u")
    assert DiskBound().tokens_per_s(0.5) is None and DiskBound(1e9, "x", 1000).tokens_per_s(1.0) is None


def test_metrics_gauge_reports_the_latest_decode_as_a_share_of_the_disk_bound(served):
    from prometheus_client.parser import text_string_to_metric_families

    chat(served.base, 3)
    text = httpx.get(served.base + "/metrics", headers=AUTH, timeout=10).text
    gauges = {f.name: f for f in text_string_to_metric_families(text)}
    share = gauges["colibri_decode_disk_bound_share"]
    assert share.type == "gauge" and share.samples[0].value == pytest.approx(50.0 / 2e6)


def test_an_unknown_disk_bound_is_nan_on_metrics_and_none_in_the_done_fields():
    import math

    from colibri.server.observe import DiskBound, Profile

    profile = Profile(DiskBound(0.0, "unknown: run coli tune", 1000))
    assert math.isnan(profile.latest_share())
    done = {"decode_tps": 5.0, "hit_rate": 0.5}
    assert profile.disk.share(done) == {"disk_bound_tps": None, "share_of_disk_bound": None,
                                        "disk_bound_source": "unknown: run coli tune"}
    profile.record(done, "chat", 0)
    assert math.isnan(profile.latest_share())
