"""Building engines: cache key, reuse, atomicity, the lock, and the errors a user can act on."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from colibri import builder, compiler, hookimpl, plugins
from colibri.errors import BuildError
from colibri.records import EngineSource

RUNTIME_C = """
#include "rt.h"
int rt_answer(void) { return RT_BASE + 2; }
"""
RUNTIME_H = "#define RT_BASE 40\nint rt_answer(void);\n"
ENGINE_C = """
#include <stdio.h>
#include <math.h>
#include "rt.h"
int main(void) { printf("%d %.1f\\n", rt_answer(), sqrt(16.0)); return 0; }
"""


class BuildFamily:
    def __init__(self, source: EngineSource):
        self.source = source

    @hookimpl
    def engine_source(self):
        return self.source


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """A private runtime dir, engine source, cache dir and a logging compiler wrapper."""
    runtime = tmp_path / "runtime"
    runtime.mkdir()
    (runtime / "rt.c").write_text(RUNTIME_C)
    (runtime / "rt.h").write_text(RUNTIME_H)
    fam = tmp_path / "fam"
    fam.mkdir()
    (fam / "engine.c").write_text(ENGINE_C)
    log = tmp_path / "cc.log"
    wrapper = tmp_path / "cc-wrapper"
    wrapper.write_text(f'#!/bin/sh\n[ "$1" = --version ] || echo "$@" >> {log}\nexec gcc "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setattr(builder, "RUNTIME_DIR", runtime)
    monkeypatch.setenv("COLIBRI_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("COLIBRI_CC", str(wrapper))
    source = EngineSource(name="colibri-testfam", sources=(fam / "engine.c",))
    plugin = BuildFamily(source)
    pm = plugins.manager()
    pm.register(plugin, name="buildfam")
    yield {"runtime": runtime, "fam": fam, "log": log, "source": source, "tmp": tmp_path, "wrapper": wrapper}
    pm.unregister(name="buildfam")


def compiles(log: Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_build_runs_and_is_cached(tree):
    built, path, reason = builder.engine_status("buildfam")
    assert not built and path is None and "first use" in reason
    binary = builder.build_family("buildfam")
    assert binary.name == "colibri-testfam"
    assert binary.parent.parent == Path(os.environ["COLIBRI_CACHE"]) / "engines"
    assert binary.parent.name.startswith("colibri-testfam-")
    assert subprocess.run([binary], capture_output=True, text=True).stdout == "42 4.0\n"
    cmd = tree["log"].read_text()
    for flag in ("-O2", "-pthread", "-ffp-contract=off", f"-I{tree['runtime']}", "-lm"):
        assert flag in cmd.split()
    assert str(tree["runtime"] / "rt.c") in cmd          # every runtime *.c is compiled in
    assert builder.engine_for_family("buildfam") == binary
    assert compiles(tree["log"]) == 1
    assert builder.engine_status("buildfam") == (True, binary, "built")
    assert [p.name for p in binary.parent.iterdir()] == ["colibri-testfam"]   # no temp files left
    builder.build_family("buildfam", force=True)
    assert compiles(tree["log"]) == 2


def test_orphaned_temporaries_are_cleaned_by_the_next_build(tree):
    cc = compiler.find_compiler()
    final = builder.binary_path(tree["source"], cc)
    final.parent.mkdir(parents=True)
    orphan = final.parent / ".colibri-testfam-abc123.tmp"
    orphan.write_bytes(b"half a binary")
    builder.build_family("buildfam")
    assert not orphan.exists() and final.is_file()


def test_coli_build_command(tree):
    from typer.testing import CliRunner

    from colibri.cli import app

    res = CliRunner().invoke(app, ["build", "buildfam"])
    assert res.exit_code == 0, res.output
    assert "buildfam" in res.stdout and "colibri-testfam" in res.stdout
    res = CliRunner().invoke(app, ["build", "buildfam", "--json"])
    path = __import__("json").loads(res.stdout)["buildfam"]
    assert subprocess.run([path], capture_output=True, text=True).stdout == "42 4.0\n"
    assert compiles(tree["log"]) == 1                        # the second command reused the cached binary
    res = CliRunner().invoke(app, ["build", "nosuchfamily"])
    assert res.exit_code == 1 and "nosuchfamily" in res.stderr and res.stderr.count("\n") == 1


def test_cache_key_covers_sources_headers_flags_and_compiler(tree, monkeypatch):
    cc = compiler.find_compiler()
    src = tree["source"]
    base = builder.cache_key(src, cc)
    assert builder.cache_key(src, cc) == base
    (tree["runtime"] / "rt.h").write_text(RUNTIME_H.replace("40", "41"))
    k_header = builder.cache_key(src, cc)
    assert k_header != base
    (tree["fam"] / "engine.c").write_text(ENGINE_C + "\n/* changed */\n")
    k_source = builder.cache_key(src, cc)
    assert k_source not in (base, k_header)
    (tree["runtime"] / "extra.c").write_text("int rt_extra(void) { return 1; }\n")
    k_runtime = builder.cache_key(src, cc)
    assert k_runtime != k_source
    monkeypatch.setattr(builder, "CFLAGS", ("-O3", "-pthread", "-ffp-contract=off"))
    k_flags = builder.cache_key(src, cc)
    assert k_flags != k_runtime
    other = compiler.Compiler(cc.argv, cc.origin, cc.version + " (patched)")
    assert builder.cache_key(src, other) != k_flags


def test_new_source_builds_new_binary(tree):
    first = builder.build_family("buildfam")
    (tree["runtime"] / "rt.h").write_text(RUNTIME_H.replace("40", "50"))
    second = builder.build_family("buildfam")
    assert second != first and first.exists()
    assert subprocess.run([second], capture_output=True, text=True).stdout == "52 4.0\n"


def test_concurrent_builds_compile_once(tree):
    """Two processes asking for the same engine at once: one compiles, the other waits and reuses it."""
    slow = tree["tmp"] / "slow-cc"
    slow.write_text(f'#!/bin/sh\n[ "$1" = --version ] && exec gcc --version\necho "$@" >> {tree["log"]}\n'
                    'sleep 1\nexec gcc "$@"\n')
    slow.chmod(0o755)
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from pathlib import Path
        from colibri import builder
        from colibri.records import EngineSource
        builder.RUNTIME_DIR = Path({str(tree['runtime'])!r})
        src = EngineSource(name="colibri-testfam", sources=(Path({str(tree['fam'] / 'engine.c')!r}),))
        print(builder.build(src))
    """)
    env = {**os.environ, "COLIBRI_CC": str(slow)}
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs[0] == outs[1]
    assert compiles(tree["log"]) == 1
    assert subprocess.run([outs[0]], capture_output=True, text=True).stdout == "42 4.0\n"


