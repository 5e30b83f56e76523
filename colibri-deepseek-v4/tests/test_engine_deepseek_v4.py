"""The DeepSeek-V4 engine (engine/deepseek_v4.c) against transformers.

Tiny random checkpoints from ``colibri.testing.tiny`` (16 experts top-4, a shared expert, one CSA, one HCA and one
sliding-window layer, the first layer hash-routed with a randomized ``tid2eid``, randomized selection bias, sinks,
position biases and hyper-connection maps). Compression rates are shrunk (CSA 4, HCA 8) and the sliding window is
8 tokens, so a 40-token prompt plus 32 generated tokens crosses many windows of every kind; ``index_topk`` 4 keeps
the lightning indexer selective (8 indexer heads: with 2, keys often score exactly 0 on every head and
transformers' top-k breaks those ties in an unspecified order). Tokens and prompt logits must match transformers
at expert-cache capacity 1, 2 and all.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from colibri.builder import build  # noqa: E402
from colibri.engine import Engine  # noqa: E402
from colibri.errors import ConfigError  # noqa: E402
from colibri.model import read_config  # noqa: E402
from colibri.records import ResolvedModel  # noqa: E402
from colibri.testing.tiny import tiny_model  # noqa: E402

from colibri_deepseek_v4.plugin import ENGINES, engine_hparams, tensor_layout  # noqa: E402
from colibri.testing.parity import check_every_cache_size, GREEDY_TOKENS, LOGIT_TOL, PROMPT_TOKENS, pick_prompt  # noqa: E402

RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}
BASE = dict(compress_rates=RATES, index_n_heads=8)

CASES = {
    "sparse": dict(BASE),
    # bf16 weights (hyper-connections, sinks, norms, position biases stay f32, as transformers keeps them);
    # transformers runs f32 on the same bf16 values, so the f32 tolerance holds
    "sparse_bf16": dict(BASE, dtype="bfloat16"),
    # index_topk above every entry count: the indexer keeps everything (the HCA-like path of a CSA layer)
    "dense_index": dict(BASE, index_topk=64),
    # head_dim 32 x 0.15625 = 5 rotary dims: transformers rotates the trailing 2 * ceil(5 / 2) = 6, frequencies
    # over 5
    "odd_rotary": dict(BASE, partial_rotary_factor=0.15625),
    # the released layout: YaRN on the compressed layers' RoPE, two hash layers, a wider window
    "yarn_two_hash": dict(BASE, num_hidden_layers=4, sliding_window=12,
                          mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
                          layer_types=["heavily_compressed_attention", "compressed_sparse_attention",
                                       "sliding_attention", "compressed_sparse_attention"],
                          rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                           "original_max_position_embeddings": 16, "beta_fast": 32,
                                           "beta_slow": 1}),
}


@pytest.fixture(scope="session")
def engine_binary() -> Path:
    return build(ENGINES["deepseek_v4"])   # its own composition, not the family's main engine


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("deepseek-v4-models")


def resolved(path: Path) -> ResolvedModel:
    cfg = read_config(path)
    return ResolvedModel(path, "deepseek-v4", cfg["model_type"], cfg)


def start(binary: Path, model_dir: Path, *, ctx: int = 128, cap: int = 0) -> Engine:
    argv = [str(binary), "--model", str(model_dir), "--ctx", str(ctx), "--slots", "1", "--cap", str(cap),
            "--threads", "2", *engine_hparams(resolved(model_dir))]
    return Engine(argv)


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_transformers_at_every_cache_size(engine_binary, tiny_root, case):
    built = tiny_model("deepseek_v4", tiny_root, seed=0, **CASES[case])
    cfg = read_config(built.path)
    assert cfg["n_routed_experts"] >= 16 and cfg["num_experts_per_tok"] == 4
    reference = transformers.AutoModelForCausalLM.from_pretrained(built.path, dtype=torch.float32).eval()
    tid2eid = reference.model.layers[0].mlp.gate.tid2eid
    assert tid2eid.unique().numel() == cfg["n_routed_experts"], "the hash table must be randomized"
    prompt, ref_logits, ref_tokens = pick_prompt(reference)
    check_every_cache_size(lambda cap: start(engine_binary, built.path, cap=cap), prompt, ref_logits, ref_tokens,
                           moe_layers=cfg["num_hidden_layers"], experts=cfg["n_routed_experts"])


def test_indexer_selection_is_active(engine_binary, tiny_root):
    """Same weights, index_topk 4 vs 64: rows that see <= 4 CSA entries are bit-identical, later ones differ."""
    dense = tiny_model("deepseek_v4", tiny_root, seed=0, **CASES["dense_index"])
    sparse = tiny_model("deepseek_v4", tiny_root, seed=0, **CASES["sparse"])
    rng = random.Random(0)
    prompt = [rng.randrange(2, 512) for _ in range(PROMPT_TOKENS)]
    with start(engine_binary, dense.path) as engine:
        a = torch.tensor(engine.generate(prompt, max_tokens=1, logits=True).logits)
    with start(engine_binary, sparse.path) as engine:
        b = torch.tensor(engine.generate(prompt, max_tokens=1, logits=True).logits)
    first_sparse = 5 * RATES["compressed_sparse_attention"] - 1   # the first row with 5 closed CSA windows
    assert torch.equal(a[:first_sparse], b[:first_sparse])
    assert (a[first_sparse:] - b[first_sparse:]).abs().amax(dim=-1).min().item() > 100 * LOGIT_TOL


def test_prefix_reuse_resumes_mid_window(engine_binary, tiny_root):
    """A follow-up turn reuses the slot's rows and prefills from a position inside a CSA and an HCA window (43:
    43 % 4 = 3, 43 % 8 = 3); the compressed entries it closes must equal a fresh run's, bit for bit."""
    built = tiny_model("deepseek_v4", tiny_root, seed=0, **CASES["sparse"])
    rng = random.Random(1)
    prompt = [rng.randrange(2, 512) for _ in range(36)]
    with start(engine_binary, built.path) as engine:
        first = engine.generate(prompt, max_tokens=8).tokens
        follow = prompt + first[:7] + [77, 78, 79, 80, 81]
        r = engine.generate(follow, max_tokens=6, logits=True)
        assert r.accept["reused_tokens"] == len(prompt) + 7
    with start(engine_binary, built.path) as engine:
        fresh = engine.generate(follow, max_tokens=6, logits=True)
    assert r.tokens == fresh.tokens
    assert r.logits == fresh.logits[len(prompt) + 7:]


