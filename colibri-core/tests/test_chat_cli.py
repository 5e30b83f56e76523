"""``coli chat``: piped stdin, multi-line input, prefix reuse across turns, /reset, /stats, Ctrl-C on a pty."""

from __future__ import annotations

import fcntl
import os
import pty
import signal
import re
import select
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from colibri import plugins
from colibri.chat_input import read_message
from colibri.chat_session import ChatSession
from colibri.cli import app
from colibri.demo_tokenizer import stdlib_texts, train_bpe
from colibri.engine import Engine
from colibri.prompt import Sampling
from colibri.tokenizer import load_tokenizer_dir

sys.path.insert(0, str(Path(__file__).resolve().parent))  # --import-mode=importlib adds no test dir
from fakefamily import HERE, install_engine_wrapper, make_checkpoint, register


@pytest.fixture(scope="module")
def trained():
    return train_bpe(stdlib_texts(200_000), 700)


@pytest.fixture
def fake(tmp_path, monkeypatch, trained):
    monkeypatch.setenv("COLIBRI_LOAD_PLUGINS", "")
    monkeypatch.setenv("COLIBRI_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("FAKE_ENGINE_BIN", str(install_engine_wrapper(tmp_path)))
    monkeypatch.delenv("FAKE_ENGINE_MODE", raising=False)
    plugins.reset()
    register()
    yield make_checkpoint(tmp_path / "model", trained)
    plugins.reset()


def lines_reader(lines):
    it = iter(lines)

    def read(_prompt):
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None
    return read


@pytest.mark.parametrize("lines,expected", [
    (["one line"], "one line"),
    (["first \\", "second \\", "third"], "first \nsecond \nthird"),
    (['"""', "a", "", "  b", '"""'], "a\n\n  b"),
    (['"""pasted', "middle", 'end"""'], "pasted\nmiddle\nend"),
    (['"""inline"""'], "inline"),
    (['"""', "never closed"], "never closed"),
])
def test_multiline_input(lines, expected):
    assert read_message(lines_reader(lines)) == expected


def test_session_reuses_the_prefix_and_reset_forgets_it(fake, tmp_path):
    tok = load_tokenizer_dir(fake)
    argv = [os.environ["FAKE_ENGINE_BIN"], "--model", str(fake), "--ctx", "256", "--slots", "1", "--cap", "0",
            "--threads", "1", "--set", f"vocab={tok.vocab_size}"]
    with Engine(argv) as eng:
        session = ChatSession(eng, tok, Sampling(0.0, 1.0, 0, 0), max_tokens=6, ctx=256, system="Be brief.")
        out: list[str] = []
        first = session.turn("hello there", out.append)
        second = session.turn("and again", out.append)
        assert [m["role"] for m in session.messages] == ["system", "user", "assistant", "user", "assistant"]
        assert session.messages[2]["content"] == first.text
        t1, t2 = session.turns
        assert t1.reused_tokens == 0 and t1.prefilled_tokens == t1.prompt_tokens
        # The second prompt starts with the first turn's prompt, so at least that much is reused.
        assert t2.reused_tokens >= t1.prompt_tokens and t2.prefilled_tokens == t2.prompt_tokens - t2.reused_tokens
        assert "".join(out) == first.text + second.text
        session.reset()
        assert session.messages == [{"role": "system", "content": "Be brief."}]
        session.turn("fresh", out.append)
        assert session.turns[-1].reused_tokens == 0


def test_history_is_trimmed_to_fit_the_context(fake):
    tok = load_tokenizer_dir(fake)
    argv = [os.environ["FAKE_ENGINE_BIN"], "--ctx", "120", "--slots", "1", "--set", f"vocab={tok.vocab_size}"]
    with Engine(argv) as eng:
        session = ChatSession(eng, tok, Sampling(0.0, 1.0, 0, 0), max_tokens=4, ctx=120)
        for i in range(8):
            session.turn(f"message number {i} with some words in it", lambda _t: None)
        assert session.dropped_messages > 0
        assert session.messages[-2]["content"].startswith("message number 7")
        assert all(t.prompt_tokens + 4 <= 120 for t in session.turns)


def test_piped_chat(fake):
    script = "hello\n/stats\nsecond \\\nline\n/reset\n/stats\nthird\n/exit\nnever sent\n"
    res = CliRunner().invoke(app, ["chat", "--model", str(fake), "--temp", "0", "--max-tokens", "5", "--ctx", "256"],
                             input=script, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    out = res.stdout
    assert ">>>" not in out                                 # no prompts when not on a terminal
    m = re.search(r"last turn: (\d+) prompt tokens = (\d+) reused \+ (\d+) prefilled", out)
    assert m and int(m.group(2)) == 0 and int(m.group(1)) == int(m.group(3))
    assert "(conversation reset)" in out and "no turns yet" in out
    assert "engine: requests 2" in out                      # the engine's own counters, after two turns
    assert "never sent" not in out


def _read_until(fd: int, pattern: str, timeout: float = 30.0) -> str:
    buf = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                break
            if not chunk:
                break
            buf += chunk
            if re.search(pattern, buf.decode("utf-8", "replace")):
                return buf.decode("utf-8", "replace")
    raise AssertionError(f"timed out waiting for {pattern!r}; got {buf.decode('utf-8', 'replace')!r}")


def _take_controlling_tty() -> None:
    # A new session has no controlling terminal; without one the pty's Ctrl-C would send no SIGINT.
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    # A suite started in the background of a non-interactive shell inherits SIGINT ignored (and Python keeps an
    # ignored SIGINT ignored); a user at a terminal has the default.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_tty_chat_ctrl_c_stops_the_reply_not_the_program(fake, tmp_path):
    env = {**os.environ, "FAKE_TOKEN_DELAY": "0.05", "PYTHONPATH": str(HERE), "HOME": str(tmp_path),
           "TERM": "xterm"}
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, str(HERE / "fakefamily.py"), "chat", "--model", str(fake),
                             "--temp", "0", "--max-tokens", "200", "--ctx", "256"],
                            stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True,
                            start_new_session=True, preexec_fn=_take_controlling_tty)
    os.close(slave)
    try:
        _read_until(master, r">>> ")
        os.write(master, b"tell me a long story\r")
        time.sleep(0.6)                                       # some tokens stream, far fewer than 200
        os.write(master, b"\x03")                             # Ctrl-C as the terminal sends it
        screen = _read_until(master, r"\(reply stopped\)[\s\S]*>>> ")
        assert "cancelled" in screen                          # the stats line says so
        os.write(master, b"/stats\r")
        screen = _read_until(master, r"last turn: [\s\S]*>>> ")
        generated = int(re.search(r"; (\d+) generated", screen).group(1))
        assert 0 < generated < 200
        os.write(master, b"/exit\r")
        assert proc.wait(timeout=30) == 0
        assert (tmp_path / "cache" / "chat_history").read_text().count("/stats") == 1
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)


def test_chat_without_ctx_trades_context_for_expert_slots_and_says_so(fake, monkeypatch):
    """The fake's default context is 256; with the floor lowered to 32, a budget that holds every expert at 128
    positions holds none at 256: chat halves its context once, says so, and the conversation runs."""
    from colibri import ctx_choice, launch
    from colibri.inventory import load_facts
    from colibri.model import resolve_model

    monkeypatch.setattr(ctx_choice, "TRADE_FLOOR", 32)
    facts = load_facts(resolve_model(str(fake)))
    at = launch.plan_at(facts, 1 << 40, 128, 1, None)
    ram = at.dense_bytes + at.kv_bytes + at.state_bytes + at.reserve_bytes + 4 * at.expert_bytes + 100
    args = ["chat", "--model", str(fake), "--temp", "0", "--max-tokens", "5", "--ram", repr(ram / launch.GIB)]
    res = CliRunner().invoke(app, args, input="hello\n/stats\n/exit\n", catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert ("warning: ctx 256 -> 128 to keep 4 expert slots per layer (0 at ctx 256) under --ram "
            in res.stderr)
    assert "a conversation's length is not known up front; pass --ctx to choose" in res.stderr
    assert "last turn:" in res.stdout
