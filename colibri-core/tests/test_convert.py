"""coli convert and the colibri-quant container: schemes, stamps, contiguity, refusals, resumability."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from colibri import hookimpl, plugins
from colibri.records import Claim, ExpertTensors, FamilyDescriptor, Geometry, TensorLayout

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TINY_TYPE = "colibri_tiny_moe"
TESTS_DIR = Path(__file__).resolve().parent


# --------------------------------------------------------------------------------------------- a tiny family
class TinyMoeFamily:
    """An OLMoE-shaped test family (own model_type, so it never competes with an installed colibri-olmoe)."""

    @hookimpl
    def describe_family(self):
        return FamilyDescriptor("tinymoe", (TINY_TYPE,), "test family for coli convert")

    @hookimpl
    def detect_config(self, model_dir, config):
        if config and config.get("model_type") == TINY_TYPE:
            return Claim("tinymoe", TINY_TYPE, "test")
        return None

    @hookimpl
    def model_geometry(self, model):
        c = model.config
        return Geometry(model_type=TINY_TYPE, architecture="tiny MoE", attention="none",
                        num_layers=c["num_hidden_layers"], hidden_size=c["hidden_size"],
                        vocab_size=c.get("vocab_size", 96), num_experts=c["num_experts"], top_k=2,
                        expert_intermediate=c["intermediate_size"], moe_layers=tuple(range(c["num_hidden_layers"])))

    @hookimpl
    def tensor_layout(self, model):
        c = model.config
        layers, experts = c["num_hidden_layers"], c["num_experts"]
        p = "model.layers.{}."
        norms, routers, required, ex = ["model.norm.weight"], [], [], []
        for L in range(layers):
            norms += [p.format(L) + "input_layernorm.weight", p.format(L) + "post_attention_layernorm.weight",
                      p.format(L) + "self_attn.q_norm.weight", p.format(L) + "self_attn.k_norm.weight"]
            required += [p.format(L) + f"self_attn.{w}_proj.weight" for w in "qkvo"]
            routers.append((L, p.format(L) + "mlp.gate.weight"))
            for e in range(experts):
                ex.append(ExpertTensors(L, e, tuple(p.format(L) + f"mlp.experts.{e}.{w}_proj.weight"
                                                    for w in ("gate", "up", "down"))))
        return TensorLayout(embeddings=("model.embed_tokens.weight",), lm_head="lm_head.weight", norms=tuple(norms),
                            routers=tuple(routers), experts=tuple(ex), required=tuple(required))


class NoExpertsFamily:
    @hookimpl
    def describe_family(self):
        return FamilyDescriptor("denseonly", ("colibri_tiny_dense",))

    @hookimpl
    def detect_config(self, model_dir, config):
        if config and config.get("model_type") == "colibri_tiny_dense":
            return Claim("denseonly", "colibri_tiny_dense")
        return None

    @hookimpl
    def model_geometry(self, model):
        return Geometry(model_type="colibri_tiny_dense", architecture="dense", attention="none", num_layers=1)

    @hookimpl
    def tensor_layout(self, model):
        return TensorLayout(embeddings=("model.embed_tokens.weight",), lm_head=None, norms=(), routers=(),
                            experts=())


def register_test_families() -> None:
    pm = plugins.manager()
    for name, plugin in (("tinymoe", TinyMoeFamily()), ("denseonly", NoExpertsFamily())):
        if pm.get_plugin(name) is None:
            pm.register(plugin, name=name)


@pytest.fixture(autouse=True)
def families():
    plugins.reset()
    register_test_families()
    yield
    plugins.reset()


# --------------------------------------------------------------------------------------------- tiny checkpoints
def _bf16_bytes(x: np.ndarray) -> np.ndarray:
    from colibri.convert.schemes import f32_to_bf16_bits

    return f32_to_bf16_bits(x.astype(np.float32))


def tiny_tensors(layers=2, experts=16, hidden=64, inter=128, vocab=96, seed=0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def mat(rows, cols):
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm(n):
        return (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    t = {"model.embed_tokens.weight": mat(vocab, hidden), "lm_head.weight": mat(vocab, hidden),
         "model.norm.weight": norm(hidden)}
    for L in range(layers):
        p = f"model.layers.{L}."
        for w in "qkvo":
            t[p + f"self_attn.{w}_proj.weight"] = mat(hidden, hidden)
        t[p + "self_attn.q_norm.weight"] = norm(hidden)
        t[p + "self_attn.k_norm.weight"] = norm(hidden)
        t[p + "input_layernorm.weight"] = norm(hidden)
        t[p + "post_attention_layernorm.weight"] = norm(hidden)
        t[p + "mlp.gate.weight"] = mat(experts, hidden)
        for e in range(experts):
            t[p + f"mlp.experts.{e}.gate_proj.weight"] = mat(inter, hidden)
            t[p + f"mlp.experts.{e}.up_proj.weight"] = mat(inter, hidden)
            t[p + f"mlp.experts.{e}.down_proj.weight"] = mat(hidden, inter)
    # An all-zero row and group exercise the zero-scale rule; an outlier exercises per-group scales.
    t["model.layers.0.mlp.experts.0.gate_proj.weight"][3, :] = 0.0
    t["model.layers.0.mlp.experts.0.up_proj.weight"][5, 7] = 40.0
    return t


def write_tiny(path: Path, dtype="F32", shards=2, extra=True, **kw) -> Path:
    """A tiny OLMoE-shaped checkpoint written with the safetensors library (an independent writer)."""
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    tensors = tiny_tensors(**kw)
    stored = {}
    for name, x in tensors.items():
        if dtype == "BF16":
            stored[name] = _bf16_bytes(x)          # safetensors.numpy has no bfloat16; written as U16, retagged below
        else:
            stored[name] = x.astype(np.float16 if dtype == "F16" else np.float32)
    if extra:
        stored["model.layers.1.mlp.tid2eid"] = np.arange(12, dtype=np.int64).reshape(3, 4)
        stored["model.extra_unlisted.weight"] = np.ones((2, 3), dtype=np.float32)
    names = sorted(stored)
    groups = [names[i::shards] for i in range(shards)]
    weight_map = {}
    for i, group in enumerate(groups, start=1):
        file = f"model-{i:05d}-of-{shards:05d}.safetensors"
        save_file({n: stored[n] for n in group}, str(path / file), metadata={"format": "pt"})
        if dtype == "BF16":
            _retag_u16_as_bf16(path / file)
        weight_map.update({n: file for n in group})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    layers = kw.get("layers", 2)
    config = {"model_type": TINY_TYPE, "num_hidden_layers": layers, "num_experts": kw.get("experts", 16),
              "vocab_size": kw.get("vocab", 96),
              "hidden_size": kw.get("hidden", 64), "intermediate_size": kw.get("inter", 128)}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    write_word_tokenizer(path / "tokenizer.json", kw.get("vocab", 96))
    (path / "generation_config.json").write_text('{"eos_token_id": 1}')
    return path


def write_word_tokenizer(path: Path, size: int) -> None:
    """A real (loadable) word-level tokenizer.json of ``size`` tokens: convert refuses one doctor cannot load."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tok = Tokenizer(WordLevel({"[UNK]": 0, **{f"w{i}": i for i in range(1, size)}}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(path))


