"""Tiny random-weight Qwen MoE checkpoints for tests (``colibri.testing.tiny.tiny_model(kind, ...)``).

Registered under the entry-point group ``colibri.testing.tiny``; core's tiny-model machinery builds them with
transformers.
"""

from __future__ import annotations

from typing import Any

from colibri.testing.tiny import HIDDEN, ChatStyle, TextRecipe, hybrid_layer_types

# ChatML.
STYLE = ChatStyle(
    ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    None, "<|im_end|>", "<|endoftext|>",
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


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
                num_experts_per_tok=4, norm_topk_prob=True, layer_types=hybrid_layer_types(n))


def _qwen3_5_moe_text(n: int) -> dict[str, Any]:
    cfg = _qwen3_next(n)
    for key in ("intermediate_size", "norm_topk_prob"):
        cfg.pop(key)
    return cfg


# Qwen3.5's multimodal wrapper: a one-block vision tower; the LM under text_config and model.language_model.
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, out_hidden_size=HIDDEN,
              num_position_embeddings=16)

TINY_MODELS = {
    "qwen2_moe": TextRecipe("qwen2_moe", 2, _qwen2_moe, STYLE),
    "qwen3_moe": TextRecipe("qwen3_moe", 2, _qwen3_moe, STYLE),
    "qwen3_next": TextRecipe("qwen3_next", 4, _qwen3_next, STYLE),
    "qwen3_5_moe_text": TextRecipe("qwen3_5_moe_text", 4, _qwen3_5_moe_text, STYLE),
    "qwen3_5_moe": TextRecipe("qwen3_5_moe", 4, _qwen3_5_moe_text, STYLE, vision_config=VISION),
}