def test_compile_error_shows_the_first_error_lines(tree):
    (tree["fam"] / "engine.c").write_text("int main(void) { return undefined_thing; }\n")
    with pytest.raises(BuildError) as info:
        builder.build_family("buildfam")
    msg = info.value.message
    assert "building colibri-testfam failed" in msg and "undefined_thing" in msg and "\n" not in msg
    engines = Path(os.environ["COLIBRI_CACHE"]) / "engines"
    assert not [p for p in engines.rglob("*") if p.is_file() and not p.name.endswith(".lock")]


def test_missing_compiler_named_by_colibri_cc(tree, monkeypatch):
    monkeypatch.setenv("COLIBRI_CC", "/nonexistent")
    with pytest.raises(BuildError) as info:
        builder.build_family("buildfam")
    line = info.value.one_line()
    assert "COLIBRI_CC=/nonexistent" in line and "apt-get install gcc" in line and "\n" not in line
    built, path, reason = builder.engine_status("buildfam")
    assert not built and "COLIBRI_CC=/nonexistent" in reason


def test_no_compiler_anywhere(tree, monkeypatch, tmp_path):
    monkeypatch.delenv("COLIBRI_CC")
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(BuildError) as info:
        compiler.find_compiler()
    assert "no C compiler found" in info.value.message and "apt-get install gcc" in info.value.hint


def test_cc_is_used_when_colibri_cc_is_unset(tree, monkeypatch):
    monkeypatch.delenv("COLIBRI_CC")
    monkeypatch.setenv("CC", str(tree["wrapper"]))
    assert compiler.find_compiler().origin == "CC"
    builder.build_family("buildfam")
    assert compiles(tree["log"]) == 1