def _retag_u16_as_bf16(file: Path) -> None:
    raw = file.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    for k, v in header.items():
        if k != "__metadata__" and v["dtype"] == "U16":
            v["dtype"] = "BF16"
    new = json.dumps(header, separators=(",", ":")).encode()
    new += b" " * (-(8 + len(new)) % 8)
    file.write_bytes(len(new).to_bytes(8, "little") + new + raw[8 + n:])


def resolve(path: Path):
    from colibri.model import resolve_model

    register_test_families()          # module-scoped fixtures run before the per-test registration
    return resolve_model(str(path))


def run_convert(src: Path, out: Path, **kw):
    from colibri.convert.run import convert

    return convert(resolve(src), out, **kw)


def tree_digest(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory) -> Path:
    return write_tiny(tmp_path_factory.mktemp("src") / "tiny")


# --------------------------------------------------------------------------------------------- schemes
def test_int8_row_roundtrip_bound_and_levels():
    from colibri.convert.schemes import INT8, dequantize, max_bound_violation, quantize

    rng = np.random.default_rng(1)
    x = (rng.standard_normal((37, 75)) * rng.uniform(0.001, 3, (37, 1))).astype(np.float32)
    x[4] = 0.0
    q, s = quantize(INT8, x)
    assert q.dtype == np.int8 and s.dtype == np.float16 and s.shape == (37,)
    assert np.abs(q).max() == 127 and q.min() >= -127
    assert s[4] == 0 and not q[4].any()
    assert (s.astype(np.float64) >= np.abs(x).max(1) / 127).all()        # rounded up, never down
    assert max_bound_violation(INT8, x, q, s) <= 1.0
    err = np.abs(dequantize(INT8, q, s) - x)
    assert (err <= s.astype(np.float64)[:, None] / 2 * (1 + 1e-12)).all()