def test_unsupported_v4_configs_are_refused(tiny_root):
    model = resolved(tiny_model("deepseek_v4", tiny_root, seed=0, **BASE).path)
    for change, match in ((dict(scoring_func="softmax"), "scoring_func"),
                          (dict(num_key_value_heads=2), "num_key_value_heads"),
                          (dict(rope_parameters={"main": {"rope_theta": 1e4, "rope_type": "default"},
                                                 "compress": {"rope_theta": 1e5, "rope_type": "dynamic"}}),
                           "dynamic")):
        cfg = dict(model.config, **change)
        with pytest.raises(ConfigError, match=match):
            engine_hparams(ResolvedModel(model.path, "deepseek-v4", model.model_type, cfg))


# ---- the released formats: fp4 routed experts, fp8 dense projections, DeepSeek's own tensor names ----------

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_GROUP = 32
FP8_BLOCK = 128
# Dense projections the release stores in e4m3 (transformers keeps the compressor / indexer kv and gate
# projections and the indexer's weights_proj in bf16 without scales, and so do we).
FP8_DENSE = (".attn.wq_a.weight", ".attn.wq_b.weight", ".attn.wkv.weight", ".attn.wo_a.weight",
             ".attn.wo_b.weight", ".attn.indexer.wq_b.weight", ".shared_experts.w1.weight",
             ".shared_experts.w2.weight", ".shared_experts.w3.weight")
