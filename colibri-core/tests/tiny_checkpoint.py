"""The tiny checkpoint core's own tests run on, written by core itself: numpy weights through
``colibri.safetensors_writer`` and a small BPE tokenizer through ``colibri.testing.tiny.train_tokenizer``.

No torch, no transformers, no family package: core's tests must not depend on what a family knows. The layout is
OLMoE's (what the in-test family of ``conftest.py`` describes): 2 layers, hidden 64, 4 heads, 16 experts top-4 of
width 32, vocab 512, untied LM head, f32.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from colibri.safetensors_writer import write_safetensors
from colibri.testing.tiny import ChatStyle, train_tokenizer

CONFIG = {
    "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 32, "num_experts": 16,
    "num_experts_per_tok": 4, "norm_topk_prob": False, "vocab_size": 512, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-05, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "tie_word_embeddings": False, "attention_bias": False, "clip_qkv": None, "dtype": "float32",
}
# Turns as "<|role|>\n text \n", the assistant's ended by end-of-text; ids 0 and 1 are end-of-text and padding.
STYLE = ChatStyle(("<|endoftext|>", "<|padding|>", "<|system|>", "<|user|>", "<|assistant|>"), "<|endoftext|>",
                  "<|endoftext|>", "<|padding|>", "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + "
                  "m['content'] + '\\n' }}{% endfor %}"
                  "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")


@dataclass(frozen=True)
class CoreCheckpoint:
    path: Path
    num_parameters: int


def tensors(seed: int = 0, config: dict | None = None) -> list[tuple[str, np.ndarray]]:
    """Every tensor, by name: matrices N(0, 1/fan_in), norms 1 + 0.1 N (O(1) scale, so routing is not uniform)."""
    c, rng = config or CONFIG, np.random.default_rng(seed)
    h, v, inter = c["hidden_size"], c["vocab_size"], c["intermediate_size"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "lm_head.weight": (v, h),
                                          "model.norm.weight": (h,)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"):
            shapes[f"{p}{norm}.weight"] = (h,)
        for proj in "qkvo":
            shapes[f"{p}self_attn.{proj}_proj.weight"] = (h, h)
        shapes[f"{p}mlp.gate.weight"] = (c["num_experts"], h)
        for e in range(c["num_experts"]):
            q = f"{p}mlp.experts.{e}."
            shapes.update({q + "gate_proj.weight": (inter, h), q + "up_proj.weight": (inter, h),
                           q + "down_proj.weight": (h, inter)})
    out = []
    for name in sorted(shapes):
        shape = shapes[name]
        noise = rng.standard_normal(shape).astype(np.float32)
        value = 1.0 + 0.1 * noise if len(shape) == 1 else noise / math.sqrt(shape[1])
        out.append((name, value.astype(np.float32)))
    return out


def write_checkpoint(out: Path, seed: int = 0, intermediate_size: int = CONFIG["intermediate_size"]) -> CoreCheckpoint:
    """Write the checkpoint into ``out`` (created through a temporary directory renamed into place); the experts
    ``intermediate_size`` wide."""
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        ids = train_tokenizer(staging, STYLE, CONFIG["vocab_size"], CONFIG["max_position_embeddings"])
        config = {**CONFIG, "intermediate_size": intermediate_size, "bos_token_id": ids["bos"],
                  "eos_token_id": ids["eos"], "pad_token_id": ids["pad"]}
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (staging / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": ids["bos"], "pad_token_id": ids["pad"], "do_sample": False}, indent=2) + "\n")
        weights = tensors(seed, config)
        write_safetensors(staging / "model.safetensors", weights, {"format": "pt"})
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return CoreCheckpoint(out, sum(int(a.size) for _, a in weights))
