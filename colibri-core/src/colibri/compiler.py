"""Finding the system C compiler and the flags every engine is built with."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from dataclasses import dataclass

from .errors import BuildError

# -ffp-contract=off: the kernels fix their own fmaf order; letting the compiler fuse other multiply-adds would make
# results depend on the compiler and the ISA, and "placement may change speed, never the tokens" would not hold.
CFLAGS: tuple[str, ...] = ("-O2", "-pthread", "-ffp-contract=off")
LDLIBS: tuple[str, ...] = ("-lm",)

FALLBACK_COMPILERS = ("cc", "gcc", "clang")
INSTALL_HINT = "install a C compiler (apt-get install gcc) or set COLIBRI_CC to one"


@dataclass(frozen=True)
class Compiler:
    argv: tuple[str, ...]        # the command, e.g. ("gcc",) or ("ccache", "gcc")
    origin: str                  # where it came from, for messages: "COLIBRI_CC", "CC" or "PATH"
    version: str                 # first lines of `--version`, part of the build cache key


def _version_of(argv: tuple[str, ...], origin: str) -> str:
    try:
        out = subprocess.run([*argv, "--version"], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise BuildError(f"{origin}={shlex.join(argv)}: compiler not found", INSTALL_HINT) from None
    except PermissionError:
        raise BuildError(f"{origin}={shlex.join(argv)}: not executable", INSTALL_HINT) from None
    except subprocess.TimeoutExpired:
        raise BuildError(f"{origin}={shlex.join(argv)}: `--version` did not answer in 30 s", INSTALL_HINT) from None
    if out.returncode != 0:
        raise BuildError(f"{origin}={shlex.join(argv)}: `--version` failed (exit {out.returncode})", INSTALL_HINT)
    return out.stdout.strip()


def find_compiler() -> Compiler:
    """``COLIBRI_CC``, then ``CC``, then the first of cc/gcc/clang on PATH; a clear BuildError when none works."""
    for var in ("COLIBRI_CC", "CC"):
        value = os.environ.get(var, "").strip()
        if value:
            argv = tuple(shlex.split(value))
            return Compiler(argv, var, _version_of(argv, var))
    for name in FALLBACK_COMPILERS:
        if shutil.which(name):
            return Compiler((name,), "PATH", _version_of((name,), "PATH"))
    raise BuildError("no C compiler found (looked for COLIBRI_CC, CC, cc, gcc, clang)", INSTALL_HINT)