def test_int4_group_roundtrip_bound_and_packing():
    from colibri.convert.schemes import INT4, dequantize, levels_of, max_bound_violation, quantize, unpack_int4

    rng = np.random.default_rng(2)
    x = rng.standard_normal((9, 192)).astype(np.float32)
    x[2, 64:128] = 0.0
    x[5, 10] = 1000.0                                   # an outlier only spoils its own group
    q, s = quantize(INT4, x)
    assert q.dtype == np.uint8 and q.shape == (9, 96) and s.shape == (9, 3)
    levels = unpack_int4(q)
    assert levels.min() >= -7 and levels.max() <= 7
    assert ((q & 0x0F) >= 1).all() and ((q >> 4) >= 1).all()          # nibble = level + 8, never 0
    assert levels[5, 10] == 7 and s[2, 1] == 0
    assert np.array_equal(levels[:, 0] + 8, (q[:, 0] & 0x0F).astype(np.int8))   # even column: low nibble
    assert max_bound_violation(INT4, x, q, s) <= 1.0
    # The outlier's group is coarse; the row's other groups keep fine scales.
    assert s[5, 0] > 100 * s[5, 1]
    np.testing.assert_array_equal(levels_of(INT4, q), levels)
    assert np.abs(dequantize(INT4, q, s) - x)[5, 64:].max() <= float(s[5, 1:].max()) / 2


def test_scale_rounding_up_keeps_bound_at_f16_edges():
    from colibri.convert.schemes import INT4, INT8, f16_scale_up, max_bound_violation, quantize

    ideal = np.array([1e-9, 3e-6, 0.1, 1.0 / 3.0, 60000.0])
    stored = f16_scale_up(ideal)
    assert (stored.astype(np.float64) >= ideal).all()
    prev = np.nextafter(stored, np.float16(0))
    assert (prev.astype(np.float64) < ideal).all()                   # the smallest such value
    tiny = np.full((2, 64), 1e-7, dtype=np.float32)                  # scales in the f16 subnormal range
    for scheme in (INT8, INT4):
        q, s = quantize(scheme, tiny)
        assert max_bound_violation(scheme, tiny, q, s) <= 1.0


def test_quantize_rejects_non_finite_and_overflowing_scales():
    from colibri.convert.schemes import INT8, NonFiniteError, ScaleOverflowError, quantize

    with pytest.raises(NonFiniteError):
        quantize(INT8, np.array([[1.0, np.nan]], dtype=np.float32))
    with pytest.raises(ScaleOverflowError):
        quantize(INT8, np.array([[1e10, 1.0]], dtype=np.float32))


# --------------------------------------------------------------------------------------------- the hook
def test_hook_converter_spec_default_derives_from_layout(tiny_src):
    model = resolve(tiny_src)
    spec = plugins.family_hook(model.family, "converter_spec")(model=model)
    assert spec.expert_schemes == ("int8", "int4")
    assert "model.embed_tokens.weight" in spec.dense_matrices and "lm_head.weight" in spec.dense_matrices
    assert "model.layers.0.self_attn.q_proj.weight" in spec.dense_matrices
    assert "model.layers.0.mlp.gate.weight" not in spec.dense_matrices          # routers stay f32
    assert "model.norm.weight" not in spec.dense_matrices
    assert spec.dense_schemes == ("f32", "bf16", "int8", "int4")


def test_spec_selectors_stay_f32_like_routers(tiny_src):
    from colibri.convert.spec import spec_from_layout

    layout = plugins.family_hook("tinymoe", "tensor_layout")(model=resolve(tiny_src))
    picked = "model.layers.0.self_attn.k_proj.weight"
    spec = spec_from_layout(layout, selectors=[picked])
    assert picked not in spec.dense_matrices
    assert set(spec.dense_matrices) == set(spec_from_layout(layout).dense_matrices) - {picked}


def test_hook_converter_spec_none_without_experts(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "colibri_tiny_dense"}))
    model = resolve(tmp_path)
    assert plugins.family_hook(model.family, "converter_spec")(model=model) is None


def test_hook_converter_spec_family_answer_wins(tiny_src):
    from colibri.records import ConverterSpec

    class Restrictive:
        @hookimpl
        def converter_spec(self, model):
            return ConverterSpec(expert_schemes=("int8",), dense_schemes=("bf16",))

    plugins.manager().register(Restrictive(), name="tinymoe-restrict")
    try:
        # family_hook keeps only the claiming family + core: a different plugin's answer must not leak in.
        model = resolve(tiny_src)
        spec = plugins.family_hook(model.family, "converter_spec")(model=model)
        assert spec.expert_schemes == ("int8", "int4")
    finally:
        plugins.manager().unregister(name="tinymoe-restrict")


