"""``coli chat --attach``: the terminal chat on a pseudo-terminal, driving a running ``coli serve`` (the fake
family's engine behind an API key) over the streaming API; and, with no server there, an engine of its own."""

from __future__ import annotations

import os
import pty
import signal
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from colibri.attach import DEFAULT_URL, server_url
from colibri.demo_tokenizer import stdlib_texts, train_bpe

sys.path.insert(0, str(Path(__file__).resolve().parent))  # --import-mode=importlib adds no test dir
from cli_server import coli_server, free_port
from fakefamily import HERE, install_engine_wrapper, make_checkpoint

KEY = "attach-test-key"
MAX_TOKENS = 40
FAKE = (sys.executable, str(HERE / "fakefamily.py"))   # the coli CLI with the fake family registered


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    """A fake-family checkpoint and the environment its CLI runs in (engine wrapper, private cache and home)."""
    root = tmp_path_factory.mktemp("attach")
    model = make_checkpoint(root / "model", train_bpe(stdlib_texts(200_000), 700))
    env = {**os.environ, "COLIBRI_LOAD_PLUGINS": "", "COLIBRI_CACHE": str(root / "cache"), "HOME": str(root),
           "FAKE_ENGINE_BIN": str(install_engine_wrapper(root)), "PYTHONPATH": str(HERE), "TERM": "xterm",
           "NO_COLOR": "1"}
    for name in ("COLI_API_KEY", "COLIBRI_API_KEY", "FAKE_ENGINE_MODE"):
        env.pop(name, None)
    return model, env


@pytest.fixture(scope="module")
def server(setting):
    model, env = setting
    # slow enough tokens that a Ctrl-C lands mid-reply
    with coli_server(["serve", "--model", str(model), "--ctx", "256", "--api-key", KEY, "--log-level", "warning"],
                     {**env, "FAKE_TOKEN_DELAY": "0.03"}, command=FAKE) as (base, _proc):
        yield base


class Terminal:
    """A process on a pseudo-terminal, read as a person would see its screen."""

    def __init__(self, argv: list[str], env: dict[str, str]):
        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True,
                                     start_new_session=True, preexec_fn=_controlling_tty)
        os.close(slave)
        self.screen = ""

    def type(self, text: str) -> None:
        os.write(self.master, text.encode())

    def expect(self, pattern: str, timeout: float = 30.0) -> str:
        """The screen from where the last expect stopped up to the end of ``pattern``'s match."""
        deadline = time.monotonic() + timeout
        while not (found := re.search(pattern, self.screen)):
            if time.monotonic() > deadline or self.proc.poll() is not None and not self._ready(0):
                raise AssertionError(f"timed out waiting for {pattern!r}; screen: {self.screen!r}")
            if self._ready(0.1):
                try:
                    chunk = os.read(self.master, 65536)
                except OSError:
                    chunk = b""
                self.screen += chunk.decode("utf-8", "replace").replace("\r\n", "\n")
        seen, self.screen = self.screen[:found.end()], self.screen[found.end():]
        return seen

    def _ready(self, timeout: float) -> bool:
        return bool(select.select([self.master], [], [], timeout)[0])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.master)


def _controlling_tty() -> None:
    import fcntl
    import termios

    fcntl.ioctl(0, termios.TIOCSCTTY, 0)   # a new session has no controlling terminal: Ctrl-C would send nothing
    # a suite started in the background of a non-interactive shell inherits SIGINT ignored; a terminal's user has
    # the default
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def greedy(base: str, messages: list[dict[str, str]]) -> str:
    body = {"model": "m", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
    reply = httpx.post(base + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                       timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["message"]["content"]


def test_attached_chat_streams_the_servers_text_with_reset_stats_and_ctrl_c(setting, server):
    _model, env = setting
    first, second = "hello there", "and once more"
    expected = greedy(server, [{"role": "user", "content": first}])
    term = Terminal([*FAKE, "chat", "--attach", server, "--api-key", KEY, "--temp", "0", "--max-tokens",
                     str(MAX_TOKENS)], env)
    try:
        assert f"attached to model at {server}" in term.expect(r">>> ")
        term.type(first + "\r")
        reply = term.expect(r"prefill .* tok/s.*\n>>> ")
        assert expected in reply, (expected, reply)
        follow = greedy(server, [{"role": "user", "content": first}, {"role": "assistant", "content": expected},
                                 {"role": "user", "content": second}])
        term.type(second + "\r")
        assert follow in term.expect(r"prefill .* tok/s.*\n>>> ")
        term.type("/stats\r")
        stats = term.expect(r"engine: .*\n>>> ")
        prompt, reused, prefilled = map(int, re.search(r"last turn: (\d+) prompt tokens = (\d+) reused \+ (\d+) "
                                                       r"prefilled", stats).groups())
        assert reused > 0 and prompt == reused + prefilled, "the server's slot kept the conversation"
        assert "conversation: 2 turns" in stats and "\nengine: " in stats
        term.type("/reset\r")
        term.expect(r"\(conversation reset\)\n>>> ")
        term.type("/stats\r")
        assert "no turns yet" in term.expect(r"engine: .*\n>>> ")

        term.type("tell me a long story\r")
        time.sleep(0.4)                    # a few tokens stream, far fewer than MAX_TOKENS at 0.03 s each
        term.type("\x03")                  # Ctrl-C as the terminal sends it
        assert "cancelled" in term.expect(r"\(reply stopped\)\n.*\n>>> ")
        term.type("/stats\r")
        generated = int(re.search(r"; (\d+) generated", term.expect(r"engine: .*\n>>> ")).group(1))
        assert 0 < generated < MAX_TOKENS
        term.type("/exit\r")
        assert term.proc.wait(timeout=30) == 0
    finally:
        term.close()


def test_without_a_server_it_runs_an_engine_here(setting):
    model, env = setting
    nobody = f"http://127.0.0.1:{free_port()}"
    local = subprocess.run([*FAKE, "chat", "--attach", nobody, "--model", str(model), "--temp", "0", "-n", "8"],
                           input="hi\n", capture_output=True, text=True, env=env, timeout=120)
    assert local.returncode == 0, local.stderr
    assert f"no colibri server answers at {nobody}: running an engine here" in local.stderr
    assert local.stdout.strip(), "the local engine answered"
    stranded = subprocess.run([*FAKE, "chat", "--attach", nobody], input="hi\n", capture_output=True, text=True,
                              env={k: v for k, v in env.items() if k not in ("COLI_MODEL", "COLIBRI_MODEL")},
                              timeout=120)
    assert stranded.returncode == 1
    (line,) = stranded.stderr.strip().splitlines()
    assert line.startswith(f"error: --attach: no colibri server answers at {nobody}") and "coli serve" in line


def test_a_wrong_key_is_one_line_naming_the_fix(setting, server):
    _model, env = setting
    refused = subprocess.run([*FAKE, "chat", "--attach", server, "--api-key", "wrong"], input="hi\n",
                             capture_output=True, text=True, env=env, timeout=60)
    assert refused.returncode == 1
    (line,) = refused.stderr.strip().splitlines()
    assert "needs its API key" in line and "--api-key" in line


@pytest.mark.parametrize("given, expected", [
    (None, DEFAULT_URL), ("127.0.0.1:9000", "http://127.0.0.1:9000"), ("http://host:1/v1/", "http://host:1"),
    ("https://example.test/", "https://example.test"),
])
def test_server_url(given, expected):
    assert server_url(given) == expected
