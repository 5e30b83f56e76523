"""``coli demo``: the ``demo_model`` hook and the atomic cache-directory builder, over in-test families (the real
runs of colibri-olmoe's bundled models are in the top-level tests/test_demo_olmoe.py)."""

from __future__ import annotations

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
