"""colibri's sessions. ``nox -s tests`` is the one command CI (``.ci/run``) and the README run.

``nox -l`` lists every session with its docstring.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import nox
import tomllib

ROOT = Path(__file__).resolve().parent
nox.options.sessions = ["lint", "tests"]
nox.options.error_on_missing_interpreters = True

# torch first and pinned: pip then takes the CPU build that lies on this machine's disk, instead of letting a
# later requirement pull a multi-GB CUDA build from the index.
TORCH = "torch==2.13.0"
TEST_REQUIREMENTS = ("transformers==5.24.0", "diffusers", "numpy", "safetensors", "pytest", "hatchling", "editables",
                     "nox",         # the layout test checks `nox -l`
                     "hypothesis",  # fuzzing of the checkpoint readers (colibri-core/tests/test_fuzz_readers.py)
                     "laya==0.4.15",  # its own classes build the tiny Laya checkpoint (colibri-decision tests)
                     # its own classes build the tiny GLiNER2 checkpoint and its inference is the reference
                     # (tests/test_decide_gliner2.py); its base install pulls only pydantic, requests, tqdm, urllib3
                     # (torch, transformers, safetensors, numpy are the ones above: no --no-deps needed)
                     "gliner2==2.1.0",
                     "openai-agents",   # an unmodified agent framework against coli serve (test_serve_agent_sdk.py)
                     "selenium",    # the dashboard in Debian's chromium (tests/test_dashboard_browser.py)
                     "llguidance>=1.0",  # constrained decoding (colibri-core[structured]; test_serve_structured.py)
                     "ray==2.60.0",  # the cluster extra (tests on a loopback Ray cluster)
                     )
PYTEST_ARGS = ("--import-mode=importlib", "-p", "no:cacheprovider", "-ra")
TEST_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false"}


def packages() -> list[str]:
    """Every package directory of the monorepo (core first), found by its pyproject.toml."""
    found = sorted(p.name for p in ROOT.glob("colibri-*") if (p / "pyproject.toml").is_file())
    return sorted(found, key=lambda name: name != "colibri-core")


def test_dirs(session: nox.Session, dirs: list[Path]) -> list[str]:
    """The given test folders, refusing any that holds no test file: pytest must never exit 5 (no tests)."""
    out = []
    for directory in dirs:
        if not any(directory.rglob("test_*.py")):
            session.error(f"{directory.relative_to(ROOT)}: no test_*.py files; every package must ship tests")
        out.append(str(directory.relative_to(ROOT)))
    return out


def install_spec(name: str) -> str:
    """``DIR[test]`` when the package declares a ``test`` extra (test-only requirements), else ``DIR``."""
    with open(ROOT / name / "pyproject.toml", "rb") as fh:
        extras = tomllib.load(fh).get("project", {}).get("optional-dependencies", {})
    return f"{ROOT / name}[test]" if "test" in extras else str(ROOT / name)


def install_everything(session: nox.Session) -> None:
    session.install(TORCH)
    session.install(*TEST_REQUIREMENTS)
    editable: list[str] = []
    for name in packages():
        editable += ["-e", install_spec(name)]
    # The build backend is installed above, so the editable builds need neither isolation nor the network.
    session.install("--no-build-isolation", *editable)


def run_pytest(session: nox.Session, dirs: list[Path]) -> None:
    paths = test_dirs(session, dirs)
    # importlib mode lets every package keep a plain tests/ folder (same-named conftest and test files do not
    # clash); pythonpath keeps each folder's helper modules importable by its tests, as in pytest's default mode.
    # An empty config dir of the run's own: what this machine's `coli tune` or `coli setup` saved (a tune profile
    # changes I/O threads, the prefill chunk and so the plan's reserve) must not change what the tests see.
    config = tempfile.mkdtemp(prefix="colibri-test-config-")
    session.run("python", "-m", "pytest", *PYTEST_ARGS, "-o", "pythonpath=" + " ".join(paths), *session.posargs,
                *paths, env={**TEST_ENV, "COLIBRI_CONFIG": config}, success_codes=[0])


@nox.session
def tests(session: nox.Session) -> None:
    """All tests (the CI command): every package editable plus torch/transformers/diffusers, pytest offline.

    One venv; pytest runs over each package's tests/ and the integration tests/ with HF_HUB_OFFLINE=1.
    """
    install_everything(session)
    run_pytest(session, [ROOT / name / "tests" for name in packages()] + [ROOT / "tests"])


@nox.session
@nox.parametrize("package", packages())
def package_tests(session: nox.Session, package: str) -> None:
    """One package's own tests (with every package installed, since families build on core)."""
    install_everything(session)
    run_pytest(session, [ROOT / package / "tests"])


