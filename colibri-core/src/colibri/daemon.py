"""``coli serve`` in the background: a pidfile and a log per named server, found again by name, stopped by pid.

``<state dir>/servers/<name>.json`` records the pid, its start time (from /proc, so a recycled pid is never
mistaken for the server), the process group, the URL, the model and the log file; ``<name>.log`` receives the
server's stdout and stderr. A server is stopped through that record only: SIGTERM (uvicorn then closes the engine
cleanly), and SIGKILL to the recorded process group if it is still there after the grace period. Nothing is ever
matched by process name.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

from . import envvars
from .errors import ColibriError, UsageError
from .xdg import state_dir

DEFAULT_NAME = "default"
PORT_TRIES = 100
STOP_GRACE_S = 15.0


class ServerStateError(ColibriError):
    """A background server is not where its record says, or will not start."""


@dataclass(frozen=True)
class ServerRecord:
    name: str
    pid: int
    pid_start: int                # /proc/<pid>/stat starttime: pid + this identify the process
    host: str
    port: int
    model: str
    family: str
    log: str
    started: float
    resident_bytes: int           # dense + embeddings the engine loads (what load progress is measured against)
    argv: tuple[str, ...]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


def servers_dir() -> Path:
    return state_dir() / "servers"


def record_path(name: str) -> Path:
    return servers_dir() / f"{name}.json"


def log_path(name: str) -> Path:
    return servers_dir() / f"{name}.log"


def check_name(name: str) -> str:
    if not name or not all(c.isalnum() or c in "-_." for c in name) or name.startswith("."):
        raise UsageError(f"--name {name!r}: use letters, digits, '-', '_' or '.'", "e.g. --name big-model")
    return name


def read_record(name: str) -> ServerRecord | None:
    try:
        data = json.loads(record_path(name).read_text(encoding="utf-8"))
        data["argv"] = tuple(data.get("argv", ()))
        return ServerRecord(**data)
    except (OSError, ValueError, TypeError):
        return None


def write_record(record: ServerRecord) -> None:
    path = record_path(record.name)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(asdict(record), indent=2), encoding="utf-8")
    os.replace(tmp, path)


def records() -> Iterator[ServerRecord]:
    if servers_dir().is_dir():
        for path in sorted(servers_dir().glob("*.json")):
            record = read_record(path.stem)
            if record is not None:
                yield record


def process_start_time(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (clock ticks after boot); ``None`` when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after its closing one
    fields = stat[stat.rfind(")") + 2:].split()
    return int(fields[19])


def alive(record: ServerRecord) -> bool:
    """The recorded process is still this server (same pid *and* same start time) and not a zombie."""
    if process_start_time(record.pid) != record.pid_start:
        return False
    try:
        state = Path(f"/proc/{record.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def port_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host.strip("[]"), port))
        except OSError:
            return False
    return True


def free_port(host: str, first: int) -> int:
    """``first`` if free, else the next free port after it (what a second server on the same port gets)."""
    for port in range(first, min(first + PORT_TRIES, 65536)):
        if port_free(host, port):
            return port
    raise ServerStateError(f"no free port on {host} in {first}-{first + PORT_TRIES - 1}",
                           "pass --port with a free range, or stop a server (coli status lists them)")


def launcher() -> list[str]:
    """The command line of this very CLI, so the background server runs with the same plugins and Python."""
    script = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if script is not None and script.is_file() and (script.suffix == ".py" or script.name == "coli"):
        return [sys.executable, str(script.resolve())]
    return [sys.executable, "-c", "from colibri.cli import main; main()"]


def start(name: str, model_path: Path, family: str, resident_bytes: int, host: str, port: int,
          serve_args: list[str], wait_s: float) -> tuple[ServerRecord, int]:
    """Start ``coli serve`` detached; return its record (and the port first asked for) once the model is loaded,
    or after ``wait_s`` while it is still loading; a server that exits meanwhile is an error with its log line."""
    check_name(name)
    existing = read_record(name)
    if existing is not None and alive(existing):
        raise ServerStateError(f"server {name!r} is already running at {existing.url} (pid {existing.pid})",
                               f"coli stop{'' if name == DEFAULT_NAME else ' --name ' + name} first, or start "
                               "another with --name NAME")
    chosen = free_port(host, port)
    servers_dir().mkdir(parents=True, exist_ok=True)
    log = log_path(name)
    argv = [*launcher(), "serve", "--model", str(model_path), "--family", family, "--host", host,
            "--port", str(chosen), *serve_args]
    with open(log, "ab") as out:
        out.write(f"\n--- coli start {name}: {' '.join(argv[2:])} ({time.strftime('%Y-%m-%d %H:%M:%S')})\n"
                  .encode())
        out.flush()
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, close_fds=True)
    pid_start = process_start_time(proc.pid) or 0
    record = ServerRecord(name, proc.pid, pid_start, host, chosen, str(model_path), family, str(log), time.time(),
                          resident_bytes, tuple(argv))
    write_record(record)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerStateError(f"server {name!r} exited with code {proc.returncode} while starting: "
                                   f"{last_error_line(log)}", f"coli logs{_name_flag(name)} shows the whole log")
        answer = health(record)
        if answer is not None and answer.get("status") == "ok":
            return record, port
        time.sleep(0.1)
    return record, port


def _name_flag(name: str) -> str:
    return "" if name == DEFAULT_NAME else f" --name {name}"


def last_error_line(log: Path) -> str:
    """The line of the log that says what went wrong (``error: ...``), else its last line."""
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "no log"
    errors = [line for line in lines if line.startswith("error:")]
    return (errors or lines or ["empty log"])[-1]


def _get(record: ServerRecord, path: str, timeout: float = 2.0) -> tuple[int, str] | None:
    import httpx

    headers = {}
    key = envvars.getenv(envvars.API_KEY)
    if key:
        headers["authorization"] = f"Bearer {key}"
    host = "127.0.0.1" if record.host in ("0.0.0.0", "") else ("::1" if record.host == "::" else record.host)
    url = f"http://{'[' + host + ']' if ':' in host else host}:{record.port}{path}"
    try:
        response = httpx.get(url, timeout=timeout, headers=headers)
    except httpx.HTTPError:
        return None
    return response.status_code, response.text


def health(record: ServerRecord) -> dict[str, Any] | None:
    """``/health`` as JSON (200 ready, 503 loading or failed), ``None`` while nothing answers."""
    answer = _get(record, "/health")
    if answer is None:
        return None
    try:
        data = json.loads(answer[1])
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def metric(record: ServerRecord, name: str) -> float | None:
    answer = _get(record, "/metrics")
    if answer is None or answer[0] != 200:
        return None
    for line in answer[1].splitlines():
        if line.startswith(f"colibri_{name} "):
            try:
                return float(line.split()[1])
            except (IndexError, ValueError):
                return None
    return None


def descendants_rss(pid: int) -> int:
    """Resident bytes of ``pid``'s child processes (the engine), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int(entry.joinpath("stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    total, todo = 0, list(children.get(pid, ()))
    page = os.sysconf("SC_PAGE_SIZE")
    while todo:
        child = todo.pop()
        todo += children.get(child, ())
        try:
            total += int(Path(f"/proc/{child}/statm").read_text().split()[1]) * page
        except (OSError, IndexError, ValueError):
            pass
    return total


