"""Tiny random-weight checkpoints, built with transformers/diffusers at test time.

Nothing here is downloaded: every checkpoint is created from a config, its weights are re-drawn from a seed at
O(1) scale (HF's 0.02 init makes routing near-uniform, which hides routing bugs), and it is saved with the
library's own ``save_pretrained`` so tensor names and config.json spellings are exactly what real checkpoints
of that architecture use. Text models also get a small *real* byte-level BPE tokenizer trained offline, with a
chat template in the family's style.

API (stable; other packages' tests build on it)::

    from colibri.testing.tiny import tiny_model, build_text_model, KINDS

    built = tiny_model("qwen3_moe", tmp_root, seed=0, dtype="float32", num_experts=32, top_k=8)
    built.path                 # Path of the checkpoint directory
    built.num_parameters       # transformers' ``model.num_parameters()`` (diffusers: sum over components)
    built.num_stored_elements  # elements in the safetensors files (parameters + persistent buffers such as
                               # ``e_score_correction_bias`` and ``tid2eid``); what a header count reports
    built.kind, built.model_type

``tiny_model(kind, tmp_root, **options)`` memoises by its arguments (in-process, and across processes through a
sidecar ``<dir>.json`` written after a complete build), so a session fixture that passes the same ``tmp_root``
builds each variant once. ``KINDS`` lists every kind:

* text kinds (``TEXT_KINDS``): ``olmoe``, ``qwen2_moe``, ``qwen3_moe``, ``qwen3_next``, ``qwen3_5_moe_text``,
  ``qwen3_5_moe`` (multimodal wrapper with a one-block vision tower; LM under ``model.language_model.``),
  ``deepseek_v3``, ``deepseek_v32``, ``deepseek_v4``, ``kimi_linear``, ``kimi_k2`` (a deepseek_v3 model whose
  config.json says ``model_type: kimi_k2``, as real Kimi K2 checkpoints do), ``glm4_moe``, ``glm4_moe_lite``,
  ``glm_moe_dsa``;
* ``diffusers``: a Stable-Diffusion-style pipeline directory (``model_index.json``; ``unet/``, ``vae/``,
  ``text_encoder/`` safetensors; ``scheduler/``, ``tokenizer/``);
* ``extractor``: a GLiNER2-style decision checkpoint (``config.json`` with ``model_type: extractor`` and an
  ``encoder_config``; ``model.safetensors`` holding ``encoder.*`` plus span/classifier head tensors);
  ``encoder="bert"`` (default) or ``"deberta-v2"``.

Options: ``seed`` (weights only; the tokenizer is fixed), ``dtype`` (``"float32"`` default, or ``"bfloat16"``:
router/bias tensors transformers keeps in f32 stay f32), and geometry overrides merged into the config. Text kinds
also take ``chat_template_in="tokenizer_config"`` (default) or ``"jinja"`` (a separate ``chat_template.jinja``).
Generic override names are translated to the family's own field: ``num_experts``, ``top_k``, ``num_kv_heads``,
``num_layers``, ``n_group``; any other key is passed to the config as is (e.g. ``norm_topk_prob``,
``tie_word_embeddings``, ``first_k_dense_replace``, ``index_topk``). Per-layer lists (``layer_types``,
``mlp_layer_types``) are regenerated for an overridden layer count unless given explicitly.

Tiny geometry: vocab 512, hidden 64, 4 heads, 16 experts top-4 (expert width 32), n_group 4 / topk_group 2
where the family groups, one leading dense layer where the family has them, 4 layers (3 linear + 1 full) for
hybrids. ``generation_config.json`` has ``eos_token_id: null`` and ``do_sample: false`` so ``generate`` runs the
full length for comparisons; the stop token is in config.json (``eos_token_id``) and tokenizer_config.json.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import shutil
import sysconfig
import tempfile
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

VOCAB = 512
HIDDEN = 64

TEXT_KINDS: tuple[str, ...] = (
    "olmoe", "qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe_text", "qwen3_5_moe",
    "deepseek_v3", "deepseek_v32", "deepseek_v4", "kimi_linear", "kimi_k2",
    "glm4_moe", "glm4_moe_lite", "glm_moe_dsa",
)
KINDS: tuple[str, ...] = TEXT_KINDS + ("diffusers", "extractor")


@dataclass(frozen=True)
class TinyModel:
    """A built checkpoint directory and its sizes."""

    path: Path
    kind: str
    model_type: str
    num_parameters: int
    num_stored_elements: int


# ---------------------------------------------------------------------------------------------------------------
# Tiny configs. Each function takes the layer count and returns the family's own config fields.

def _layers_hybrid(n: int) -> list[str]:
    # Qwen3-Next / Qwen3.5 / Kimi Linear put one full-attention layer after every three linear ones.
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]


def _mla(q_lora_rank: int | None = 48) -> dict[str, Any]:
    return dict(kv_lora_rank=32, q_lora_rank=q_lora_rank, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)


def _olmoe(n: int) -> dict[str, Any]:
    return dict(num_hidden_layers=n, num_attention_heads=4, num_key_value_heads=4, intermediate_size=32,
                num_experts=16, num_experts_per_tok=4, norm_topk_prob=False)


def _qwen2_moe(n: int) -> dict[str, Any]:
    return dict(num_hidden_layers=n, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=16,
                num_experts_per_tok=4, norm_topk_prob=False, layer_types=["full_attention"] * n)


def _qwen3_moe(n: int) -> dict[str, Any]:
    # head_dim * heads != hidden on purpose, as in Qwen3-30B-A3B (32 x 128 over a 2048 residual).
    return dict(num_hidden_layers=n, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                intermediate_size=128, moe_intermediate_size=32, num_experts=16, num_experts_per_tok=4,
                norm_topk_prob=True)


def _qwen3_next(n: int) -> dict[str, Any]:
    return dict(num_hidden_layers=n, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=16,
                num_experts_per_tok=4, norm_topk_prob=True, layer_types=_layers_hybrid(n))


def _qwen3_5_moe_text(n: int) -> dict[str, Any]:
    cfg = _qwen3_next(n)
    for key in ("intermediate_size", "norm_topk_prob"):
        cfg.pop(key)
    return cfg


def _deepseek_v3(n: int) -> dict[str, Any]:
    return dict(num_hidden_layers=n, num_attention_heads=4, num_key_value_heads=4, intermediate_size=128,
                moe_intermediate_size=32, n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1,
                n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                **_mla())


def _deepseek_v32(n: int) -> dict[str, Any]:
    cfg = _deepseek_v3(n)
    cfg.update(index_topk=4, index_head_dim=16, index_n_heads=2,
               mlp_layer_types=["dense" if i < 1 else "sparse" for i in range(n)])
    return cfg


def _deepseek_v4(n: int) -> dict[str, Any]:
    return dict(num_hidden_layers=n, num_attention_heads=4, num_key_value_heads=1, head_dim=32, q_lora_rank=48,
                moe_intermediate_size=32, n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1,
                o_groups=2, o_lora_rank=32, index_n_heads=2, index_head_dim=16, index_topk=4, sliding_window=8,
                partial_rotary_factor=0.25, hc_mult=4, hc_sinkhorn_iters=4,
                layer_types=[_V4_ATTENTION[i % 3] for i in range(n)],
                mlp_layer_types=["hash_moe" if i < 1 else "moe" for i in range(n)])


# One layer of each DeepSeek-V4 attention kind, so every tensor set appears in a three-layer model.
_V4_ATTENTION = ("compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention")


def _kimi_linear(n: int) -> dict[str, Any]:
    return dict(num_hidden_layers=n, num_attention_heads=4, num_key_value_heads=4, intermediate_size=128,
                moe_intermediate_size=32, num_experts=16, num_experts_per_token=4, num_shared_experts=1,
                num_expert_group=4, topk_group=2, moe_renormalize=True, routed_scaling_factor=2.5,
                linear_head_dim=16, linear_num_heads=4, linear_conv_kernel_dim=4, model_max_length=4096,
                layer_types=_layers_hybrid(n), mlp_layer_types=["dense" if i < 1 else "sparse" for i in range(n)],
                **_mla(q_lora_rank=None))


def _glm4_moe(n: int) -> dict[str, Any]:
    return dict(num_hidden_layers=n, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                intermediate_size=128, moe_intermediate_size=32, n_routed_experts=16, num_experts_per_tok=4,
                n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
                norm_topk_prob=True, use_qk_norm=True, attention_bias=True)


def _glm4_moe_lite(n: int) -> dict[str, Any]:
    cfg = _deepseek_v3(n)
    cfg.pop("first_k_dense_replace")
    cfg["mlp_layer_types"] = ["dense" if i < 1 else "sparse" for i in range(n)]
    return cfg


def _glm_moe_dsa(n: int) -> dict[str, Any]:
    cfg = _deepseek_v32(n)
    cfg["indexer_types"] = ["full"] * n
    return cfg


@dataclass(frozen=True)
class _Spec:
    model_type: str            # what transformers builds
    layers: int
    fields: Callable[[int], dict[str, Any]]
    style: str                 # tokenizer / chat-template style
    # Per-layer lists (layer_types, mlp_layer_types, ...) come from ``fields(n)``, so a layer-count override
    # regenerates them.


_SPECS: dict[str, _Spec] = {
    "olmoe": _Spec("olmoe", 2, _olmoe, "olmoe"),
    "qwen2_moe": _Spec("qwen2_moe", 2, _qwen2_moe, "qwen"),
    "qwen3_moe": _Spec("qwen3_moe", 2, _qwen3_moe, "qwen"),
    "qwen3_next": _Spec("qwen3_next", 4, _qwen3_next, "qwen"),
    "qwen3_5_moe_text": _Spec("qwen3_5_moe_text", 4, _qwen3_5_moe_text, "qwen"),
    "qwen3_5_moe": _Spec("qwen3_5_moe", 4, _qwen3_5_moe_text, "qwen"),
    "deepseek_v3": _Spec("deepseek_v3", 3, _deepseek_v3, "deepseek"),
    "deepseek_v32": _Spec("deepseek_v32", 3, _deepseek_v32, "deepseek"),
    "deepseek_v4": _Spec("deepseek_v4", 3, _deepseek_v4, "deepseek"),
    "kimi_linear": _Spec("kimi_linear", 4, _kimi_linear, "kimi"),
    "kimi_k2": _Spec("deepseek_v3", 3, _deepseek_v3, "kimi"),
    "glm4_moe": _Spec("glm4_moe", 3, _glm4_moe, "glm"),
    "glm4_moe_lite": _Spec("glm4_moe_lite", 3, _glm4_moe_lite, "glm"),
    "glm_moe_dsa": _Spec("glm_moe_dsa", 3, _glm_moe_dsa, "glm"),
}

# Generic override names -> the field each family's config spells them with (first one the config has).
_ALIASES: dict[str, tuple[str, ...]] = {
    "num_experts": ("n_routed_experts", "num_experts", "num_local_experts"),
    "top_k": ("num_experts_per_tok", "num_experts_per_token"),
    "num_kv_heads": ("num_key_value_heads",),
    "num_layers": ("num_hidden_layers",),
    "n_group": ("n_group", "num_expert_group"),
}


def _tiny_fields(kind: str, overrides: dict[str, Any]) -> dict[str, Any]:
    spec = _SPECS[kind]
    overrides = dict(overrides)
    n = int(overrides.pop("num_layers", overrides.pop("num_hidden_layers", spec.layers)))
    fields = {"vocab_size": VOCAB, "hidden_size": HIDDEN, **spec.fields(n)}
    if kind != "kimi_linear":
        fields.setdefault("max_position_embeddings", 4096)
    for key, value in overrides.items():
        targets = _ALIASES.get(key, (key,))
        target = next((t for t in targets if t in fields), targets[0])
        fields[target] = value
    return fields


# ---------------------------------------------------------------------------------------------------------------
# Weights

# Tensors whose trailing name marks an additive parameter (drawn like a bias whatever its shape).
_BIAS_LIKE = ("A_log", "dt_bias", "attn_sink", "sinks", "_base", "_scale")
_CORRECTION_BIAS_STD = 0.25  # large enough that the selection bias changes which experts win


def redraw_weights(model: Any, seed: int, num_experts: int | None = None, salt: str = "") -> None:
    """Re-draw every stored tensor of ``model`` at O(1) scale from ``seed`` (order-independent per name).

    ``salt`` (the kind) keeps two kinds with one architecture from getting identical weights.
    Matrices N(0, 1/fan_in); norm weights 1 + 0.1·N; biases and bias-like tensors 0.1·N;
    ``e_score_correction_bias`` 0.25·N; integer ``tid2eid`` tables uniform over ``num_experts``.
    """
    import torch

    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            digest = hashlib.sha256(f"{seed}:{salt}:{name}".encode()).digest()
            gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
            if not tensor.is_floating_point():
                if name.endswith("tid2eid"):
                    if not num_experts:
                        raise ValueError(f"{name}: redraw needs num_experts for the hash-routing table")
                    tensor.copy_(_distinct_experts(tensor.shape, num_experts, gen))
                continue
            shape = tuple(tensor.shape)
            noise = torch.randn(shape, generator=gen, dtype=torch.float32)
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("e_score_correction_bias"):
                value = _CORRECTION_BIAS_STD * noise
            elif leaf == "bias" or any(name.endswith(s) for s in _BIAS_LIKE):
                value = 0.1 * noise
            elif len(shape) == 1 and "norm" in name.lower():
                value = 1.0 + 0.1 * noise
            elif len(shape) >= 2:
                value = noise / math.sqrt(math.prod(shape[1:]))
            else:
                value = 0.1 * noise
            tensor.copy_(value.to(tensor.dtype))


def _distinct_experts(shape: tuple[int, ...], num_experts: int, gen: Any) -> Any:
    """A token -> top_k table of distinct experts per token (hash routing never picks one expert twice)."""
    import torch

    rows, k = shape
    return torch.stack([torch.randperm(num_experts, generator=gen)[:k] for _ in range(rows)]).to(torch.long)


def _cast(model: Any, dtype: str) -> None:
    import torch

    if dtype in ("float32", "f32", "fp32"):
        return
    if dtype not in ("bfloat16", "bf16"):
        raise ValueError(f"dtype {dtype!r}: use 'float32' or 'bfloat16'")
    keep = tuple(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    model.to(torch.bfloat16)
    for name, param in list(model.named_parameters()) + list(model.named_buffers()):
        if param.is_floating_point() and any(k in name for k in keep):
            param.data = param.data.float()


def _stored_elements(directory: Path) -> int:
    from safetensors import safe_open

    total = 0
    for file in sorted(directory.rglob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            for key in handle.keys():
                total += math.prod(handle.get_slice(key).get_shape())
    return total


# ---------------------------------------------------------------------------------------------------------------
# Tokenizer

_CORPUS_PARAGRAPH = """\
Colibri runs mixture-of-experts language models on machines whose memory is smaller than the model. Dense
weights stay resident; routed experts are read from disk when the router picks them and kept in a bounded cache.
Placement may change speed, never the tokens. The quick brown fox jumps over the lazy dog; pack my box with five
dozen liquor jugs. 0123456789 + - * / = < > ( ) [ ] { } : ; , . ! ? ' " # @ $ % ^ & _ ~ `
"""

_STDLIB_SOURCES = ("textwrap.py", "string.py", "json/decoder.py", "this.py")


def _training_text() -> list[str]:
    """A fixed offline corpus: one embedded paragraph plus a few stdlib source files read from disk."""
    texts = [_CORPUS_PARAGRAPH] * 4
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for rel in _STDLIB_SOURCES:
        path = stdlib / rel
        if path.is_file():
            texts.append(path.read_text(encoding="utf-8", errors="replace"))
    return texts


@dataclass(frozen=True)
class _Style:
    specials: tuple[str, ...]
    bos: str | None
    eos: str
    pad: str
    template: str


_STYLES: dict[str, _Style] = {
    # Tulu-style turns ended by the GPT-NeoX end-of-text token, as OLMoE-Instruct does.
    "olmoe": _Style(
        ("<|endoftext|>", "<|padding|>", "<|system|>", "<|user|>", "<|assistant|>"),
        "<|endoftext|>", "<|endoftext|>", "<|padding|>",
        "{{ bos_token }}{% for m in messages %}"
        "{% if m['role'] == 'assistant' %}{{ '<|assistant|>\\n' + m['content'] + eos_token + '\\n' }}"
        "{% else %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"),
    # ChatML.
    "qwen": _Style(
        ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        None, "<|im_end|>", "<|endoftext|>",
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"),
    "deepseek": _Style(
        ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"),
        "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}"
        "{% elif m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}"
        "{% else %}{{ '<｜Assistant｜>' + m['content'] + eos_token }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"),
    "kimi": _Style(
        ("[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
         "[PAD]"),
        "[BOS]", "<|im_end|>", "[PAD]",
        "{% for m in messages %}{{ '<|im_' + m['role'] + '|>' + m['role'] + '<|im_middle|>' + m['content'] + "
        "'<|im_end|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_assistant|>assistant<|im_middle|>' }}{% endif %}"),
    "glm": _Style(
        ("<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"),
        None, "<|endoftext|>", "<|endoftext|>",
        "[gMASK]<sop>{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"),
}


def train_tokenizer(out_dir: Path, style: str, vocab_size: int = VOCAB, max_length: int = 4096,
                    chat_template_in: str = "tokenizer_config") -> dict[str, int | None]:
    """Train a byte-level BPE on the fixed offline corpus and save it in HF layout.

    Writes ``tokenizer.json`` and ``tokenizer_config.json`` (with the style's ``chat_template`` when
    ``chat_template_in`` is ``"tokenizer_config"``, or a separate ``chat_template.jinja`` when ``"jinja"``).
    Returns the special-token ids: ``{"bos": ..., "eos": ..., "pad": ...}``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    spec = _STYLES[style]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(spec.specials), min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_training_text(), trainer=trainer)
    tok.add_special_tokens(list(spec.specials))
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": spec.bos, "eos_token": spec.eos, "pad_token": spec.pad, "unk_token": None,
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
    }
    if chat_template_in == "tokenizer_config":
        config["chat_template"] = spec.template
    elif chat_template_in == "jinja":
        (out_dir / "chat_template.jinja").write_text(spec.template, encoding="utf-8")
    else:
        raise ValueError(f"chat_template_in {chat_template_in!r}: use 'tokenizer_config' or 'jinja'")
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                   encoding="utf-8")
    ids = {key: (tok.token_to_id(t) if t else None) for key, t in (("bos", spec.bos), ("eos", spec.eos),
                                                                    ("pad", spec.pad))}
    return ids


