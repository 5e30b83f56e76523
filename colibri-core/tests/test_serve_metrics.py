"""``/metrics`` histograms and the one-line-per-request access log of ``coli serve``, over the fake engine
(127.0.0.1 only). The exposition is parsed with prometheus_client's own parser, so it is Prometheus' format."""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).parent))  # the harness beside this file (importlib mode)
from serve_harness import build_tokenizer_dir, start_server

MESSAGES = [{"role": "user", "content": "Name three birds."}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tokenizer_dir(tmp_path_factory.mktemp("serve-metrics") / "tiny-chat")


def scrape(base: str) -> dict[str, object]:
    text = httpx.get(base + "/metrics", timeout=10).text
    return {family.name: family for family in text_string_to_metric_families(text)}


def sample(families, family: str, name: str, **labels) -> float:
    for s in families[family].samples:
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise AssertionError(f"no sample {name} {labels} in {family}")


def test_histograms_count_every_request_and_token(model_dir, caplog):
    running = start_server(model_dir, ctx=256, slots=2)
    try:
        before = scrape(running.base)
        for name in ("colibri_time_to_first_token_seconds", "colibri_time_per_output_token_seconds",
                     "colibri_request_duration_seconds"):
            assert before[name].type == "histogram"
        assert sample(before, "colibri_time_to_first_token_seconds", "colibri_time_to_first_token_seconds_count") == 0
        caplog.set_level(logging.INFO, logger="colibri.server.access")
        completions = []
        for n in (5, 8):
            body = {"model": "m", "messages": MESSAGES, "max_tokens": n, "temperature": 0}
            reply = httpx.post(running.base + "/v1/chat/completions", json=body, timeout=30).json()
            completions.append(reply["usage"]["completion_tokens"])
        with httpx.stream("POST", running.base + "/v1/completions", timeout=30,
                          json={"model": "m", "prompt": "Once upon", "max_tokens": 6, "stream": True}) as r:
            assert r.status_code == 200
            r.read()
        refused = httpx.post(running.base + "/v1/chat/completions", json={"model": "m"}, timeout=30)
        assert refused.status_code == 400
        after = scrape(running.base)
    finally:
        running.stop()
    generated = sum(completions) + 6
    ttft = "colibri_time_to_first_token_seconds"
    tpot = "colibri_time_per_output_token_seconds"
    duration = "colibri_request_duration_seconds"
    assert sample(after, ttft, ttft + "_count") == 3                        # one first token per generation
    assert sample(after, tpot, tpot + "_count") == generated - 3            # every later token's gap
    assert sample(after, ttft, ttft + "_bucket", le="+Inf") == 3
    assert 0 < sample(after, ttft, ttft + "_sum") < 30
    assert sample(after, duration, duration + "_count", route="chat") == 3   # two answered, one refused
    assert sample(after, duration, duration + "_count", route="completions") == 1
    assert sample(after, duration, duration + "_count", route="metrics") == 1   # the first scrape
    # the existing names keep working, through the same parser
    assert sample(after, "colibri_generated_tokens", "colibri_generated_tokens_total") == generated
    assert sample(after, "colibri_requests", "colibri_requests_total", route="chat", code="200") == 2
    assert sample(after, "colibri_requests", "colibri_requests_total", route="chat", code="400") == 1
    assert sample(after, "colibri_engine_up", "colibri_engine_up") == 1

    lines = [r.getMessage() for r in caplog.records if r.name == "colibri.server.access"]
    pattern = re.compile(r"^(GET|POST) (\S+) (\S+) (\d{3}) tokens=(\S+) (\d+\.\d{3})s$")
    parsed = [pattern.match(line) for line in lines]
    assert all(parsed), lines
    chats = [m for m in parsed if m.group(2) == "/v1/chat/completions"]
    assert [(m.group(3), m.group(4)) for m in chats] == [("chat", "200"), ("chat", "200"), ("chat", "400")]
    prompt = chats[0].group(5).split("+")[0]
    assert [m.group(5) for m in chats[:2]] == [f"{prompt}+{c}" for c in completions]
    assert chats[2].group(5) == "-"                                          # refused before tokenizing
    streamed = [m for m in parsed if m.group(2) == "/v1/completions"]
    assert len(streamed) == 1 and streamed[0].group(5).endswith("+6") and streamed[0].group(4) == "200"
    assert any(m.group(1, 2, 3, 4) == ("GET", "/metrics", "metrics", "200") for m in parsed)
    assert all(r.levelno == logging.INFO for r in caplog.records if r.name == "colibri.server.access")
