"""The served model's tokenizer and chat template, through the very code ``coli chat`` renders with.

Byte-exact rendering is what makes slot reuse work: each turn re-renders the whole conversation, and only if the
earlier turns come out identical does the engine find them in the slot's cache.

With the resolved model, prompts come from the family's ``render_prompt`` hook (core's default renders the
checkpoint's template with tools and tool results) and replies are split by its ``parse_output`` parser.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import ColibriError, ConfigError
from .. import hooks
from ..prompt import NO_TEMPLATE_FIX, render_conversation, thinking_switch
from ..records import ResolvedModel
from ..tokenizer import TextTokenizer, load_tokenizer_dir
from .prompt_bound import PromptBound, prompt_bound


class TokenizerCodec:
    """Adapts :class:`colibri.tokenizer.TextTokenizer` to what a generation run needs."""

    def __init__(self, tokenizer: TextTokenizer, model: ResolvedModel | None = None):
        self.tokenizer = tokenizer
        self.model = model
        self.stop_ids = tuple(tokenizer.stop_ids)
        self.vocab_size = tokenizer.vocab_size
        self.bound: PromptBound = prompt_bound(tokenizer.backend)
        self.thinking_switch = next((name for t in tokenizer.templates.values()
                                     if (name := thinking_switch(t.source))), None)
        # the template's own effort variable (gpt-oss style), passed through as it is named
        self.reasoning_effort_variable = any("reasoning_effort" in t.source for t in tokenizer.templates.values())
        self.renders_chat = tokenizer.has_chat_template
        if not tokenizer.has_chat_template and model is not None:
            self._probe_family_renderer()
        parser = self.output_parser()
        self.tools_supported = bool(parser is not None and parser.syntax.has_tools and self.renders_chat)
        # Special tokens are not text, except those that spell the family's markers (a tool-call section begin
        # is a special token in some releases): the parser must see those.
        markers = set(parser.syntax.markers) if parser is not None else set()
        added = tokenizer.backend.get_added_tokens_decoder()
        self._kept = {i for i, t in added.items() if t.special and t.content in markers}
        self._hidden = {i for i, t in added.items() if t.special and t.content not in markers}

    def _probe_family_renderer(self) -> None:
        """A family that renders conversations itself (an encoder instead of a template): which switches change
        its rendering is what it honours."""
        probe = [{"role": "user", "content": "x"}]

        def render(**variables: Any) -> str | None:
            assert self.model is not None
            try:
                return hooks.render_prompt(self.model, probe, None, {"add_generation_prompt": True,
                                                                     "template_kwargs": variables})
            except ColibriError:
                return None

        plain = render()
        self.renders_chat = plain is not None
        if plain is None:
            return
        for name in ("thinking", "enable_thinking"):
            on, off = render(**{name: True}), render(**{name: False})
            if on is not None and off is not None and on != off:
                self.thinking_switch = name
                break
        self.reasoning_effort_variable = self.thinking_switch is not None and \
            render(**{self.thinking_switch: True, "reasoning_effort": "max"}) not in (None, render(
                **{self.thinking_switch: True}))

    @classmethod
    def from_model_dir(cls, model_dir: Path, config: Mapping[str, Any] | None = None) -> TokenizerCodec:
        return cls(load_tokenizer_dir(model_dir, config))

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    template_kwargs: Mapping[str, Any] | None = None, continue_final: bool = False) -> str:
        """The prompt text of a conversation (its special tokens spelled out), ready for the assistant's turn, or
        (``continue_final``) ending inside the final assistant message, which the model continues."""
        if not self.tokenizer.has_chat_template and self.model is None:
            raise ConfigError("this model has no chat template, so chat requests cannot be rendered",
                              NO_TEMPLATE_FIX)
        options = {"add_generation_prompt": not continue_final, "continue_final_message": continue_final,
                   "template_kwargs": dict(template_kwargs or {})}
        if self.model is None:
            return render_conversation(self.tokenizer, messages, tools, options)
        text = hooks.render_prompt(self.model, messages, tools, options)
        if text is None:
            raise ConfigError(f"family {self.model.family} cannot render a conversation for this model",
                              NO_TEMPLATE_FIX)
        return text

    def output_parser(self) -> Any:
        """A fresh parser for one reply (``None``: the reply is plain text)."""
        if self.model is None:
            return None
        return hooks.parse_output(self.model)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        # as encode_chat: the rendered text already holds its special tokens
        return self.encode(self.render_chat(messages), add_special_tokens=False)

    def text_ids(self, text: str) -> list[int]:
        return self.encode(text, add_special_tokens=True)

    def decode(self, ids: Sequence[int]) -> str:
        # as coli run streams: special tokens (end-of-turn markers and the like) are not text
        if not self._kept:
            return self.tokenizer.decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode([i for i in ids if i not in self._hidden], skip_special_tokens=False)