QUANT_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "activation_scheme": "dynamic",
                "weight_block_size": [FP8_BLOCK, FP8_BLOCK], "expert_dtype": "fp4"}


def pow2_at_least(x):
    """The smallest power of two >= x (a ue8m0 scale), elementwise; 1 where x is 0."""
    return torch.where(x > 0, torch.exp2(torch.ceil(torch.log2(x))), torch.ones_like(x))


def quantize_fp4(w):
    """[rows, cols] -> (packed I8 [rows, cols / 2] low nibble first, ue8m0 scales [rows, cols / 32], dequantized)."""
    rows, cols = w.shape
    groups = w.reshape(rows, cols // FP4_GROUP, FP4_GROUP)
    scale = pow2_at_least(groups.abs().amax(-1) / 6.0)
    q = groups / scale[..., None]
    mags = torch.tensor(E2M1)
    code = (q.abs()[..., None] - mags).abs().argmin(-1) | torch.where(q < 0, 8, 0)
    code = code.reshape(rows, cols).to(torch.uint8)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).view(torch.int8)
    # the reference decodes the stored bytes, not the codes above
    u8 = packed.view(torch.uint8)
    table = torch.tensor(E2M1 + tuple(-v for v in E2M1))
    values = torch.stack([table[(u8 & 15).long()], table[(u8 >> 4).long()]], -1).reshape(rows, cols)
    scale_bytes = (torch.log2(scale) + 127).to(torch.uint8)
    deq = values * torch.exp2(scale_bytes.float() - 127).repeat_interleave(FP4_GROUP, 1)
    return packed, scale_bytes.view(torch.float8_e8m0fnu), deq


def quantize_fp8(w):
    """[rows, cols] -> (e4m3 weight, ue8m0 scales [ceil(rows/128), ceil(cols/128)], dequantized)."""
    rows, cols = w.shape
    br, bc = -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)
    padded = torch.zeros(br * FP8_BLOCK, bc * FP8_BLOCK)
    padded[:rows, :cols] = w
    blocks = padded.reshape(br, FP8_BLOCK, bc, FP8_BLOCK)
    scale = pow2_at_least(blocks.abs().amax(dim=(1, 3)) / 448.0)
    expanded = scale.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)[:rows, :cols]
    q = (w / expanded).to(torch.float8_e4m3fn)
    scale_bytes = (torch.log2(scale) + 127).to(torch.uint8)
    deq = q.float() * torch.exp2(scale_bytes.float() - 127).repeat_interleave(FP8_BLOCK, 0).repeat_interleave(
        FP8_BLOCK, 1)[:rows, :cols]
    return q, scale_bytes.view(torch.float8_e8m0fnu), deq


def deepseek_name(name: str) -> str:
    """transformers' save name -> the name DeepSeek's release uses (its reference inference code's)."""
    top = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
           "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
           "model.hc_head.hc_scale": "hc_head_scale"}
    return top.get(name, name.removeprefix("model."))


