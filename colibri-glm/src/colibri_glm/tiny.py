"""Tiny random-weight GLM MoE checkpoints for tests (``colibri.testing.tiny.tiny_model(kind, ...)``).

Registered under the entry-point group ``colibri.testing.tiny``; core's tiny-model machinery builds them with
transformers.
"""

from __future__ import annotations

from typing import Any

from colibri.testing.tiny import ChatStyle, TextRecipe, dense_then_sparse, grouped_moe_mla_fields

STYLE = ChatStyle(
    ("<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"),
    None, "<|endoftext|>", "<|endoftext|>",
    "[gMASK]<sop>{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")


def _glm4_moe(n: int) -> dict[str, Any]:
    return dict(num_hidden_layers=n, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                intermediate_size=128, moe_intermediate_size=32, n_routed_experts=16, num_experts_per_tok=4,
                n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
                norm_topk_prob=True, use_qk_norm=True, attention_bias=True)


def _glm4_moe_lite(n: int) -> dict[str, Any]:
    cfg = grouped_moe_mla_fields(n)
    cfg.pop("first_k_dense_replace")
    cfg["mlp_layer_types"] = dense_then_sparse(n)
    return cfg


def _glm_moe_dsa(n: int) -> dict[str, Any]:
    cfg = grouped_moe_mla_fields(n)
    cfg.update(index_topk=4, index_head_dim=16, index_n_heads=2, mlp_layer_types=dense_then_sparse(n),
               indexer_types=["full"] * n)
    return cfg


TINY_MODELS = {
    "glm4_moe": TextRecipe("glm4_moe", 3, _glm4_moe, STYLE),
    "glm4_moe_lite": TextRecipe("glm4_moe_lite", 3, _glm4_moe_lite, STYLE),
    "glm_moe_dsa": TextRecipe("glm_moe_dsa", 3, _glm_moe_dsa, STYLE),
}
