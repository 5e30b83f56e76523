"""``coli serve`` (or ``coli web``) as a subprocess for end-to-end tests: a free port on 127.0.0.1, waiting for
``/health``, and an interrupt (then a kill) at the end. All traffic stays on the loopback interface."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence

import httpx

COLI = (sys.executable, "-c", "from colibri.cli import main; main()")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def coli_server(args: Sequence[str], env: Mapping[str, str], command: Sequence[str] = COLI,
                timeout: float = 300.0) -> Iterator[tuple[str, subprocess.Popen]]:
    """Run ``command ARGS --port P`` until its /health answers 200 (the first run may compile the engine); yields
    the base URL and the process."""
    port = free_port()
    proc = subprocess.Popen([*command, *args, "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=dict(env))
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    try:
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"coli {args[0]} exited: {proc.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"coli {args[0]} never became healthy")
            time.sleep(0.1)
        yield base, proc
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
