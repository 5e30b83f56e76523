"""Tiny random-weight OLMoE checkpoints for tests (``colibri.testing.tiny.tiny_model("olmoe", ...)``).

Registered under the entry-point group ``colibri.testing.tiny``; core's tiny-model machinery builds them with
transformers.
"""

from __future__ import annotations

from typing import Any

from colibri.testing.tiny import ChatStyle, TextRecipe

# Tulu-style turns ended by the GPT-NeoX end-of-text token, as OLMoE-Instruct does.
STYLE = ChatStyle(
    ("<|endoftext|>", "<|padding|>", "<|system|>", "<|user|>", "<|assistant|>"),
    "<|endoftext|>", "<|endoftext|>", "<|padding|>",
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}{{ '<|assistant|>\\n' + m['content'] + eos_token + '\\n' }}"
    "{% else %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")


def _olmoe(n: int) -> dict[str, Any]:
    return dict(num_hidden_layers=n, num_attention_heads=4, num_key_value_heads=4, intermediate_size=32,
                num_experts=16, num_experts_per_tok=4, norm_topk_prob=False)


TINY_MODELS = {"olmoe": TextRecipe("olmoe", 2, _olmoe, STYLE)}
