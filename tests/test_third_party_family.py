"""A family package nobody in colibri wrote is found through its entry point, with no change to core.

The suite pip-installs two fixture packages into the running interpreter: ``colibri-toy`` (claims model_type
``toymoe``) and ``colibri-broken-family`` (raises on import). Every ``coli`` run is a subprocess of the installed
script, so discovery goes through real package metadata. Both are uninstalled at teardown.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

FIXTURES = Path(__file__).parent / "fixtures"
PACKAGES = {"colibri-toy": FIXTURES / "colibri-toy", "colibri-broken-family": FIXTURES / "colibri-broken-family"}
TOY = {"model_type": "toymoe", "layers": 2, "hidden": 8, "inter": 4, "experts": 4, "top_k": 2, "vocab": 16}


def pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "-q", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}"


@pytest.fixture(scope="module")
def installed():
    pip("uninstall", "-y", *PACKAGES)
    # Without build isolation when hatchling is at hand: no network, and much faster.
    isolation = ["--no-build-isolation"] if importlib.util.find_spec("hatchling") else []
    pip("install", "--no-deps", *isolation, *(str(p) for p in PACKAGES.values()))
    yield
    pip("uninstall", "-y", *PACKAGES)


def coli_script() -> Path:
    script = Path(sys.executable).parent / "coli"
    assert script.exists(), f"{script}: the coli script is not installed beside this interpreter"
    return script


def coli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("COLIBRI_LOAD_PLUGINS", "COLIBRI_DISABLE_PLUGINS",
                                                           "COLI_MODEL")}
    env["HF_HUB_OFFLINE"] = "1"
    return subprocess.run([str(coli_script()), *args], capture_output=True, text=True, env=env, check=False,
                          stdin=subprocess.DEVNULL, timeout=120)


@pytest.fixture(scope="module")
def toy_model(tmp_path_factory) -> tuple[Path, int]:
    """A toymoe checkpoint and its parameter count."""
    rng = np.random.default_rng(0)
    h, i, v = TOY["hidden"], TOY["inter"], TOY["vocab"]
    tensors = {"embed.weight": rng.standard_normal((v, h), np.float32),
               "norm.weight": np.ones(h, np.float32)}
    for layer in range(TOY["layers"]):
        tensors[f"layers.{layer}.router.weight"] = rng.standard_normal((TOY["experts"], h), np.float32)
        for e in range(TOY["experts"]):
            tensors[f"layers.{layer}.experts.{e}.w1.weight"] = rng.standard_normal((i, h), np.float32)
            tensors[f"layers.{layer}.experts.{e}.w3.weight"] = rng.standard_normal((i, h), np.float32)
            tensors[f"layers.{layer}.experts.{e}.w2.weight"] = rng.standard_normal((h, i), np.float32)
    directory = tmp_path_factory.mktemp("toy")
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(TOY))
    write_tokenizer(directory)
    return directory, sum(math.prod(t.shape) for t in tensors.values())


def write_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {f"w{n}": n for n in range(TOY["vocab"] - 1)} | {"<unk>": TOY["vocab"] - 1}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))


def test_families_lists_the_external_family_and_the_broken_one(installed):
    done = coli("families", "--json")
    assert done.returncode == 0, done.stderr
    rows = {r["family"]: r for r in json.loads(done.stdout)}
    toy = rows["toy"]
    assert (toy["package"], toy["version"], toy["model_types"], toy["status"]) == (
        "colibri-toy", "0.1.0", ["toymoe"], "ok")
    broken = rows["broken"]
    assert broken["status"] == "broken" and broken["package"] == "colibri-broken-family"
    assert "ImportError" in broken["error"] and "not installed" in broken["error"]


def test_families_text_names_the_broken_plugin_without_a_traceback(installed):
    done = coli("families")
    assert done.returncode == 0, done.stderr
    assert "toy" in done.stdout and "toymoe" in done.stdout
    assert "broken" in done.stdout
    assert "colibri-broken-family" in done.stderr and "Traceback" not in done.stderr


def test_info_through_the_entry_point(installed, toy_model):
    directory, params = toy_model
    done = coli("info", "--json", "--model", str(directory))
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert (data["family"], data["model_type"]) == ("toy", "toymoe")
    per_expert = 3 * TOY["hidden"] * TOY["inter"]
    routed = TOY["layers"] * TOY["experts"] * per_expert
    assert data["parameters"]["total"] == params
    assert data["parameters"]["active_per_token"] == params - routed + TOY["layers"] * TOY["top_k"] * per_expert
    assert data["bytes"]["routed_experts"] == routed * 4
    assert data["bytes"]["embeddings"] == TOY["vocab"] * TOY["hidden"] * 4


def test_doctor_and_plan_work_despite_the_broken_plugin(installed, toy_model):
    directory, _ = toy_model
    done = coli("doctor", "--deep", "--json", "--model", str(directory))
    assert done.returncode == 0, done.stdout + done.stderr
    statuses = {c["name"]: c["status"] for c in json.loads(done.stdout)["checks"]}
    assert statuses["tensor roles"] == "pass" and statuses["engine"] == "warn"
    done = coli("plan", "--json", "--model", str(directory), "--ram", "1", "--disk-bw", "1", "--ctx", "128")
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert plan["family"] == "toy" and plan["cache_slots_per_layer"] == TOY["experts"]


def test_ctx_past_the_external_familys_limit_is_refused(installed, toy_model):
    directory, _ = toy_model
    done = coli("plan", "--model", str(directory), "--ram", "1", "--disk-bw", "1", "--ctx", "4096")
    assert done.returncode == 1
    assert done.stderr.strip() == ("error: --ctx 4096 exceeds the toy engine's limit of 256 tokens "
                                   "(pass --ctx 256 or less)")


def test_a_bug_in_a_plugin_is_reported_as_that_plugins_error(installed, toy_model, tmp_path):
    """The toy plugin reads config["hidden"] without checking it: its KeyError is colibri-toy's bug, named with
    its version, not a colibri internal error."""
    directory, _ = toy_model
    broken = tmp_path / "no-hidden"
    broken.mkdir()
    for item in directory.iterdir():
        (broken / item.name).symlink_to(item)
    (broken / "config.json").unlink()
    (broken / "config.json").write_text(json.dumps({k: v for k, v in TOY.items() if k != "hidden"}))
    done = coli("info", "--model", str(broken))
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.splitlines() == [
        "error: family plugin 'toy' (colibri-toy 0.1.0) failed: KeyError: 'hidden' (a bug in colibri-toy: rerun "
        "with --debug for the traceback and report it to colibri-toy's authors)"]