def test_family_without_engine(tree):
    class NoEngine:
        @hookimpl
        def engine_source(self):
            return None

    pm = plugins.manager()
    pm.register(NoEngine(), name="noengine")
    try:
        assert builder.engine_status("noengine") == (False, None, "the family ships no engine")
        with pytest.raises(Exception) as info:
            builder.build_family("noengine")
        assert "has no engine to build" in str(info.value)
    finally:
        pm.unregister(name="noengine")


def test_runtime_api_mismatch_is_refused_before_compiling(tree):
    (tree["runtime"] / "api.h").write_text("#define CB_RUNTIME_API 3\n")
    assert builder.runtime_api() == 3
    current = EngineSource(tree["source"].name, tree["source"].sources, runtime_api=3)
    assert builder.build(current).is_file()
    older = EngineSource(tree["source"].name, tree["source"].sources, runtime_api=2)
    with pytest.raises(BuildError) as info:
        builder.build(older, force=True)
    assert "written for colibri runtime API 2" in info.value.message and "provides API 3" in info.value.message
    assert compiles(tree["log"]) == 1                    # refused before the compiler ran


def test_the_shipped_runtime_states_its_api():
    from colibri.builder import RUNTIME_DIR

    assert (RUNTIME_DIR / "api.h").is_file() and builder.runtime_api() >= 1


def test_first_build_logs_start_elapsed_and_path_without_a_terminal(tree, capsys):
    """CI, Docker and systemd have no terminal: the build still says what it does, how long it took, and where."""
    binary = builder.build_family("buildfam")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2, lines
    assert "building engine colibri-testfam" in lines[0] and str(tree["wrapper"]) in lines[0]
    assert "gcc" in lines[0]                                       # the compiler's own --version line
    assert lines[1].startswith("colibri: built engine colibri-testfam in ") and lines[1].endswith(f" s: {binary}")
    builder.build_family("buildfam")
    assert capsys.readouterr().err == ""                           # a cached engine is silent


def test_a_slow_build_says_it_is_still_building(tree, capsys, monkeypatch):
    slow = tree["tmp"] / "slow-cc"
    slow.write_text('#!/bin/sh\n[ "$1" = --version ] && exec gcc --version\nsleep 0.5\nexec gcc "$@"\n')
    slow.chmod(0o755)
    monkeypatch.setenv("COLIBRI_CC", str(slow))
    monkeypatch.setattr(builder, "HEARTBEAT_SECONDS", 0.1)
    builder.build_family("buildfam")
    assert "colibri: still building engine colibri-testfam (" in capsys.readouterr().err


@pytest.mark.parametrize("os_release, command", [
    ('ID=debian\n', "apt-get install gcc libc6-dev"),
    ('ID=ubuntu\nID_LIKE=debian\n', "apt-get install gcc libc6-dev"),
    ('ID="rocky"\nID_LIKE="rhel centos fedora"\n', "dnf install gcc glibc-devel"),
    ('ID=alpine\n', "apk add build-base"),
])
def test_missing_compiler_names_the_package_to_install(tree, monkeypatch, tmp_path, os_release, command):
    release = tmp_path / "os-release"
    release.write_text(os_release)
    monkeypatch.setattr(compiler, "OS_RELEASE", str(release))
    monkeypatch.delenv("COLIBRI_CC")
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(BuildError) as info:
        compiler.find_compiler()
    assert info.value.hint == f"{command}, or set COLIBRI_CC to a C compiler"


def test_missing_libc_headers_name_the_package_too(tree, monkeypatch, tmp_path):
    release = tmp_path / "os-release"
    release.write_text("ID=debian\n")
    monkeypatch.setattr(compiler, "OS_RELEASE", str(release))
    (tree["fam"] / "engine.c").write_text("#include <nosuch/stdio.h>\nint main(void) { return 0; }\n")
    fake = tree["tmp"] / "no-headers-cc"
    fake.write_text('#!/bin/sh\n[ "$1" = --version ] && exec gcc --version\n'
                    'echo "engine.c:1:10: fatal error: stdio.h: No such file or directory" >&2\nexit 1\n')
    fake.chmod(0o755)
    monkeypatch.setenv("COLIBRI_CC", str(fake))
    with pytest.raises(BuildError) as info:
        builder.build_family("buildfam")
    assert "stdio.h" in info.value.message and "apt-get install gcc libc6-dev" in info.value.hint