@nox.session
def integration(session: nox.Session) -> None:
    """The cross-package integration tests in tests/ (third-party plugin discovery, end-to-end CLI runs)."""
    install_everything(session)
    run_pytest(session, [ROOT / "tests"])


def source_packages() -> list[str]:
    """The import packages of core and every plugin (``colibri-x/src/<package>``), for the type checker."""
    return [str(p.relative_to(ROOT)) for name in packages() for p in sorted((ROOT / name / "src").iterdir())
            if (p / "__init__.py").is_file()]


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the whole repository, then mypy on core and every plugin (settings: the root pyproject.toml)."""
    session.install("ruff", "mypy", "pytest", "hatchling", "editables")   # pytest: colibri.testing uses it
    # core's dependencies give mypy their types (numpy, starlette, rich, typer, pluggy); the packages themselves are
    # read from their src/ folders (mypy_path), so the plugins need no install.
    session.install("--no-build-isolation", "-e", str(ROOT / "colibri-core"))
    session.run("ruff", "check", *session.posargs, str(ROOT))
    with session.chdir(ROOT):     # mypy reads its settings (and the src/ paths) from the root pyproject.toml
        session.run("mypy", *source_packages())


@nox.session
def packaging(session: nox.Session) -> None:
    """Every package built as a wheel and an sdist (python -m build) and checked by twine check --strict; the
    wheels must carry their LICENSE and colibri-olmoe's must ship colibri-nano's weights once."""
    session.install("build", "twine", "hatchling")
    dist = Path(session.create_tmp()) / "dist"
    shutil.rmtree(dist, ignore_errors=True)   # an earlier run's files must not be checked again
    for name in packages():
        out = dist / name
        # The backend is installed above: no isolated environment to download per package.
        session.run("python", "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT / name), silent=True)
        built = sorted(str(p) for p in out.iterdir())
        session.run("python", "-m", "twine", "check", "--strict", *built)
        session.run("python", str(ROOT / "tests" / "wheel_contents.py"), *(p for p in built if p.endswith(".whl")))


@nox.session
def engines(session: nox.Session) -> None:
    """The C engines' own tests, then the same under AddressSanitizer and UndefinedBehaviorSanitizer, with every
    family engine driven through a protocol session (engines/Makefile sanitize-FAMILY).

    The sessions build their tiny checkpoints with transformers, so they run on this session's Python, which has
    everything installed (a clean machine's system Python has neither torch nor colibri)."""
    install_everything(session)
    python = f"PYTHON={Path(session.bin) / 'python'}"
    session.run("make", "-j2", "-C", str(ROOT / "engines"), python, "test", external=True, env=TEST_ENV)
    session.run("make", "-j2", "-C", str(ROOT / "engines"), python, "sanitize", external=True, env=TEST_ENV)


@nox.session
def convert_slow(session: nox.Session) -> None:
    """coli convert on a >2 GB synthetic checkpoint must keep its peak RSS under 1 GiB, and colibri-nano's int8 and
    int4 containers must meet the quality targets over 512 positions (slow; not in `tests`)."""
    install_everything(session)
    session.run("python", "-m", "pytest", *PYTEST_ARGS, "-s", *session.posargs,
                "colibri-core/tests/test_convert_slow.py",
                "colibri-olmoe/tests/test_quant_olmoe.py::test_trained_nano_meets_the_issue_targets",
                env={**TEST_ENV, "COLIBRI_SLOW_TESTS": "1"},
                success_codes=[0])


@nox.session
def real_layouts(session: nox.Session) -> None:
    """coli info / plan / doctor on the header-only layouts of every real release in tests/real_layouts.py (the big
    ones take minutes; the default suite runs the small ones); `-- --write-docs` also regenerates docs/models.md."""
    install_everything(session)
    if "--write-docs" in session.posargs:
        session.run("python", "tests/real_layouts.py", env=TEST_ENV)
    session.run("python", "-m", "pytest", *PYTEST_ARGS, "-o", "pythonpath=tests", "tests/test_real_layouts.py",
                env={**TEST_ENV, "COLIBRI_SLOW_TESTS": "1"}, success_codes=[0])


@nox.session
def routing_study(session: nox.Session) -> None:
    """colibri-nano's routing on held-out text: per-layer expert popularity, token-to-token reuse, and hit rate vs
    cache size (LRU and the hot set, simulated and measured by the engine); writes its section of docs/benchmarks.md
    and docs/routing-study.png."""
    install_everything(session)
    session.install("matplotlib")
    session.run("python", str(ROOT / "colibri-olmoe" / "training" / "routing_study.py"), *session.posargs,
                env=TEST_ENV)


@nox.session
def bench_image(session: nox.Session) -> None:
    """colibri-image vs diffusers' CPU pipeline on a QwenImagePipeline at the real transformer width with fewer
    blocks: s/step and peak RSS, in RAM and under a cgroup v1 memory cap below the sum of the components (needs root
    for the cap; slow, never default). `-- --layers 4 --size 512 --steps 4` changes the shape."""
    install_everything(session)
    session.run("python", str(ROOT / "engines" / "bench" / "image_bench.py"), *session.posargs, env=TEST_ENV)


@nox.session
def bench_decide(session: nox.Session) -> None:
    """System One decisions per second in one run: colibri vs the laya package on a ~300 M-parameter Laya model and
    vs transformers' DecisionPipeline on a ~300 M-parameter JevForDecision (qwen3_5_text backbone), the engines
    alternated, medians of 3 rounds with each run's load average and other processes' CPU share, the largest
    probability difference (at most 1e-4); writes its section of docs/benchmarks.md (slow; never default).
    `-- --quick` checks the session end to end on the test-sized models; `-- --scenario transformers` runs one."""
    install_everything(session)
    session.run("python", str(ROOT / "engines" / "bench" / "decide_bench.py"), *session.posargs, env=TEST_ENV)


@nox.session
def bench_cluster(session: nox.Session) -> None:
    """Expert-parallel on a loopback Ray cluster: decode tok/s, disk bytes and network bytes / round trips per token
    at 1, 2 and 3 expert workers on the OLMoE-1B-7B-geometry checkpoint `nox -s bench` builds, no node holding the
    hot set (slow, never default; root for the cgroup caps). `-- --quick` runs the tiny model as a smoke test."""
    install_everything(session)
    session.run("python", str(ROOT / "engines" / "bench" / "cluster_bench.py"), *session.posargs, env=TEST_ENV)


@nox.session
def bench_geometry(session: nox.Session) -> None:
    """colibri vs llama.cpp at DeepSeek-V3 / Kimi K2 expert geometry, truncated in depth (the dense first layer plus
    `--moe-layers` MoE layers at full width, 256 experts top-8, FP8 source converted to int4-g64; Q4_0 GGUF), under
    one RAM cap: per-MoE-layer decode time, bytes read, hit rate, extrapolated to 61 layers beside the disk bound
    (slow, never default; root for the cgroup cap, drop_caches and readahead; the cache under
    ~/.cache/colibri/bench/dsv3-trunc peaks at ~16 GB for one MoE layer, ~28 GB for two). `-- --quick` runs the
    scaled-down geometry in about a minute."""
    install_everything(session)
    session.run("python", str(ROOT / "engines" / "bench" / "geometry_bench.py"), *session.posargs, env=TEST_ENV)


@nox.session
def bench_lookahead(session: nox.Session) -> None:
    """Router lookahead on and off under caps of a third, 3, 5 and 6 GiB, colibri alone on the int8 container of
    `nox -s bench` (built if missing): decode speed, I/O wait and wrong guesses per token, medians of the quiet runs
    (about 5 minutes once the container exists; root for the cgroup cap and drop_caches)."""
    install_everything(session)
    session.run("python", str(ROOT / "engines" / "bench" / "lookahead_bench.py"), *session.posargs, env=TEST_ENV)


@nox.session
def bench(session: nox.Session) -> None:
    """colibri vs llama.cpp at the real OLMoE-1B-7B geometry (slow, about an hour; never default): in RAM (int8 vs
    Q8_0, int4 vs Q4_0, 64- and 512-token prompts), under caps of a third of the container, 3, 5 and 6 GiB (cold and
    warm), and 1/2/4 concurrent streams under the tight cap and in RAM, engines alternated over 3 rounds,
    medians of the quiet runs, every run's load recorded; the disk bound is `coli tune`'s at the engine's queue
    depth.

    Builds (once, cached under ~/.cache/colibri/bench) a synthetic bf16 checkpoint and a router-skewed variant,
    llama.cpp's library from the llama-cpp-python sdist, and the same weights as GGUF; writes bench-results/ and
    docs/benchmarks.md. Needs root for drop_caches, readahead and the cgroup v1 memory cap. Environment knobs
    (COLIBRI_BENCH_SCENARIOS, _CAPS, _POLICIES, _MERGE, ...) are listed at the top of engines/bench/stream_bench.py.
    """
    install_everything(session)
    session.install("matplotlib")
    session.run("python", str(ROOT / "engines" / "bench" / "stream_bench.py"), *session.posargs, env=TEST_ENV)
