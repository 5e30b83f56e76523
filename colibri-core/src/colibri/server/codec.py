"""The served model's tokenizer and chat template, through the very code ``coli chat`` renders with.

Byte-exact rendering is what makes slot reuse work: each turn re-renders the whole conversation, and only if the
earlier turns come out identical does the engine find them in the slot's cache.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..prompt import NO_TEMPLATE_FIX
from ..tokenizer import TextTokenizer, load_tokenizer_dir
from .prompt_bound import PromptBound, prompt_bound


class TokenizerCodec:
    """Adapts :class:`colibri.tokenizer.TextTokenizer` to what a generation run needs."""

    def __init__(self, tokenizer: TextTokenizer):
        self.tokenizer = tokenizer
        self.stop_ids = tuple(tokenizer.stop_ids)
        self.vocab_size = tokenizer.vocab_size
        self.bound: PromptBound = prompt_bound(tokenizer.backend)

    @classmethod
    def from_model_dir(cls, model_dir: Path, config: Mapping[str, Any] | None = None) -> TokenizerCodec:
        return cls(load_tokenizer_dir(model_dir, config))

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """The prompt text of a conversation (its special tokens spelled out), ready for the assistant's turn."""
        if not self.tokenizer.has_chat_template:
            raise ConfigError("this model has no chat template, so chat requests cannot be rendered",
                              NO_TEMPLATE_FIX)
        return self.tokenizer.render_chat(messages, add_generation_prompt=True)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        # as encode_chat: the rendered text already holds its special tokens
        return self.encode(self.render_chat(messages), add_special_tokens=False)

    def text_ids(self, text: str) -> list[int]:
        return self.encode(text, add_special_tokens=True)

    def decode(self, ids: Sequence[int]) -> str:
        # as coli run streams: special tokens (end-of-turn markers and the like) are not text
        return self.tokenizer.decode(ids, skip_special_tokens=True)
