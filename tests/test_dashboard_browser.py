"""The dashboard in a real browser: headless Chromium (Debian's ``chromium`` and ``chromium-driver``) driven by
Selenium loads the page ``coli web`` opens for a tiny OLMoE behind an API key, sends a message, and must show the
streamed reply equal to the API's greedy text, then the stats and the expert heatmap updated by that request.

``coli web`` opens the browser through Python's ``webbrowser`` module, which honours ``$BROWSER``: the test points
it at a script that records the URL, then loads that URL in Chromium. A screenshot is kept (the path is printed);
``$COLIBRI_TEST_ARTIFACTS`` chooses the folder. Skipped, saying why, where Chromium, its driver or Selenium is
missing (``.ci/run`` installs them). Traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "colibri-core" / "tests"))  # core's harnesses
from cli_server import coli_server

KEY = "dashboard-test-key"
CTX = 256
MAX_TOKENS = 24
PROMPT = "The capital of France is"
WAIT_S = 60.0


def find_browser() -> tuple[str, str]:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.skip("Chromium or its driver is not installed (apt-get install chromium chromium-driver; "
                    ".ci/run does it)")
    pytest.importorskip("selenium", reason="the selenium package is not installed (noxfile TEST_REQUIREMENTS)")
    return chromium, driver


@pytest.fixture(scope="module")
def browser():
    chromium, driver_path = find_browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1000", "--no-first-run", "--disable-extensions"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def web(tiny_root, tmp_path_factory):
    pytest.importorskip("colibri_olmoe")
    from colibri.testing.tiny import tiny_model

    model = tiny_model("olmoe", tiny_root).path
    scratch = tmp_path_factory.mktemp("coli-web")
    opened = scratch / "opened-url"
    recorder = scratch / "record-url"
    recorder.write_text(f"#!/bin/sh\nprintf '%s' \"$1\" > {opened}\n")
    recorder.chmod(0o755)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_COLOR": "1", "BROWSER": f"{recorder} %s"}
    for name in ("COLI_API_KEY", "COLIBRI_API_KEY", "COLIBRI_LOAD_PLUGINS"):
        env.pop(name, None)
    # --cap 4 of 16 experts: the heatmap shows experts on disk and in the cache, and decoding reads the disk
    with coli_server(["web", "--model", str(model), "--ctx", str(CTX), "--threads", "1", "--cap", "4",
                      "--api-key", KEY, "--disk-bw", "1.5", "--log-level", "warning"], env) as (base, _proc):
        deadline = time.monotonic() + WAIT_S
        while not opened.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert opened.exists(), "coli web did not open a browser"
        yield base, opened.read_text()


def wait_for(driver, script: str, what: str, timeout: float = WAIT_S):
    """Poll a JavaScript expression in the page until it is truthy; its value."""
    deadline = time.monotonic() + timeout
    while True:
        value = driver.execute_script("return " + script)
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def text_of(driver, element_id: str) -> str:
    return driver.execute_script(f"return document.getElementById({json.dumps(element_id)}).textContent")


def greedy_reply(base: str) -> str:
    body = {"model": "m", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS,
            "temperature": 0}
    reply = httpx.post(base + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                       timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["message"]["content"]


def screenshot(driver, name: str, tmp_path_factory, capsys) -> Path:
    folder = Path(os.environ.get("COLIBRI_TEST_ARTIFACTS") or tmp_path_factory.getbasetemp() / "artifacts")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    driver.save_screenshot(str(path))
    with capsys.disabled():
        print(f"\ndashboard screenshot: {path}")
    return path


def test_chat_streams_the_greedy_text_and_the_stats_and_heatmap_follow(browser, web, tmp_path_factory, capsys):
    base, opened = web
    assert opened == base + "/"
    expected = greedy_reply(base)
    assert expected, "the tiny model's greedy reply is empty"
    browser.get(opened)
    # without the key the API refuses, and the page says so; with it the engine's figures appear
    assert "API key" in wait_for(browser, "document.getElementById('notice').textContent", "the key notice")
    key = browser.find_element("id", "key")
    key.send_keys(KEY)
    browser.execute_script("arguments[0].dispatchEvent(new Event('change'))", key)
    wait_for(browser, "document.getElementById('engine').textContent === 'ok'", "the engine badge")
    wait_for(browser, "Number(document.getElementById('heatmap').dataset.layers) > 0", "the heatmap")
    before_uses = int(browser.execute_script("return document.getElementById('heatmap').dataset.totalUses"))
    before_pixels = browser.execute_script("return document.getElementById('heatmap').toDataURL()")
    before_generated = text_of(browser, "stat-tokens")

    # every version of the reply's text the page shows, to tell a stream from one late paint
    browser.execute_script("""
        window.seen = [];
        new MutationObserver(() => {
          const a = document.querySelector('#transcript .msg.assistant:last-child .answer');
          if (a && window.seen[window.seen.length - 1] !== a.textContent) window.seen.push(a.textContent);
        }).observe(document.getElementById('transcript'), {subtree: true, childList: true, characterData: true});
    """)
    browser.find_element("id", "temperature").send_keys("0")
    max_tokens = browser.find_element("id", "max-tokens")
    max_tokens.clear()
    max_tokens.send_keys(str(MAX_TOKENS))
    browser.find_element("id", "message").send_keys(PROMPT)
    browser.find_element("id", "send").click()
    done = wait_for(browser, "(document.querySelector('#transcript .msg.assistant:last-child') || {dataset: {}})"
                             ".dataset.done", "the reply to finish")
    assert done == "1", text_of(browser, "transcript")
    answer = browser.execute_script("return document.querySelector('#transcript .msg.assistant:last-child "
                                    ".answer').textContent")
    assert answer == expected
    seen = browser.execute_script("return window.seen")
    assert len(seen) >= 2 and seen[-1] == expected and all(expected.startswith(s) for s in seen), seen

    # the request shows in the engine's figures: the stats, the request table and the heatmap
    wait_for(browser, f"document.getElementById('stat-tokens').textContent !== {json.dumps(before_generated)}",
             "the token totals to update")
    wait_for(browser, f"Number(document.getElementById('heatmap').dataset.totalUses) > {before_uses}",
             "the heatmap's use counts to grow")
    assert browser.execute_script("return document.getElementById('heatmap').toDataURL()") != before_pixels
    assert int(browser.execute_script("return document.getElementById('heatmap').dataset.resident")) > 0
    for element in ("stat-decode", "stat-hit-rate", "stat-bytes", "stat-rss"):
        assert text_of(browser, element) not in ("", "–"), element
    assert text_of(browser, "stat-decode").endswith("tok/s")
    # --disk-bw 1.5: decode speed as a share of what the disk allows at the decode phase's hit rate
    assert text_of(browser, "stat-share").endswith("%") and "(--disk-bw)" in text_of(browser, "stat-bound")
    assert wait_for(browser, "document.querySelectorAll('#profile tbody tr').length >= 2", "the request table")
    # one KV slot (free again) and the empty queue of coli serve's default --max-queue 16
    assert browser.execute_script("return [...document.querySelectorAll('#slots i')].map((i) => i.className)") == [""]
    assert text_of(browser, "queue") == "0 / 16"
    shot = screenshot(browser, "dashboard.png", tmp_path_factory, capsys)
    assert shot.stat().st_size > 10_000


def test_reasoning_is_shown_apart_from_the_answer(browser, web):
    """The tiny model writes no reasoning, so the page's own fetch is handed a recorded stream that carries some."""
    base, opened = web
    browser.get(opened)
    browser.execute_script("""
        const frames = [
          {choices: [{index: 0, delta: {role: 'assistant'}}]},
          {choices: [{index: 0, delta: {reasoning_content: 'Paris is in '}}]},
          {choices: [{index: 0, delta: {reasoning_content: 'France.'}}]},
          {choices: [{index: 0, delta: {content: 'Paris'}}]},
          {choices: [{index: 0, delta: {content: '.'}, finish_reason: 'stop'}]},
        ].map((f) => 'data: ' + JSON.stringify(f) + '\\n\\n').join('') + ': keep-alive\\n\\ndata: [DONE]\\n\\n';
        const real = window.fetch;
        window.fetch = (url, init) => url === '/v1/chat/completions'
          ? Promise.resolve(new Response(frames, {headers: {'content-type': 'text/event-stream'}}))
          : real(url, init);
    """)
    browser.find_element("id", "message").send_keys("Where is Paris?")
    browser.find_element("id", "send").click()
    wait_for(browser, "(document.querySelector('#transcript .msg.assistant:last-child') || {dataset: {}})"
                      ".dataset.done", "the reply to finish")
    last = "document.querySelector('#transcript .msg.assistant:last-child "
    assert browser.execute_script(f"return {last}.answer').textContent") == "Paris."
    assert browser.execute_script(f"return {last}.thought').textContent") == "Paris is in France."
    assert browser.execute_script(f"return {last}.reasoning').hidden") is False
