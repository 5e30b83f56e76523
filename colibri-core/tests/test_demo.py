"""``coli demo``: the ``demo_model`` hook, the atomic cache-directory builder, the quarter-of-the-experts budget, and
real runs of the bundled trained model and of ``--synthetic`` (both from colibri-olmoe) streaming experts."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from colibri import demo, hookimpl, plugins
from colibri.checkpoint import read_header
from colibri.errors import EngineError
from colibri.records import DemoModel
from colibri.safetensors_writer import write_safetensors


def test_safetensors_writer_round_trips(tmp_path):
    from safetensors.numpy import load_file

    arrays = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.array([1, 2, 3], dtype=np.int64),
              "c": np.ones((2, 2, 2), dtype=np.float16)}
    path = tmp_path / "x.safetensors"
    size = write_safetensors(path, arrays.items(), {"format": "pt"})
    assert size == path.stat().st_size
    loaded = load_file(str(path))
    for name, arr in arrays.items():
        np.testing.assert_array_equal(loaded[name], arr)
    header = read_header(path)
    assert header.data_start % 8 == 0 and header.metadata == {"format": "pt"}
    assert [t.name for t in header.tensors] == ["a", "b", "c"]
    assert not list(tmp_path.glob(".*tmp"))


@pytest.fixture
def no_families(monkeypatch):
    """A plugin manager with no installed family, so only what the test registers answers."""
    monkeypatch.setenv("COLIBRI_LOAD_PLUGINS", "none-at-all")
    plugins.reset()
    yield
    plugins.reset()


class OffersDemo:
    def __init__(self, root: Path):
        self.root, self.calls = root, []

    @hookimpl
    def demo_model(self, cache_dir, synthetic):
        self.calls.append((cache_dir, synthetic))
        return DemoModel(self.root / ("random" if synthetic else "trained"), "a test model", "def f(x):",
                         is_random=synthetic)


class OffersNothing:
    @hookimpl
    def demo_model(self, cache_dir, synthetic):
        return None


def test_hook_demo_model_first_answer_wins_and_gets_the_flag(tmp_path, monkeypatch, no_families):
    monkeypatch.setenv("COLIBRI_CACHE", str(tmp_path / "cache"))
    offers = OffersDemo(tmp_path)
    plugins.register(OffersNothing(), "declines")
    plugins.register(offers, "offers")
    trained = demo.find_demo_model()
    assert trained == DemoModel(tmp_path / "trained", "a test model", "def f(x):", is_random=False)
    assert trained.cache_fraction == 0.25
    random = demo.find_demo_model(synthetic=True)
    assert random.is_random and random.path == tmp_path / "random"
    assert offers.calls == [(tmp_path / "cache" / "demo", False), (tmp_path / "cache" / "demo", True)]
    assert (tmp_path / "cache" / "demo").is_dir()          # the hook is promised a writable directory


def test_hook_demo_model_unanswered_is_one_clear_error(tmp_path, monkeypatch, no_families):
    monkeypatch.setenv("COLIBRI_CACHE", str(tmp_path / "cache"))
    plugins.register(OffersNothing(), "declines")
    with pytest.raises(EngineError) as err:
        demo.find_demo_model()
    assert "no installed family offers a demo model" in str(err.value)
    assert "colibri-olmoe" in err.value.hint
    res = CliRunner().invoke(__import__("colibri.cli", fromlist=["app"]).app, ["demo", "--synthetic"])
    assert res.exit_code != 0 and "Traceback" not in res.output
    assert "no installed family offers a synthetic demo model" in res.output


def test_ensure_directory_builds_once_atomically(tmp_path):
    built: list[Path] = []

    def write(out: Path) -> None:
        built.append(out)
        out.mkdir()
        (out / "weights").write_text("w")

    final = tmp_path / "demo" / "m"
    path, now = demo.ensure_directory(final, write)
    assert now and path == final and (final / "weights").exists() and (final / demo.COMPLETE_MARKER).exists()
    assert built[0] != final and not built[0].exists()       # written beside it, then renamed into place
    assert demo.ensure_directory(final, write) == (final, False) and len(built) == 1
    (final / demo.COMPLETE_MARKER).unlink()                  # a killed build leaves no marker: rebuilt
    assert demo.ensure_directory(final, write) == (final, True) and len(built) == 2

    def fail(out: Path) -> None:
        out.mkdir()
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        demo.ensure_directory(tmp_path / "demo" / "broken", fail)
    assert sorted(p.name for p in (tmp_path / "demo").iterdir() if not p.name.endswith(".lock")) == ["m"]


@pytest.fixture
def olmoe_installed(monkeypatch):
    pytest.importorskip("colibri_olmoe")
    monkeypatch.setenv("COLIBRI_LOAD_PLUGINS", "olmoe")
    plugins.reset()
    yield
    plugins.reset()


def test_budget_holds_a_quarter_of_the_experts(olmoe_installed):
    from colibri.inventory import load_facts
    from colibri.launch import prepare
    from colibri.model import resolve_model

    offered = demo.find_demo_model()
    facts = load_facts(resolve_model(offered.path))
    ram = demo.budget_for_cache_fraction(facts, ctx=256)
    spec = prepare(facts.model, ram_gib=ram / 1024 ** 3, ctx=256, facts=facts)
    assert spec.cap == facts.geometry.num_experts // 4
    assert spec.plan.ram_bytes < facts.tensors.total_bytes + spec.plan.kv_bytes + spec.plan.reserve_bytes


def run_demo(*args: str):
    res = CliRunner().invoke(__import__("colibri.cli", fromlist=["app"]).app,
                             ["demo", "--threads", "2", *args], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return res.stdout


def test_coli_demo_runs_the_bundled_model_streaming_experts(olmoe_installed):
    """The default: the trained model under a budget that caches a quarter of its experts, greedy completion."""
    out = run_demo("--tokens", "24")
    assert "colibri-nano" in out and "RANDOM" not in out and "noise" not in out
    # The planner's fixed 64 MiB reserve outweighs this small model, so the budget is not smaller than the whole
    # file; what streams is the experts: the cache holds a quarter of each layer's, the rest is read on a miss.
    assert re.search(r"8 of 32 experts per layer \(25%", out)
    read = re.search(r"streamed\s+([\d.]+) (KiB|MiB) of experts read from disk in (\d+) reads "
                     r"\(hit rate ([\d.]+)%", out)
    assert read and int(read.group(3)) > 0 and 0 < float(read.group(4)) < 100
    completion = out[out.index("def fibonacci(n):"):].split("\n\n")[0]
    assert len(completion) > len("def fibonacci(n):") + 8    # it wrote something after the prompt
    again = run_demo("--tokens", "24")                        # greedy: placement never changes the tokens
    assert again[again.index("def fibonacci(n):"):].split("\n\n")[0] == completion


def test_coli_demo_synthetic_runs_a_random_model(tmp_path, monkeypatch, olmoe_installed):
    from colibri_olmoe import plugin
    from colibri_olmoe.synthetic import DemoSpec

    tiny = DemoSpec(hidden=64, layers=3, heads=4, experts=16, top_k=4, expert_width=32, vocab=600,
                    layers_per_shard=2, tokenizer_corpus_bytes=150_000)
    monkeypatch.setattr(plugin, "synthetic_spec", lambda: tiny)
    monkeypatch.setattr(demo, "demo_cache_dir", lambda: tmp_path / "demo")   # the engine build stays shared
    out = run_demo("--synthetic", "--tokens", "12", "--prompt", "import os")
    assert "RANDOM weights" in out and "noise" in out
    assert "4 of 16 experts per layer (25%" in out
    assert re.search(r"decode 12 tok", out)                   # no stop tokens for a random model
    assert (tmp_path / "demo" / tiny.name / demo.COMPLETE_MARKER).exists()
