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


class TokenizerCodec:
    """Adapts :class:`colibri.tokenizer.TextTokenizer` to what a generation run needs."""

    def __init__(self, tokenizer: TextTokenizer):
        self.tokenizer = tokenizer
        self.stop_ids = tuple(tokenizer.stop_ids)
        self.vocab_size = tokenizer.vocab_size

    @classmethod
    def from_model_dir(cls, model_dir: Path, config: Mapping[str, Any] | None = None) -> TokenizerCodec:
        return cls(load_tokenizer_dir(model_dir, config))

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        if not self.tokenizer.has_chat_template:
            raise ConfigError("this model has no chat template, so chat requests cannot be rendered",
                              NO_TEMPLATE_FIX)
        return self.tokenizer.encode_chat(messages, add_generation_prompt=True)

    def text_ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        # as coli run streams: special tokens (end-of-turn markers and the like) are not text
        return self.tokenizer.decode(ids, skip_special_tokens=True)
