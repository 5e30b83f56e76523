"""``coli convert --verify`` on the quantized releases colibri exists for: block-FP8 and packed-int4 sources.

The tiny family here names its routed experts as a quantized release stores them (``source_quant``, as the
DeepSeek and Kimi plugins do: an FP8 expert with its ``weight_scale_inv``, a packed one by its ``weight_packed`` and
``weight_scale``), so the converter consumes those scales and verify has to account for them. Each failure case
changes one byte after conversion, in the container or in a consumed source tensor, and verify must name it.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
from test_convert import TinyMoeFamily, resolve, run_convert, write_tiny

from colibri import hookimpl, plugins, source_quant
from colibri.checkpoint import TensorIndex, default_shard_set, read_header
from colibri.convert.container import ContainerError, open_container
from colibri.convert.verify import verify_container
from colibri.testing.fp8 import write_fp8_checkpoint
from colibri.testing.int4_packed import write_int4_checkpoint

LAYERS, EXPERTS = 2, 16


class QuantizedTinyMoe(TinyMoeFamily):
    """The tiny family, its experts named as a quantized checkpoint stores them."""

    @hookimpl
    def tensor_layout(self, model):
        base = super().tensor_layout(model)
        dense = [*base.required, *(n for _, n in base.routers), *base.embeddings, base.lm_head]
        stored = source_quant.quantized_layout(model.config, str(model.path / "config.json"), model.path, dense,
                                               base.experts)
        return dataclasses.replace(base, experts=tuple(stored.experts), buffers=base.buffers + tuple(stored.buffers))


@pytest.fixture(autouse=True)
def families():
    plugins.reset()
    plugins.manager().register(QuantizedTinyMoe(), name="tinymoe")
    yield
    plugins.reset()


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quantized-sources")
    plain = write_tiny(root / "plain", shards=1)
    return {"fp8": write_fp8_checkpoint(plain, root / "fp8"), "int4": write_int4_checkpoint(plain, root / "int4")}


@pytest.fixture(scope="module")
def containers(sources, tmp_path_factory) -> dict[str, Path]:
    """One container per source, converted (and verified) once; each test mutates its own copy."""
    root = tmp_path_factory.mktemp("quantized-containers")
    plugins.reset()
    plugins.manager().register(QuantizedTinyMoe(), name="tinymoe")
    try:
        return {kind: _convert(src, root / kind, "int4") for kind, src in sources.items()}
    finally:
        plugins.reset()


def _convert(src: Path, out: Path, experts: str) -> Path:
    result = run_convert(src, out, experts=experts, dense="bf16", verify=True)
    assert result.verified is not None
    assert result.verified.tensors == len(open_container(out).tensors)
    assert result.verified.experts == LAYERS * EXPERTS
    return out


def _verify(src: Path, out: Path):
    return verify_container(out, TensorIndex((default_shard_set(src),)), resolve(src))


def _flip(file: Path, tensor: str, byte: int, mask: int) -> None:
    t = next(t for t in read_header(file).tensors if t.name == tensor)
    data = bytearray(file.read_bytes())
    data[t.begin + byte] ^= mask
    file.write_bytes(bytes(data))


def _copies(sources, containers, kind: str, tmp_path: Path) -> tuple[Path, Path]:
    return (Path(shutil.copytree(sources[kind], tmp_path / "src")),
            Path(shutil.copytree(containers[kind], tmp_path / "out")))


def _shard_of(container: Path, tensor: str) -> Path:
    return open_container(container).tensors[tensor].file


# --------------------------------------------------------------------------------------------- passes
@pytest.mark.parametrize("experts", ["int4", "int8"])
def test_verify_passes_on_fp8_source_with_dense_kept_fp8(sources, tmp_path, experts):
    out = _convert(sources["fp8"], tmp_path / "out", experts)
    c = open_container(out)
    # the FP8 attention matrices are copied with their scales; the experts' scales were consumed
    q = c.tensors["model.layers.0.self_attn.q_proj.weight"]
    assert (q.scheme, q.parts[0].dtype) == ("copy", "F8_E4M3")
    assert "model.layers.0.self_attn.q_proj.weight_scale_inv" in c.tensors
    assert "model.layers.0.mlp.experts.0.up_proj.weight_scale_inv" not in c.tensors
    assert c.tensors["model.layers.0.mlp.experts.0.up_proj.weight"].quant is not None
    assert _verify(sources["fp8"], out).max_ratio[c.tensors["model.layers.1.mlp.experts.3.down_proj.weight"]
                                                   .scheme] <= 1.0


def test_verify_passes_on_packed_int4_source(sources, containers):
    c = open_container(containers["int4"])
    names = set(c.tensors)
    assert "model.layers.0.mlp.experts.0.up_proj.weight" in names
    assert not any(n.endswith(("weight_packed", "weight_scale", "weight_shape")) for n in names)
    result = _verify(sources["int4"], containers["int4"])
    assert result.experts == LAYERS * EXPERTS and result.max_ratio["int4-g64"] <= 1.0


def test_cli_convert_verify_prints_the_verify_line(sources, tmp_path):
    from typer.testing import CliRunner

    from colibri.cli import app

    out = tmp_path / "out"
    r = CliRunner().invoke(app, ["convert", "--model", str(sources["int4"]), "--out", str(out), "--experts", "int8",
                                 "--verify"])
    assert r.exit_code == 0, r.output
    assert f"{LAYERS * EXPERTS} experts contiguous" in r.output and "int8-row" in r.output


# --------------------------------------------------------------------------------------------- failures
@pytest.mark.parametrize("kind", ["fp8", "int4"])
def test_verify_fails_on_a_flipped_quantized_byte(sources, containers, tmp_path, kind):
    src, out = _copies(sources, containers, kind, tmp_path)
    name = "model.layers.1.mlp.experts.9.up_proj"
    shard = _shard_of(out, name + ".weight")
    _flip(shard, name + ".qweight", 5, 0x11)
    with pytest.raises(ContainerError, match=rf"^{shard}: {name}\.qweight rows 0\.\.\d+ differ from a fresh"):
        _verify(src, out)


def test_verify_fails_on_a_flipped_byte_of_a_copied_fp8_tensor(sources, containers, tmp_path):
    src, out = _copies(sources, containers, "fp8", tmp_path)
    name = "model.layers.0.self_attn.o_proj.weight"
    shard = _shard_of(out, name)
    _flip(shard, name, 70, 0x01)
    with pytest.raises(ContainerError, match=rf"^{shard}: {name} rows 0\.\.\d+ differ from the source"):
        _verify(src, out)


@pytest.mark.parametrize("kind,scale,byte", [
    ("fp8", "model.layers.0.mlp.experts.2.gate_proj.weight_scale_inv", 3),   # F32: an exponent bit
    ("int4", "model.layers.0.mlp.experts.2.gate_proj.weight_scale", 1),      # BF16: an exponent bit
])
def test_verify_fails_when_a_consumed_source_scale_changes(sources, containers, tmp_path, kind, scale, byte):
    src, out = _copies(sources, containers, kind, tmp_path)
    _flip(src / "model.safetensors", scale, byte, 0x01)
    with pytest.raises(ContainerError, match=r"model\.layers\.0\.mlp\.experts\.2\.gate_proj\.(scales|qweight) rows "
                                             r"0\.\.\d+ differ from a fresh quantization of the source"):
        _verify(src, out)


def test_verify_fails_when_a_packed_weight_shape_disagrees(sources, containers, tmp_path):
    src, out = _copies(sources, containers, "int4", tmp_path)
    name = "model.layers.1.mlp.experts.0.down_proj.weight_shape"
    _flip(src / "model.safetensors", name, 0, 0x01)
    with pytest.raises(ContainerError, match=rf"source tensor {name} says \[65, 128\], the container holds "
                                             r"\[64, 128\]"):
        _verify(src, out)


def test_verify_refuses_a_quantized_tensor_whose_planned_source_is_not_float(sources, containers):
    """A plan that reads an FP8 expert without its scales (as a copy) must fail in one line, not in the decoder."""
    from colibri.convert.verify import source_plan

    src = sources["fp8"]
    index = TensorIndex((default_shard_set(src),))
    plan = source_plan(index, resolve(src))
    name = "model.layers.0.mlp.experts.4.down_proj.weight"
    for shard in plan.shards:
        shard.items = [dataclasses.replace(it, scale=None) if it.source.name == name else it for it in shard.items]
    with pytest.raises(ContainerError, match=rf"{name} is stored int4-g64, but its source is F8_E4M3"):
        verify_container(containers["fp8"], index, resolve(src), plan)