# ---------------------------------------------------------------------------------------------------------------
# Builders

def build_text_model(kind: str, out_dir: str | os.PathLike, *, seed: int = 0, dtype: str = "float32",
                     chat_template_in: str = "tokenizer_config", **overrides: Any) -> TinyModel:
    """Build one tiny causal LM of ``kind`` (see ``TEXT_KINDS``) into ``out_dir`` (created; must not exist)."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    if kind not in _SPECS:
        raise ValueError(f"unknown tiny text kind {kind!r}; choose from {', '.join(TEXT_KINDS)}")
    spec = _SPECS[kind]
    out = Path(out_dir)
    fields = _tiny_fields(kind, overrides)
    max_length = int(fields.get("max_position_embeddings") or fields.get("model_max_length") or 4096)
    ids = train_tokenizer(out, spec.style, VOCAB, max_length, chat_template_in)
    token_ids = {"bos_token_id": ids["bos"], "eos_token_id": ids["eos"], "pad_token_id": ids["pad"]}

    torch.manual_seed(seed)
    if spec.model_type == "qwen3_5_moe":
        config = AutoConfig.for_model(
            "qwen3_5_moe", text_config={**fields, **token_ids}, tie_word_embeddings=fields.get(
                "tie_word_embeddings", False),
            vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                               out_hidden_size=HIDDEN, num_position_embeddings=16))
        model = transformers.AutoModelForImageTextToText.from_config(config)
    else:
        config = AutoConfig.for_model(spec.model_type, **fields, **token_ids)
        model = AutoModelForCausalLM.from_config(config)
    num_experts = fields.get("n_routed_experts") or fields.get("num_experts")
    redraw_weights(model, seed, num_experts, salt=kind)
    _cast(model, dtype)
    model.generation_config = GenerationConfig(bos_token_id=ids["bos"], eos_token_id=None,
                                               pad_token_id=ids["pad"], do_sample=False)
    model.save_pretrained(str(out), safe_serialization=True)
    if kind == "kimi_k2":
        # Real Kimi K2 checkpoints are DeepSeek-V3 architecture under their own model_type.
        path = out / "config.json"
        data = json.loads(path.read_text(encoding="utf-8"))
        data["model_type"] = "kimi_k2"
        _write_json(path, data)
    model_type = json.loads((out / "config.json").read_text(encoding="utf-8"))["model_type"]
    return TinyModel(out, kind, model_type, int(model.num_parameters()), _stored_elements(out))


def build_diffusers_pipeline(out_dir: str | os.PathLike, *, seed: int = 0, dtype: str = "float32",
                             **overrides: Any) -> TinyModel:
    """A tiny Stable-Diffusion-style pipeline (UNet2DCondition + AutoencoderKL + CLIP text encoder + DDIM).

    ``overrides`` go to the UNet config (e.g. ``block_out_channels=(32, 64)``). ``num_parameters`` is the sum over
    the components' parameters.
    """
    import torch
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    out = Path(out_dir)
    torch.manual_seed(seed)
    unet_cfg: dict[str, Any] = dict(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8)
    unet_cfg.update(overrides)
    unet = UNet2DConditionModel(**unet_cfg)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(16, 32), latent_channels=4,
                        norm_num_groups=8, layers_per_block=1, sample_size=16)
    text_encoder = CLIPTextModel(CLIPTextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=1, num_attention_heads=2,
                                                max_position_embeddings=32, projection_dim=32,
                                                bos_token_id=0, eos_token_id=1, pad_token_id=1))
    tok_dir = Path(tempfile.mkdtemp(prefix="colibri-clip-tok-"))
    try:
        tokenizer = _clip_tokenizer(tok_dir, CLIPTokenizer)
        components = {"unet": unet, "vae": vae, "text_encoder": text_encoder}
        for comp in components.values():
            redraw_weights(comp, seed)
            _cast(comp, dtype)
        pipe = StableDiffusionPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
                                       scheduler=DDIMScheduler(num_train_timesteps=1000, steps_offset=1,
                                                                          clip_sample=False), safety_checker=None,
                                       feature_extractor=None, requires_safety_checker=False)
        pipe.save_pretrained(str(out), safe_serialization=True)
    finally:
        shutil.rmtree(tok_dir, ignore_errors=True)
    total = sum(sum(p.numel() for p in c.parameters()) for c in components.values())
    return TinyModel(out, "diffusers", "diffusers", int(total), _stored_elements(out))


def _clip_tokenizer(tmp: Path, tokenizer_cls: Any) -> Any:
    """A CLIP tokenizer over a BPE trained on the offline corpus (vocab.json + merges.txt)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(end_of_word_suffix="</w>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|startoftext|>", "<|endoftext|>"],
                                  end_of_word_suffix="</w>", initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_training_text(), trainer=trainer)
    tok.model.save(str(tmp))
    merges = tmp / "merges.txt"
    lines = merges.read_text(encoding="utf-8").splitlines()
    if not lines or not lines[0].startswith("#version"):
        merges.write_text("#version: 0.2\n" + "\n".join(lines) + "\n", encoding="utf-8")
    return tokenizer_cls(vocab_file=str(tmp / "vocab.json"), merges_file=str(merges), model_max_length=32)


