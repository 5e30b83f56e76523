"""Building family engines on first use.

An engine is the shared C runtime (every ``*.c`` in ``colibri/runtime``) compiled together with the family's own
sources (its ``engine_source`` hook). Binaries live in ``<cache>/engines/<name>-<hash>/<name>``, where the hash
covers every source and header byte, the flags, and the compiler's ``--version``: editing a kernel, upgrading the
compiler or changing a flag builds a new binary, and an unchanged tree never rebuilds.

Builds are atomic (compile to a temporary name, then rename) and serialised by an ``flock`` per engine name, so
two ``coli run`` started together build once and never see a half-written binary.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import hooks, plugins
from .cachedir import cache_root, file_lock
from .compiler import CFLAGS, LDLIBS, Compiler, find_compiler, install_hint
from .errors import BuildError, EngineError
from .records import EngineSource, ResolvedModel

RUNTIME_DIR = Path(__file__).resolve().parent / "runtime"
HASH_CHARS = 16
ERROR_LINES_SHOWN = 3


def engines_dir() -> Path:
    return cache_root() / "engines"


def runtime_sources() -> tuple[Path, ...]:
    return tuple(sorted(RUNTIME_DIR.glob("*.c")))


def _headers_in(dirs: list[Path]) -> list[Path]:
    found: set[Path] = set()
    for d in dirs:
        if d.is_dir():
            found.update(p.resolve() for p in d.glob("*.h"))
    return sorted(found)


def _inputs(source: EngineSource) -> tuple[list[Path], list[Path], list[Path]]:
    """(sources to compile, headers that can affect them, include dirs), in a stable order."""
    sources = [*runtime_sources(), *(Path(s) for s in source.sources)]
    include_dirs = [RUNTIME_DIR, *(Path(d) for d in source.include_dirs)]
    headers = _headers_in(include_dirs + [s.parent for s in source.sources])
    return sources, headers, include_dirs


def compile_command(source: EngineSource, compiler: Compiler, output: Path) -> list[str]:
    sources, _, include_dirs = _inputs(source)
    return [
        *compiler.argv, *CFLAGS,
        *(f"-I{d}" for d in include_dirs),
        *(f"-D{d}" for d in source.defines),
        *(str(s) for s in sources),
        "-o", str(output), *LDLIBS,
    ]


def cache_key(source: EngineSource, compiler: Compiler) -> str:
    """Hash of everything that decides the binary's bytes (paths are deliberately left out: content is what counts)."""
    sources, headers, _ = _inputs(source)
    digest = hashlib.sha256()

    def feed(label: str, data: bytes) -> None:
        digest.update(label.encode() + b"\0" + len(data).to_bytes(8, "little") + data)

    feed("name", source.name.encode())
    for path in sources:
        if not path.is_file():
            raise BuildError(f"{path}: engine source of {source.name} is missing",
                             "reinstall the family package that ships it")
        feed(f"src:{path.name}", path.read_bytes())
    for path in headers:
        feed(f"hdr:{path.name}", path.read_bytes())
    feed("cflags", " ".join(CFLAGS).encode())
    feed("ldlibs", " ".join(LDLIBS).encode())
    feed("defines", " ".join(source.defines).encode())
    feed("compiler", " ".join(compiler.argv).encode())
    feed("version", compiler.version.encode())
    return digest.hexdigest()[:HASH_CHARS]


def binary_path(source: EngineSource, compiler: Compiler) -> Path:
    return engines_dir() / f"{source.name}-{cache_key(source, compiler)}" / source.name


def family_engine_source(family: str) -> EngineSource | None:
    """The family's main ``engine_source`` (asked without a model), or None when it has no engine (yet)."""
    return hooks.family_engine_source(family)


def families_with_engines() -> list[str]:
    return [name for name, fam in plugins.families().items() if not fam.error and family_engine_source(name)]


def runtime_api() -> int:
    """The runtime's C API version, ``CB_RUNTIME_API`` in ``runtime/api.h``."""
    header = RUNTIME_DIR / "api.h"
    found = re.search(r"^#define CB_RUNTIME_API (\d+)\b", header.read_text(encoding="utf-8"), re.M) \
        if header.is_file() else None
    if found is None:
        raise BuildError(f"{header}: no '#define CB_RUNTIME_API <n>'", "reinstall colibri-core")
    return int(found.group(1))


def check_runtime_api(source: EngineSource) -> None:
    """Refuse an engine written for another version of the runtime's C API, before compiling it."""
    if source.runtime_api is None:
        return
    have = runtime_api()
    if source.runtime_api != have:
        raise BuildError(f"engine {source.name} is written for colibri runtime API {source.runtime_api}, but the "
                         f"installed colibri-core provides API {have}",
                         "install the family and colibri-core releases that go together (pip install -U both)")


