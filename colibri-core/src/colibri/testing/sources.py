"""Shared steps of the tests of quantized source checkpoints (block-FP8, int4 compressed-tensors) in each family.

    from colibri.testing.sources import resolved, start_engine, info_counts, refuses, stored_tensors
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..engine import Engine
from ..model import read_config
from ..records import ResolvedModel


def resolved(path: Path, family: str, **change: Any) -> ResolvedModel:
    """The checkpoint at ``path`` as ``family`` resolves it, with config.json fields replaced by ``change``."""
    cfg = dict(read_config(path) or {}, **change)
    return ResolvedModel(path, family, cfg["model_type"], cfg)


def start_engine(binary: Path, model_dir: Path, family: str, hparams: Callable[[ResolvedModel], tuple[str, ...]],
                 cap: int) -> Engine:
    """The family's engine on ``model_dir`` (one slot, 128 positions, two threads) with ``--cap cap``."""
    argv = [str(binary), "--model", str(model_dir), "--ctx", "128", "--slots", "1", "--cap", str(cap),
            "--threads", "2", *hparams(resolved(model_dir, family))]
    return Engine(argv)


def info_counts(model_dir: Path, num_parameters: int) -> dict[str, Any]:
    """``coli info --json``: parameters as transformers counts them (scales are not parameters) and every stored
    byte counted (the difference is the headers). Returns the JSON."""
    from typer.testing import CliRunner

    from ..cli import app

    result = CliRunner().invoke(app, ["info", "--json", "--model", str(model_dir)])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["parameters"]["total"] == num_parameters, "scales are not parameters"
    on_disk = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
    assert 0 < on_disk - data["bytes"]["total"] < 64 * 1024, "every stored byte is counted"
    doctor = CliRunner().invoke(app, ["doctor", "--model", str(model_dir)])
    assert doctor.exit_code == 0 and "\nfail" not in doctor.output, doctor.output
    return data


def refuses(model: ResolvedModel, field: str, *hooks: Callable[[ResolvedModel], Any]) -> None:
    """Each hook refuses ``model`` with one line naming ``config.json: quantization_config.<field>``."""
    import pytest

    from ..errors import ConfigError

    for hook in hooks:
        with pytest.raises(ConfigError, match=f"config.json: quantization_config.{field}"):
            hook(model)


def stored_tensors(directory: Path) -> dict[str, tuple[str, bytes]]:
    """name -> (dtype, stored bytes) of every tensor of a checkpoint."""
    from ..checkpoint import read_header

    out = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        data = f.read_bytes()
        out.update({t.name: (t.dtype, data[t.begin:t.end]) for t in read_header(f).tensors})
    return out


def quantized_pair(root: Path, kind: str, write: Callable[[Path, Path], Path], dequantize: Callable[[Path, Path], Path],
                   seed: int = 0, **overrides: Any) -> tuple[Any, Path, Path]:
    """(the tiny float model, its quantized copy ``write`` makes, the dequantized checkpoint of that copy)."""
    from .tiny import tiny_model

    built = tiny_model(kind, root / "tiny", seed=seed, **overrides)
    quantized = write(built.path, root / "quantized")
    return built, quantized, dequantize(quantized, root / "dequantized")


def check_against_dequantized(start: Callable[[Path, int], Engine], quantized: Path, dequantized: Path, reference: Any,
                              *, moe_layers: int, experts: int, reads_per_miss: int) -> None:
    """The engine on the quantized checkpoint against transformers on the dequantized one at every cache size (one
    slot per layer evicting every routed expert), each miss costing ``reads_per_miss`` reads; and against the
    engine on the dequantized checkpoint, bit for bit (the kernels form each weight as its exact f32 value)."""
    from .parity import check_every_cache_size, pick_prompt

    prompt, ref_logits, ref_tokens = pick_prompt(reference)
    runs = check_every_cache_size(lambda cap: start(quantized, cap), prompt, ref_logits, ref_tokens,
                                  moe_layers=moe_layers, experts=experts)
    for cap, (_, stats) in runs.items():
        assert stats["reads"] == [reads_per_miss * m for m in stats["misses"]], f"cap {cap}: reads per miss"
    same = []
    for model_dir in (quantized, dequantized):
        with start(model_dir, 1) as engine:
            same.append(engine.generate(prompt, max_tokens=8, logits=True))
    assert same[0].tokens == same[1].tokens and same[0].logits == same[1].logits, "not the dequantized copy's bits"
