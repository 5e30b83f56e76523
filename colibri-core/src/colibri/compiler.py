"""Finding the system C compiler and the flags every engine is built with."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass

from .errors import BuildError

# -ffp-contract=off: the kernels fix their own fmaf order; letting the compiler fuse other multiply-adds would make
# results depend on the compiler and the ISA, and "placement may change speed, never the tokens" would not hold.
CFLAGS: tuple[str, ...] = ("-O2", "-pthread", "-ffp-contract=off")
LDLIBS: tuple[str, ...] = ("-lm",)

FALLBACK_COMPILERS = ("cc", "gcc", "clang")
OS_RELEASE = "/etc/os-release"
# The package that brings a C compiler and the C library's headers, by the distribution's ID or ID_LIKE.
COMPILER_PACKAGES: tuple[tuple[str, str], ...] = (
    ("debian", "apt-get install gcc libc6-dev"),
    ("ubuntu", "apt-get install gcc libc6-dev"),
    ("fedora", "dnf install gcc glibc-devel"),
    ("rhel", "dnf install gcc glibc-devel"),
    ("suse", "zypper install gcc glibc-devel"),
    ("alpine", "apk add build-base"),
    ("arch", "pacman -S gcc"),
)


def _distribution_ids() -> list[str]:
    """ID then ID_LIKE of /etc/os-release, e.g. ["ubuntu", "debian"]; empty when unreadable."""
    try:
        text = open(OS_RELEASE, encoding="utf-8").read()
    except OSError:
        return []
    fields = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    return [name for key in ("ID", "ID_LIKE") for name in fields.get(key, "").strip('"').lower().split()]


def install_hint() -> str:
    """How to get a C compiler on this machine: the install command of its distribution's package."""
    packages = dict(COMPILER_PACKAGES)
    command = next((packages[i] for i in _distribution_ids() if i in packages), None)
    if command is None:
        command = "xcode-select --install" if sys.platform == "darwin" else "install gcc (or clang) and libc headers"
    return f"{command}, or set COLIBRI_CC to a C compiler"


@dataclass(frozen=True)
class Compiler:
    argv: tuple[str, ...]        # the command, e.g. ("gcc",) or ("ccache", "gcc")
    origin: str                  # where it came from, for messages: "COLIBRI_CC", "CC" or "PATH"
    version: str                 # first lines of `--version`, part of the build cache key


def _version_of(argv: tuple[str, ...], origin: str) -> str:
    try:
        out = subprocess.run([*argv, "--version"], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise BuildError(f"{origin}={shlex.join(argv)}: compiler not found", install_hint()) from None
    except PermissionError:
        raise BuildError(f"{origin}={shlex.join(argv)}: not executable", install_hint()) from None
    except subprocess.TimeoutExpired:
        raise BuildError(f"{origin}={shlex.join(argv)}: `--version` did not answer in 30 s", install_hint()) from None
    if out.returncode != 0:
        raise BuildError(f"{origin}={shlex.join(argv)}: `--version` failed (exit {out.returncode})", install_hint())
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
    raise BuildError("no C compiler found (looked for COLIBRI_CC, CC, cc, gcc, clang)", install_hint())