def _first_error_lines(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.search(r"\berror\b", ln, re.IGNORECASE)] or lines
    return " | ".join(errors[:ERROR_LINES_SHOWN]) or "no output"


MISSING_HEADER = re.compile(r"fatal error: (?:stdio|stdlib|string|math|pthread)\.h: No such file")
HEARTBEAT_SECONDS = 10.0


def _run_compiler(cmd: list[str], name: str, started: float) -> subprocess.CompletedProcess:
    """The compiler run, with a "still building" line every few seconds when stderr is not a terminal (CI, Docker,
    systemd: no spinner there, and a silent 30 s looks like a hang)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while True:
        try:
            out, err = proc.communicate(timeout=HEARTBEAT_SECONDS)
            return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
        except subprocess.TimeoutExpired:
            if not sys.stderr.isatty():
                _log(f"still building engine {name} ({time.monotonic() - started:.0f} s)")
        except BaseException:
            proc.kill()
            proc.wait()
            raise


def _compile(source: EngineSource, compiler: Compiler, final: Path) -> None:
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{source.name}-", suffix=".tmp", dir=final.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    started = time.monotonic()
    try:
        cmd = compile_command(source, compiler, tmp)
        try:
            result = _run_compiler(cmd, source.name, started)
        except OSError as exc:
            raise BuildError(f"cannot run {compiler.argv[0]} ({exc.strerror})", install_hint()) from None
        if result.returncode != 0:
            hint = f"compiler: {' '.join(compiler.argv)} ({compiler.origin})"
            if MISSING_HEADER.search(result.stderr):
                hint = f"the C library's headers are missing: {install_hint()}"
            raise BuildError(f"building {source.name} failed: {_first_error_lines(result.stderr)}", hint)
        os.chmod(tmp, 0o755)
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


def _log(line: str) -> None:
    sys.stderr.write(f"colibri: {line}\n")
    sys.stderr.flush()


def _spinner(message: str):
    """A rich spinner on a terminal; nothing otherwise (the start and end lines are logged either way)."""
    from contextlib import nullcontext

    if not sys.stderr.isatty():
        return nullcontext()
    from rich.console import Console

    return Console(stderr=True).status(message, spinner="dots")


def build(source: EngineSource, force: bool = False) -> Path:
    """Compile ``source`` with the runtime unless an identical build is cached; returns the binary."""
    check_runtime_api(source)
    compiler = find_compiler()
    final = binary_path(source, compiler)
    if final.is_file() and not force:
        return final
    with file_lock(engines_dir() / f".{source.name}.lock"):
        # Another process may have finished the same build while we waited for the lock.
        if final.is_file() and not force:
            return final
        # Holding the lock, no one else is compiling this engine: temporaries left here were orphaned by a
        # build that was killed.
        for stale in final.parent.glob(f".{source.name}-*.tmp") if final.parent.is_dir() else ():
            stale.unlink(missing_ok=True)
        version = (compiler.version.splitlines() or [""])[0]
        _log(f"building engine {source.name} with {' '.join(compiler.argv)} ({version}); first use, cached after")
        started = time.monotonic()
        with _spinner(f"building engine {source.name}"):
            _compile(source, compiler, final)
        _log(f"built engine {source.name} in {time.monotonic() - started:.1f} s: {final}")
    return final


def build_family(family: str, force: bool = False) -> Path:
    source = family_engine_source(family)
    if source is None:
        raise EngineError(f"family {family!r} has no engine to build",
                          "coli families shows which families have an engine")
    return build(source, force=force)


def engine_for_family(family: str) -> Path:
    """The family's main engine binary, built now if this is its first use."""
    return build_family(family)


def engine_for_model(model: ResolvedModel) -> Path | None:
    """The binary that runs ``model``: the family's prebuilt one (``engine_path``), else its ``engine_source``
    for this model built now if this is its first use; None when the family has neither."""
    shipped = hooks.engine_path(model)
    if shipped is not None:
        return shipped
    source = hooks.engine_source(model)
    return build(source) if source is not None else None


def engine_status(family: str, model: ResolvedModel | None = None) -> tuple[bool, Path | None, str]:
    """(built, binary path or None, reason) of the engine for ``model`` (else the family's main one), without
    building anything."""
    try:
        source = hooks.family_engine_source(family, model)
    except EngineError as exc:
        return False, None, exc.message
    if source is None:
        return False, None, "the family ships no engine"
    try:
        compiler = find_compiler()
        path = binary_path(source, compiler)
    except BuildError as exc:
        return False, None, exc.one_line()
    if path.is_file():
        return True, path, "built"
    return False, None, "not built yet: builds on first use (or run `coli build`)"
