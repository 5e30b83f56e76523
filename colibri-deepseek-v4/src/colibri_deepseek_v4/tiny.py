"""Tiny random-weight DeepSeek checkpoints for tests (``colibri.testing.tiny.tiny_model(kind, ...)``).

Registered under the entry-point group ``colibri.testing.tiny``; core's tiny-model machinery builds them with
transformers.
"""

from __future__ import annotations

from typing import Any

from colibri.testing.tiny import ChatStyle, TextRecipe, dense_then_sparse, grouped_moe_mla_fields

STYLE = ChatStyle(
    ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"),
    "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}"
    "{% else %}{{ '<｜Assistant｜>' + m['content'] + eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}")


def _deepseek_v32(n: int) -> dict[str, Any]:
    cfg = grouped_moe_mla_fields(n)
    cfg.update(index_topk=4, index_head_dim=16, index_n_heads=2, mlp_layer_types=dense_then_sparse(n))
    return cfg


# One layer of each DeepSeek-V4 attention kind, so every tensor set appears in a three-layer model.
_V4_ATTENTION = ("compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention")


def _deepseek_v4(n: int) -> dict[str, Any]:
    return dict(num_hidden_layers=n, num_attention_heads=4, num_key_value_heads=1, head_dim=32, q_lora_rank=48,
                moe_intermediate_size=32, n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1,
                o_groups=2, o_lora_rank=32, index_n_heads=2, index_head_dim=16, index_topk=4, sliding_window=8,
                partial_rotary_factor=0.25, hc_mult=4, hc_sinkhorn_iters=4,
                layer_types=[_V4_ATTENTION[i % 3] for i in range(n)],
                mlp_layer_types=["hash_moe" if i < 1 else "moe" for i in range(n)])


TINY_MODELS = {
    "deepseek_v3": TextRecipe("deepseek_v3", 3, grouped_moe_mla_fields, STYLE),
    "deepseek_v32": TextRecipe("deepseek_v32", 3, _deepseek_v32, STYLE),
    "deepseek_v4": TextRecipe("deepseek_v4", 3, _deepseek_v4, STYLE),
}