def write_released_pair(src: Path, quantized_dir: Path, reference_dir: Path, f4_dtype: bool = False) -> None:
    """From a tiny f32 checkpoint: the released layout (DeepSeek names, fp4 experts with `.scale`, fp8 dense
    with `.scale`) in quantized_dir, and transformers' layout of the same bytes dequantized in reference_dir.
    f4_dtype stores the packed experts as safetensors F4 (float4_e2m1fn_x2, logical shape) instead of I8."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    tensors = load_file(str(src / "model.safetensors"))
    released, reference = {}, {}
    for name, t in tensors.items():
        out = deepseek_name(name)
        if ".ffn.experts." in name:
            packed, scales, deq = quantize_fp4(t.float())
            if f4_dtype:
                packed = packed.view(torch.uint8).view(torch.float4_e2m1fn_x2)
        elif name.endswith(FP8_DENSE):
            packed, scales, deq = quantize_fp8(t.float())
        else:
            released[out], reference[name] = t, t
            continue
        released[out], released[out.removesuffix(".weight") + ".scale"] = packed, scales
        reference[name] = deq.to(t.dtype)
    for d, data in ((quantized_dir, released), (reference_dir, reference)):
        d.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.name != "model.safetensors":
                shutil.copy(f, d / f.name)
        save_file(data, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = QUANT_CONFIG
    (quantized_dir / "config.json").write_text(json.dumps(cfg, indent=2))


def test_fp4_experts_and_fp8_dense_match_the_dequantized_reference(engine_binary, tiny_root):
    """DeepSeek-V4's release formats read natively: fp4 experts (e2m1 nibbles + per-32 ue8m0 scales), fp8 dense
    projections (e4m3 + 128x128 ue8m0 scales), DeepSeek's tensor names; against transformers running the same
    bytes dequantized in Python."""
    built = tiny_model("deepseek_v4", tiny_root, seed=0, **CASES["sparse"])
    quantized, reference_dir = tiny_root / "v4-released", tiny_root / "v4-released-reference"
    write_released_pair(built.path, quantized, reference_dir)
    layout = tensor_layout(resolved(quantized))   # what `coli info` / `plan` count: the release's own names
    assert layout.embeddings[0] == "embed.weight" and "hc_head_fn" in layout.required
    assert layout.experts[0].tensors == tuple(f"layers.0.ffn.experts.0.{w}.{t}" for t in ("weight", "scale")
                                              for w in ("w1", "w3", "w2"))
    reference = transformers.AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32).eval()
    f32 = transformers.AutoModelForCausalLM.from_pretrained(built.path, dtype=torch.float32).eval()
    from colibri.inventory import load_facts, take_inventory

    facts = load_facts(resolved(quantized))     # `coli info`: fp4 experts packed in I8 count two values per byte
    assert take_inventory(facts.geometry, facts.layout, facts.tensors).total_params == reference.num_parameters()
    prompt, ref_logits, ref_tokens = pick_prompt(reference)
    with torch.no_grad():
        lossy = (f32(torch.tensor([prompt])).logits[0] - ref_logits).abs().max().item()
    assert lossy > 100 * LOGIT_TOL, "the quantization must actually change the model"
    for cap in (1, 0):
        with start(engine_binary, quantized, cap=cap) as engine:
            result = engine.generate(prompt, max_tokens=GREEDY_TOKENS, logits=True)
        diff = (torch.tensor(result.logits) - ref_logits).abs().max().item()
        assert diff < LOGIT_TOL, f"cap {cap}: prompt logits differ from the dequantized reference by {diff}"
        assert result.tokens == ref_tokens, f"cap {cap}: greedy tokens differ from the dequantized reference"
    # the same bytes as safetensors F4 (two values per byte, the shape counting values): the same logits, bit for bit
    f4_dir = tiny_root / "v4-released-f4"
    write_released_pair(built.path, f4_dir, tiny_root / "v4-released-f4-reference", f4_dtype=True)
    with start(engine_binary, f4_dir) as engine:
        assert engine.generate(prompt, max_tokens=1, logits=True).logits == result.logits


def test_coli_launch_runs_v4_on_its_own_binary(tiny_root):
    """What `coli run` does: the model's own composition (engine_source(model)) is built and launched, and its
    greedy tokens are transformers'."""
    from colibri import launch
    from colibri.model import resolve_model

    built = tiny_model("deepseek_v4", tiny_root, seed=0)
    spec = launch.prepare(resolve_model(built.path), ctx=128, threads=2)
    assert Path(spec.argv[0]).name == "colibri-deepseek-v4"
    reference = transformers.AutoModelForCausalLM.from_pretrained(built.path, dtype=torch.float32).eval()
    prompt, _, ref_tokens = pick_prompt(reference, n=8)
    with launch.start(spec) as engine:
        assert engine.generate(prompt, max_tokens=8).tokens == ref_tokens