EXTRACTOR_HEADS: dict[str, tuple[str, ...]] = {
    # GLiNER2-style heads over the encoder's hidden states: a span representation (start/end projections fused by
    # an MLP), a classifier scoring each (span or [CLS], label) pair, and a count predictor for structures.
    "span_rep.project_start": ("0.weight", "0.bias", "3.weight", "3.bias"),
    "span_rep.project_end": ("0.weight", "0.bias", "3.weight", "3.bias"),
    "span_rep.out_project": ("0.weight", "0.bias", "3.weight", "3.bias"),
    "classifier": ("0.weight", "0.bias", "2.weight", "2.bias"),
    "count_pred": ("0.weight", "0.bias", "2.weight", "2.bias"),
}


def build_extractor(out_dir: str | os.PathLike, *, seed: int = 0, dtype: str = "float32",
                    **overrides: Any) -> TinyModel:
    """A GLiNER2-style decision checkpoint: tiny encoder (``encoder.*``) + span/classifier heads.

    ``encoder="bert"`` (default) or ``"deberta-v2"`` (what GLiNER2 ships) picks the encoder; other ``overrides`` go
    to the encoder config (e.g. ``num_hidden_layers=3``); ``max_width`` and ``max_count`` set the head geometry.
    ``num_parameters`` = encoder parameters + head parameters.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import BertConfig, BertModel, DebertaV2Config, DebertaV2Model

    out = Path(out_dir)
    encoder_kind = str(overrides.pop("encoder", "bert"))
    max_width = int(overrides.pop("max_width", 8))
    max_count = int(overrides.pop("max_count", 20))
    enc_fields: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=64, max_position_embeddings=128)
    torch.manual_seed(seed)
    if encoder_kind == "bert":
        enc_fields.update(type_vocab_size=2, **overrides)
        enc_config = BertConfig(**enc_fields)
        encoder = BertModel(enc_config, add_pooling_layer=False)
    elif encoder_kind == "deberta-v2":
        # deberta-v3-base style: relative attention, no absolute positions, no token types
        enc_fields.update(type_vocab_size=0, relative_attention=True, position_buckets=16, max_relative_positions=-1,
                          position_biased_input=False, pos_att_type=["p2c", "c2p"], norm_rel_ebd="layer_norm",
                          share_att_key=True, **overrides)
        enc_config = DebertaV2Config(**enc_fields)
        encoder = DebertaV2Model(enc_config)
    else:
        raise ValueError(f"encoder {encoder_kind!r}: use 'bert' or 'deberta-v2'")
    redraw_weights(encoder, seed, salt="extractor")
    h = enc_config.hidden_size
    head_shapes = {
        "span_rep.project_start": ((4 * h, h), (4 * h,), (h, 4 * h), (h,)),
        "span_rep.project_end": ((4 * h, h), (4 * h,), (h, 4 * h), (h,)),
        "span_rep.out_project": ((4 * h, 2 * h), (4 * h,), (h, 4 * h), (h,)),
        "classifier": ((2 * h, h), (2 * h,), (1, 2 * h), (1,)),
        "count_pred": ((2 * h, h), (2 * h,), (max_count, 2 * h), (max_count,)),
    }
    heads = torch.nn.ParameterDict()
    for module, leaves in EXTRACTOR_HEADS.items():
        for leaf, shape in zip(leaves, head_shapes[module]):
            heads[f"{module}.{leaf}".replace(".", "__")] = torch.nn.Parameter(torch.zeros(shape))
    redraw_weights(heads, seed, salt="extractor-heads")
    tensors: dict[str, Any] = {f"encoder.{k}": v for k, v in encoder.state_dict().items()}
    tensors.update({k.replace("__", "."): v.data for k, v in heads.items()})
    target = torch.bfloat16 if dtype in ("bfloat16", "bf16") else torch.float32
    tensors = {k: (v.detach().to(target) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    enc_dict = enc_config.to_dict()
    for key in ("transformers_version", "_name_or_path", "architectures"):
        enc_dict.pop(key, None)
    _write_json(out / "config.json", {
        "model_type": "extractor", "model_name": f"tiny-{encoder_kind}", "encoder_config": enc_dict,
        "max_width": max_width, "counting_layer": "count_lstm", "max_count": max_count,
        "hidden_size": h, "token_pooling": "first",
    })
    train_tokenizer(out, "olmoe", VOCAB, enc_fields["max_position_embeddings"])
    num = sum(p.numel() for p in encoder.parameters()) + sum(p.numel() for p in heads.parameters())
    return TinyModel(out, "extractor", "extractor", int(num), _stored_elements(out))


# ---------------------------------------------------------------------------------------------------------------
# Memoised entry point

_memo: dict[str, TinyModel] = {}
_lock = threading.Lock()


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def tiny_model(kind: str, tmp_root: str | os.PathLike, *, seed: int = 0, dtype: str = "float32",
               **overrides: Any) -> TinyModel:
    """Build (or reuse) the tiny checkpoint ``kind`` under ``tmp_root``; see the module docstring."""
    if kind not in KINDS:
        raise ValueError(f"unknown tiny model kind {kind!r}; choose from {', '.join(KINDS)}")
    key_data = json.dumps({"kind": kind, "seed": seed, "dtype": dtype, **overrides}, sort_keys=True, default=str)
    digest = hashlib.sha256(key_data.encode()).hexdigest()[:12]
    root = Path(tmp_root).resolve()
    out = root / f"{kind}-{digest}"
    sidecar = root / f"{kind}-{digest}.json"
    memo_key = f"{root}|{key_data}"
    with _lock:
        if memo_key in _memo and _memo[memo_key].path.is_dir():
            return _memo[memo_key]
        root.mkdir(parents=True, exist_ok=True)
        with _file_lock(root / f".{kind}-{digest}.lock"):   # parallel test processes build a variant once
            if sidecar.is_file() and out.is_dir():
                data = json.loads(sidecar.read_text(encoding="utf-8"))
                built = TinyModel(Path(data["path"]), data["kind"], data["model_type"], data["num_parameters"],
                                  data["num_stored_elements"])
            else:
                built = _build_into(kind, out, seed, dtype, overrides)
                record = asdict(built)
                record["path"] = str(out)
                _write_json(sidecar, record)
        _memo[memo_key] = built
        return built


def _build_into(kind: str, out: Path, seed: int, dtype: str, overrides: dict[str, Any]) -> TinyModel:
    """Build in a staging directory beside ``out`` and rename it into place, so ``out`` is always complete."""
    staging = Path(tempfile.mkdtemp(prefix=f".{kind}-", dir=out.parent))
    shutil.rmtree(staging)
    try:
        if kind == "diffusers":
            built = build_diffusers_pipeline(staging, seed=seed, dtype=dtype, **overrides)
        elif kind == "extractor":
            built = build_extractor(staging, seed=seed, dtype=dtype, **overrides)
        else:
            built = build_text_model(kind, staging, seed=seed, dtype=dtype, **overrides)
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return TinyModel(out, built.kind, built.model_type, built.num_parameters, built.num_stored_elements)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