# --------------------------------------------------------------------------------------------- conversion
@pytest.mark.parametrize("experts,dense", [("int8", "bf16"), ("int8", "f32"), ("int4", "int8"), ("int4", "int4")])
def test_convert_verify_and_standard_tools_open_it(tiny_src, tmp_path, experts, dense):
    from safetensors import safe_open

    from colibri.convert.container import open_container
    from colibri.convert.schemes import BY_OPTION, dequantize

    out = tmp_path / "out"
    result = run_convert(tiny_src, out, experts=experts, dense=dense, verify=True)
    assert result.verified.tensors == 2 + 1 + 2 * (4 + 4 + 1 + 16 * 3) + 2
    assert result.verified.experts == 32
    assert result.verified.max_ratio[BY_OPTION[experts].name] <= 1.0
    assert not (out / ".colibri-convert").exists()
    for side in ("config.json", "tokenizer.json", "generation_config.json"):
        assert (out / side).read_bytes() == (tiny_src / side).read_bytes()

    c = open_container(out)
    assert c is not None and c.version == "1"
    gate = c.tensors["model.layers.1.mlp.experts.3.gate_proj.weight"]
    assert gate.scheme == BY_OPTION[experts].name and gate.shape == (128, 64)
    assert c.tensors["model.layers.0.mlp.gate.weight"].scheme == "f32"
    assert c.tensors["model.norm.weight"].scheme == "f32"
    assert c.tensors["model.layers.1.mlp.tid2eid"].scheme == "copy"
    assert c.tensors["model.extra_unlisted.weight"].scheme == "copy"
    q_proj = c.tensors["model.layers.0.self_attn.q_proj.weight"]
    assert q_proj.scheme == (dense if dense in ("bf16", "f32") else BY_OPTION[dense].name)
    assert json.loads((out / "model.safetensors.index.json").read_text())["metadata"]["colibri.dense"] == \
        q_proj.scheme

    # safetensors itself opens every shard, and its bytes dequantize close to the source.
    src = tiny_tensors()
    for shard in sorted(out.glob("model-*.safetensors")):
        with safe_open(str(shard), framework="numpy") as f:
            meta = f.metadata()
            assert meta["colibri.container"] == "colibri-quant" and meta["format"] == "pt"
            if "model.layers.1.mlp.experts.3.gate_proj.qweight" in f.keys():
                scheme = BY_OPTION[experts]
                deq = dequantize(scheme, f.get_tensor("model.layers.1.mlp.experts.3.gate_proj.qweight"),
                                 f.get_tensor("model.layers.1.mlp.experts.3.gate_proj.scales"))
                x = src["model.layers.1.mlp.experts.3.gate_proj.weight"]
                assert np.abs(deq - x).max() <= np.abs(x).max() / scheme.levels / 2 * 1.001


def test_bf16_and_f16_sources(tmp_path):
    from colibri.convert.container import open_container

    for dtype in ("BF16", "F16"):
        src = write_tiny(tmp_path / f"src-{dtype}", dtype=dtype, layers=1)
        out = tmp_path / f"out-{dtype}"
        result = run_convert(src, out, experts="int4", dense="bf16", verify=True)
        assert result.verified.max_ratio["int4-g64"] <= 1.0
        c = open_container(out)
        assert c.tensors["model.norm.weight"].parts[0].dtype == "F32"            # small tensors upcast to f32
        assert c.tensors["model.embed_tokens.weight"].parts[0].dtype == "BF16"
    # --dense f32 keeps every source value: F16/BF16 widen exactly (checked by --verify), F32 is copied.
    for dtype in ("F16", "F32"):
        src = write_tiny(tmp_path / f"src32-{dtype}", dtype=dtype, layers=1)
        run_convert(src, tmp_path / f"out32-{dtype}", experts="int8", dense="f32", verify=True)
        emb = open_container(tmp_path / f"out32-{dtype}").tensors["model.embed_tokens.weight"]
        assert (emb.scheme, emb.parts[0].dtype) == ("f32", "F32")


