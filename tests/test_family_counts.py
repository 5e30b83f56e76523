"""Every installed family against transformers: ``coli info`` and ``coli doctor --deep`` on each tiny model.

Parameter counts must equal transformers' ``num_parameters()`` (tensors under ``skipped_prefixes``, such as a
vision tower the engine never loads, are counted apart), and doctor must find every role the family names.
"""

from __future__ import annotations

import json

import pytest
from colibri import plugins
from colibri.cli import app
from colibri.testing.tiny import KINDS, tiny_model
from typer.testing import CliRunner

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny-all")


@pytest.fixture(autouse=True)
def installed_families(monkeypatch):
    monkeypatch.delenv("COLIBRI_LOAD_PLUGINS", raising=False)
    monkeypatch.delenv("COLIBRI_DISABLE_PLUGINS", raising=False)
    plugins.reset()
    yield
    plugins.reset()


@pytest.mark.parametrize("kind", KINDS)
def test_info_counts_every_family(kind, tiny_root):
    built = tiny_model(kind, tiny_root)
    result = runner.invoke(app, ["info", "--json", "--model", str(built.path)])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    params = data["parameters"]
    assert params["total"] + params["skipped"] == built.num_parameters, (
        f"{data['family']}: info counts {params['total'] + params['skipped']} parameters, transformers "
        f"{built.num_parameters}; stored tensors that are not parameters (buffers such as e_score_correction_bias "
        f"or tid2eid: {built.num_stored_elements - built.num_parameters} elements here) belong in "
        f"TensorLayout.buffers")
    assert params["total"] + params["skipped"] + params["buffers"] == built.num_stored_elements, params
    assert 0 < params["active_per_token"] <= params["total"]
    if data["geometry"]["experts"]:
        assert params["routed_experts"] > 0 and params["active_per_token"] < params["total"]


@pytest.mark.parametrize("kind", KINDS)
def test_doctor_deep_passes_every_family(kind, tiny_root):
    built = tiny_model(kind, tiny_root)
    result = runner.invoke(app, ["doctor", "--deep", "--json", "--model", str(built.path)])
    assert result.exit_code == 0, result.output
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert checks["shards"]["status"] == "pass" and checks["tensor roles"]["status"] in ("pass", "warn")
