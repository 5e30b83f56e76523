"""Tiny random-weight Kimi checkpoints for tests (``colibri.testing.tiny.tiny_model(kind, ...)``).

Registered under the entry-point group ``colibri.testing.tiny``; core's tiny-model machinery builds them with
transformers.
"""

from __future__ import annotations

from typing import Any

from colibri.testing.tiny import (
    ChatStyle, TextRecipe, dense_then_sparse, grouped_moe_mla_fields, hybrid_layer_types, mla_fields,
)

STYLE = ChatStyle(
    ("[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
     "[PAD]"),
    "[BOS]", "<|im_end|>", "[PAD]",
    "{% for m in messages %}{{ '<|im_' + m['role'] + '|>' + m['role'] + '<|im_middle|>' + m['content'] + "
    "'<|im_end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_assistant|>assistant<|im_middle|>' }}{% endif %}")


def _kimi_linear(n: int) -> dict[str, Any]:
    return dict(num_hidden_layers=n, num_attention_heads=4, num_key_value_heads=4, intermediate_size=128,
                moe_intermediate_size=32, num_experts=16, num_experts_per_token=4, num_shared_experts=1,
                num_expert_group=4, topk_group=2, moe_renormalize=True, routed_scaling_factor=2.5,
                linear_head_dim=16, linear_num_heads=4, linear_conv_kernel_dim=4, model_max_length=4096,
                layer_types=hybrid_layer_types(n), mlp_layer_types=dense_then_sparse(n),
                **mla_fields(q_lora_rank=None))


TINY_MODELS = {
    "kimi_linear": TextRecipe("kimi_linear", 4, _kimi_linear, STYLE),
    # Real Kimi K2 checkpoints are DeepSeek-V3 architecture under their own model_type.
    "kimi_k2": TextRecipe("deepseek_v3", 3, grouped_moe_mla_fields, STYLE, saved_model_type="kimi_k2"),
}