def test_layout_shards_by_layer_and_experts_contiguous(tiny_src, tmp_path):
    from colibri.checkpoint import read_header
    from colibri.convert.container import open_container

    out = tmp_path / "out"
    run_convert(tiny_src, out, experts="int4", dense="bf16")
    shards = sorted(out.glob("model-*.safetensors"))
    assert [s.name for s in shards] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["colibri.container"] == "colibri-quant"
    assert index["metadata"]["total_size"] == sum(s.stat().st_size - read_header(s).data_start for s in shards)
    c = open_container(out)
    for layer, shard in ((0, shards[1]), (1, shards[2])):
        header = read_header(shard)
        by_offset = sorted(header.tensors, key=lambda t: t.begin)
        assert all(f".layers.{layer}." in t.name for t in by_offset)
        expert_parts = [t for t in by_offset if ".mlp.experts." in t.name]
        # Experts occupy the tail of the shard, in expert order, each block gate/up/down with its scales.
        assert expert_parts == by_offset[-len(expert_parts):]
        want = [f"model.layers.{layer}.mlp.experts.{e}.{w}_proj.{part}"
                for e in range(16) for w in ("gate", "up", "down") for part in ("qweight", "scales")]
        assert [t.name for t in expert_parts] == want
        for e in range(16):
            names = tuple(f"model.layers.{layer}.mlp.experts.{e}.{w}_proj.weight" for w in ("gate", "up", "down"))
            file, begin, end = c.extent(names)
            assert file == shard
            assert end - begin == 2 * (128 * 64 // 2 + 128 * 2) + (64 * 128 // 2 + 64 * 2 * 2)
        for t in by_offset:                                   # float tensors aligned to their element size
            if t.dtype in ("F32", "BF16"):
                assert t.begin % (4 if t.dtype == "F32" else 2) == 0


def test_output_is_deterministic(tiny_src, tmp_path):
    run_convert(tiny_src, tmp_path / "a", experts="int4", dense="int8")
    run_convert(tiny_src, tmp_path / "b", experts="int4", dense="int8")
    assert tree_digest(tmp_path / "a") == tree_digest(tmp_path / "b")


def test_rerun_on_finished_output_is_a_no_op(tiny_src, tmp_path):
    out = tmp_path / "out"
    run_convert(tiny_src, out)
    before = tree_digest(out)
    again = run_convert(tiny_src, out)
    assert again.already_done and again.written_shards == 0
    assert tree_digest(out) == before


# --------------------------------------------------------------------------------------------- stamps
def _rewrite_metadata(shard: Path, **changes) -> None:
    raw = shard.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    for k, v in changes.items():
        key = k.replace("_", ".", 1)
        if v is None:
            header["__metadata__"].pop(key, None)
        else:
            header["__metadata__"][key] = v
    new = json.dumps(header, separators=(",", ":")).encode()
    new += b" " * (-(8 + len(new)) % 8)
    shard.write_bytes(len(new).to_bytes(8, "little") + new + raw[8 + n:])


@pytest.fixture(scope="module")
def converted(tiny_src, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("conv") / "out"
    run_convert(tiny_src, out, experts="int4", dense="bf16")
    return out


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("changes,needle", [
    ({"colibri_container": "colibri-quant-nf4"}, "is not a format colibri knows"),
    ({"colibri_version": "2"}, "version '2' is not supported"),
    ({"colibri_schemes": "{not json"}, "is not a JSON object"),
    ({"colibri_schemes": json.dumps({"model.layers.0.mlp.experts.0.gate_proj.weight": "int3-g32"})},
     "unknown scheme 'int3-g32'"),
    ({"colibri_schemes": json.dumps({"model.layers.0.mlp.experts.0.gate_proj.weight": "int8-row"})},
     "stores 2-D I8"),
    ({"colibri_schemes": json.dumps({})}, "is not named in the colibri.schemes map"),
])
def test_reader_refuses_unknown_or_inconsistent_stamp(converted, tmp_path, changes, needle):
    from colibri.convert.container import ContainerError, open_container

    out = _copy(converted, tmp_path / "c")
    _rewrite_metadata(out / "model-00002-of-00003.safetensors", **changes)
    with pytest.raises(ContainerError) as err:
        open_container(out)
    assert needle in err.value.message and "model-00002-of-00003.safetensors" in err.value.message
    assert "\n" not in err.value.one_line()


def test_reader_refuses_mixed_stamped_and_plain_shards(converted, tmp_path):
    from colibri.convert.container import ContainerError, open_container

    out = _copy(converted, tmp_path / "c")
    _rewrite_metadata(out / "model-00003-of-00003.safetensors", colibri_container=None, colibri_version=None,
                      colibri_schemes=None)
    with pytest.raises(ContainerError, match="has no colibri-quant stamp"):
        open_container(out)


def test_native_checkpoint_is_not_a_container(tiny_src):
    from colibri.convert.container import open_container

    assert open_container(tiny_src) is None


def test_verify_catches_a_flipped_byte(converted, tmp_path, tiny_src):
    from colibri.checkpoint import TensorIndex, default_shard_set, read_header
    from colibri.convert.container import ContainerError
    from colibri.convert.verify import verify_container

    out = _copy(converted, tmp_path / "c")
    shard = out / "model-00003-of-00003.safetensors"
    t = next(t for t in read_header(shard).tensors if t.name.endswith("experts.9.up_proj.qweight"))
    data = bytearray(shard.read_bytes())
    data[t.begin + 5] ^= 0x11
    shard.write_bytes(bytes(data))
    index = TensorIndex((default_shard_set(tiny_src),))
    with pytest.raises(ContainerError, match="experts.9.up_proj.qweight rows"):
        verify_container(out, index, resolve(tiny_src))


# --------------------------------------------------------------------------------------------- refusals
def test_refuses_output_holding_another_checkpoint(tiny_src, tmp_path):
    from colibri.errors import UsageError

    other = write_tiny(tmp_path / "other", layers=1)
    with pytest.raises(UsageError, match="already holds another checkpoint"):
        run_convert(tiny_src, other)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("x")
    with pytest.raises(UsageError, match="already holds other files"):
        run_convert(tiny_src, tmp_path / "junk")
    with pytest.raises(UsageError, match="overlaps the source"):
        run_convert(tiny_src, tiny_src / "sub")


def test_refuses_other_container_and_other_options(tiny_src, tmp_path):
    from colibri.errors import UsageError

    out = tmp_path / "out"
    run_convert(tiny_src, out, experts="int8")
    with pytest.raises(UsageError, match="another colibri-quant container"):
        run_convert(tiny_src, out, experts="int4")
    with pytest.raises(UsageError, match="is already a colibri-quant container"):
        run_convert(out, tmp_path / "again")


def test_refuses_unfinished_job_with_other_options(tiny_src, tmp_path):
    from colibri.convert.run import JOB_FILE, WORK_DIR
    from colibri.errors import UsageError

    out = tmp_path / "out"
    (out / WORK_DIR).mkdir(parents=True)
    (out / WORK_DIR / JOB_FILE).write_text(json.dumps({"job": "0" * 64}))
    with pytest.raises(UsageError, match="unfinished conversion of another source or with other options"):
        run_convert(tiny_src, out)


def test_refuses_family_without_converter(tmp_path):
    from safetensors.numpy import save_file

    from colibri.errors import FamilyError

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "colibri_tiny_dense"}))
    save_file({"model.embed_tokens.weight": np.ones((4, 4), np.float32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(FamilyError, match="family 'denseonly' .* has no converter"):
        run_convert(tmp_path, tmp_path.parent / "out")


def test_refuses_flags_the_family_does_not_support(tiny_src, tmp_path):
    from colibri.errors import UsageError
    from colibri.records import ConverterSpec

    class Int8Only(TinyMoeFamily):
        @hookimpl
        def converter_spec(self, model):
            return ConverterSpec(expert_schemes=("int8",), dense_schemes=("bf16",))

    pm = plugins.manager()
    pm.unregister(name="tinymoe")
    pm.register(Int8Only(), name="tinymoe")
    with pytest.raises(UsageError, match="--experts int4: family 'tinymoe' does not support it"):
        run_convert(tiny_src, tmp_path / "o", experts="int4")
    with pytest.raises(UsageError, match="--dense int8: family 'tinymoe' does not support it"):
        run_convert(tiny_src, tmp_path / "o", experts="int8", dense="int8")
    with pytest.raises(UsageError, match="--experts int2: unknown scheme"):
        run_convert(tiny_src, tmp_path / "o", experts="int2")


def test_int4_falls_back_to_int8_per_tensor_when_input_dim_is_not_a_multiple_of_64(tmp_path):
    from typer.testing import CliRunner

    from colibri.cli import app
    from colibri.convert.container import open_container

    src = write_tiny(tmp_path / "src", layers=2, inter=96)   # down_proj [64, 96]: 96 is no multiple of 64
    result = run_convert(src, tmp_path / "out", experts="int4", dense="int4", verify=True)
    container = open_container(tmp_path / "out")
    schemes = {name: t.scheme for name, t in container.tensors.items()}
    downs = {n for n in schemes if n.endswith("down_proj.weight")}
    assert len(downs) == 2 * 16 and {schemes[n] for n in downs} == {"int8-row"}
    assert {s for n, s in schemes.items() if ".experts." in n and n not in downs} == {"int4-g64"}
    assert schemes["model.layers.0.self_attn.q_proj.weight"] == "int4-g64"     # dense [64, 64] keeps int4
    assert sorted(f.name for f in result.fallbacks) == sorted(downs)
    assert {(f.shape, f.wanted, f.used) for f in result.fallbacks} == {((64, 96), "int4-g64", "int8-row")}
    assert result.verified.max_ratio["int8-row"] <= 1.0 and result.verified.max_ratio["int4-g64"] <= 1.0

    res = CliRunner().invoke(app, ["convert", "--model", str(src), "--out", str(tmp_path / "cli"), "--experts", "int4"],
                             terminal_width=200)
    assert res.exit_code == 0, res.output
    lines = [" ".join(ln.split()) for ln in res.output.splitlines() if ln.startswith("fallback")]
    assert lines == ["fallback model.layers.*.mlp.experts.*.down_proj.weight [64, 96] x32: int8-row instead of "
                     "int4-g64 (input width 96 is not a multiple of 64)"], res.output


def test_refuses_non_finite_weights(tmp_path):
    from safetensors.numpy import load_file, save_file

    from colibri.errors import CheckpointError

    src = write_tiny(tmp_path / "src", layers=1, shards=1, extra=False)
    shard = src / "model-00001-of-00001.safetensors"
    tensors = load_file(str(shard))
    tensors["model.layers.0.mlp.experts.2.up_proj.weight"][0, 0] = np.inf
    save_file(tensors, str(shard))
    with pytest.raises(CheckpointError, match="experts.2.up_proj.weight' holds inf or NaN"):
        run_convert(src, tmp_path / "out")


# --------------------------------------------------------------------------------------------- the CLI
def test_cli_convert_prints_summary_and_one_line_errors(tiny_src, tmp_path):
    from typer.testing import CliRunner

    from colibri.cli import app

    runner = CliRunner()
    res = runner.invoke(app, ["convert", "--model", str(tiny_src), "--out", str(tmp_path / "o"),
                              "--experts", "int4", "--verify"])
    assert res.exit_code == 0, res.output
    assert "peak RSS" in res.output and "verified" in res.output
    res = runner.invoke(app, ["convert", "--model", str(tiny_src), "--out", str(tmp_path / "o"), "--experts", "int8"])
    assert res.exit_code == 1
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert lines == [lines[0]] and lines[0].startswith("error: --out") and "another colibri-quant" in lines[0]
    for flag, value in (("--dense", "f16"), ("--experts", "f32"), ("--experts", "bf16")):
        res = runner.invoke(app, ["convert", "--model", str(tiny_src), "--out", str(tmp_path / "p"), flag, value])
        assert res.exit_code != 0
        lines = [ln for ln in res.output.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith(f"error: {flag} {value}: unknown scheme"), lines
    help_text = runner.invoke(app, ["convert", "--help"], terminal_width=200).output
    assert "f32|bf16|int8|int4" in help_text


# --------------------------------------------------------------------------------------------- resumability
CHILD = r"""
import sys
sys.path.insert(0, {tests!r})
import test_convert as t
t.register_test_families()
from colibri.convert import io
import time
from colibri.convert import run
io.CHUNK_BYTES = 4096          # many small writes: kills land mid-tensor as well as between files
_produce = run.produce

def slow_produce(*a, **k):     # stretch the run so that kills spread over all of it
    for chunk in _produce(*a, **k):
        time.sleep(0.002)
        yield chunk

run.produce = slow_produce
print("go", flush=True)        # imports done: the parent times its kill from here
t.run_convert(__import__("pathlib").Path({src!r}), __import__("pathlib").Path({out!r}), experts="int4", dense="int8")
"""


def _spawn(src: Path, out: Path) -> subprocess.Popen:
    code = CHILD.format(tests=str(TESTS_DIR), src=str(src), out=str(out))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_kill_9_at_random_points_then_rerun_is_byte_identical(tmp_path):
    src = write_tiny(tmp_path / "src", layers=6, experts=16, shards=3)
    ref = tmp_path / "ref"
    proc = _spawn(src, ref)
    assert proc.stdout.readline() == b"go\n"
    t0 = time.monotonic()
    _, err = proc.communicate(timeout=300)
    work_time = time.monotonic() - t0
    assert proc.returncode == 0, err.decode()[-2000:]
    want = tree_digest(ref)

    out = tmp_path / "out"
    rng = random.Random(1234)
    seen_partial_states = set()
    kills = 0
    # Kill points are times, and a loaded machine stretches or squeezes the run they were drawn for: keep killing
    # (a run that finished first starts the next one from scratch) until the kills landed at two different points.
    for _ in range(24):
        proc = _spawn(src, out)
        assert proc.stdout.readline() == b"go\n"
        time.sleep(rng.uniform(0.0, 0.8) * work_time)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=300)
        if proc.returncode == 0:      # it finished before the kill: no partial state to resume from
            shutil.rmtree(out)
            continue
        kills += 1
        if out.exists():
            seen_partial_states.add(len(list(out.glob("model-*.safetensors"))))
        if kills >= 6 and len(seen_partial_states) >= 2:
            break
    assert len(seen_partial_states) >= 2, f"every kill landed at the same point ({sorted(seen_partial_states)})"
    proc = _spawn(src, out)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err.decode()[-2000:]
    assert tree_digest(out) == want


# --------------------------------------------------------------------------------------------- quality tooling
class _FakeEngine:
    """Speaks the protocol's logits/forced events from a fixed logits table (a stand-in for a built engine)."""

    def __init__(self, table: np.ndarray, skip_pos: int | None = None):
        self.table, self.skip_pos, self.calls = table, skip_pos, []

    def submit(self, prompt, *, slot=0, logits=False, forced=None, max_tokens=1, temperature=0.0):
        self.calls.append((list(prompt), list(forced or []), logits, max_tokens))
        n = len(prompt) + len(forced or []) - 1
        events = [{"ev": "logits", "id": 1, "pos": p, "values": list(self.table[p])} for p in range(n)
                  if p != self.skip_pos]
        events.append({"ev": "done", "id": 1, "reason": "length"})

        class _Req:
            def events(self_inner):
                return iter(events)

        return _Req()


def test_quality_metrics_identical_and_perturbed():
    from colibri.convert.quality import compare, forced_logits, measure

    rng = np.random.default_rng(5)
    ref = rng.standard_normal((7, 11)) * 3
    ids = [int(i) for i in rng.integers(0, 11, 8)]
    same = compare(ref, ref.copy(), ids[1:])
    assert same.mean_kl == pytest.approx(0.0, abs=1e-12) and same.top1_agreement == 1.0
    assert same.reference_ppl == pytest.approx(same.candidate_ppl)
    noisy = compare(ref, ref + rng.standard_normal(ref.shape), ids[1:])
    assert noisy.mean_kl > 0.01 and noisy.max_kl >= noisy.mean_kl

    engine = _FakeEngine(ref)
    got = forced_logits(engine, ids, prefill=3)
    np.testing.assert_array_equal(got, ref.astype(np.float32))     # engines compute and send float32 logits
    prompt, forced, wants_logits, max_tokens = engine.calls[0]
    assert prompt == ids[:3] and forced == ids[3:] and wants_logits == "f32" and max_tokens == 5
    report = measure(_FakeEngine(ref), _FakeEngine(ref), [ids, ids])
    assert report.positions == 14 and report.mean_kl == pytest.approx(0.0, abs=1e-12)


def test_quality_refuses_missing_logits():
    from colibri.convert.quality import forced_logits
    from colibri.errors import EngineError

    with pytest.raises(EngineError, match="no logits for position 4"):
        forced_logits(_FakeEngine(np.zeros((5, 3)), skip_pos=4), [0, 1, 2, 0, 1, 2], prefill=2)


def test_resume_refuses_a_source_changed_since_the_interruption(tmp_path):
    import shutil

    from colibri.convert.run import JOB_FILE, WORK_DIR, _source_stamps, make_plan
    from colibri.errors import UsageError

    src = write_tiny(tmp_path / "src", layers=1, shards=1)
    done = tmp_path / "done"
    run_convert(src, done)
    plan, index = make_plan(resolve(src), "int8", "bf16")

    def interrupted_copy(name: str) -> Path:
        """A finished output with its work directory back, as a run killed before cleaning up leaves it."""
        out = shutil.copytree(done, tmp_path / name)
        (out / WORK_DIR).mkdir()
        job = {"job": plan.job, "source_files": _source_stamps(index)}
        (out / WORK_DIR / JOB_FILE).write_text(json.dumps(job))
        return out

    resumed = interrupted_copy("a")
    run_convert(src, resumed)                                  # same source: the resume completes
    assert tree_digest(resumed) == tree_digest(done)
    stale = interrupted_copy("b")
    shard = src / "model-00001-of-00001.safetensors"
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    with pytest.raises(UsageError, match="source shards changed since the interrupted conversion began"):
        run_convert(src, stale)


def test_refuses_a_second_concurrent_conversion_into_the_same_directory(tiny_src, tmp_path):
    import fcntl

    from colibri.convert.run import LOCK_FILE, WORK_DIR
    from colibri.errors import UsageError

    out = tmp_path / "out"
    (out / WORK_DIR).mkdir(parents=True)
    fd = os.open(out / WORK_DIR / LOCK_FILE, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)                  # as a running coli convert holds it
        with pytest.raises(UsageError, match="another coli convert is writing into it right now"):
            run_convert(tiny_src, out)
    finally:
        os.close(fd)
    run_convert(tiny_src, out, verify=True)             # the lock died with its holder: the run goes through
    assert not (out / WORK_DIR).exists()
