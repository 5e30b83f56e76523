"""The README's serving examples run as printed (port swapped) against a live server: the curl command and the
``openai`` client snippet. Docs that drift from the API fail here."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # the harness beside this file (importlib mode)
from serve_harness import build_tokenizer_dir, start_server

README = Path(__file__).resolve().parents[2] / "README.md"


def serving_blocks() -> tuple[str, str]:
    section = README.read_text().split("## Serving", 1)[1].split("\n## ", 1)[0]
    shell = re.search(r"```\n(curl .*?)```", section, re.S).group(1)
    python = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    return shell, python


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    running = start_server(build_tokenizer_dir(tmp_path_factory.mktemp("readme") / "tiny-chat"), ctx=256)
    yield running
    running.stop()


def test_readme_curl_example(server):
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    shell, _ = serving_blocks()
    command = shell.replace("http://127.0.0.1:8000", server.base)
    assert command != shell, "the README example must target the default 127.0.0.1:8000"
    out = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60, check=True).stdout
    reply = json.loads(out)
    assert reply["object"] == "chat.completion" and reply["choices"][0]["message"]["content"]
    assert reply["usage"]["completion_tokens"] >= 1


def test_readme_openai_example(server):
    _, python = serving_blocks()
    code = python.replace("http://127.0.0.1:8000", server.base)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README.md", "exec"), {})
    assert printed.getvalue().strip(), "the streamed reply printed nothing"