def status(record: ServerRecord) -> dict[str, Any]:
    """What ``coli status`` shows: state, URL, model, load progress, last decode speed."""
    out: dict[str, Any] = {"name": record.name, "pid": record.pid, "url": record.url + "/v1", "model": record.model,
                           "family": record.family, "log": record.log, "started": record.started,
                           "uptime_s": round(time.time() - record.started, 1)}
    if not alive(record):
        out.update(state="exited", detail=last_error_line(Path(record.log)))
        return out
    answer = health(record)
    if answer is None:
        out.update(state="starting", detail="not answering HTTP yet")
        return out
    state = "running" if answer.get("status") == "ok" else str(answer.get("status"))
    out.update(state=state, detail=answer.get("detail"))
    if state == "loading":
        rss = descendants_rss(record.pid)
        out["load"] = {"resident_bytes": rss, "dense_bytes": record.resident_bytes,
                       "fraction": round(min(1.0, rss / record.resident_bytes), 3) if record.resident_bytes else None}
    if state == "running":
        out["slots_busy"], out["queued"] = answer.get("slots_busy"), answer.get("queued")
    out["last_decode_tokens_per_s"] = metric(record, "decode_tokens_per_second")
    return out


def stop(record: ServerRecord, grace_s: float = STOP_GRACE_S) -> str:
    """Stop the recorded server (and only it); remove its record. Returns what happened."""
    if not alive(record):
        record_path(record.name).unlink(missing_ok=True)
        return "was not running"
    os.kill(record.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and alive(record):
        time.sleep(0.05)
    how = "stopped"
    if alive(record):
        try:
            os.killpg(record.pid, signal.SIGKILL)   # its own session: the group is the server and its engine
        except ProcessLookupError:
            pass
        how = f"killed after {grace_s:g} s"
    _reap(record.pid)
    record_path(record.name).unlink(missing_ok=True)
    return how


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
