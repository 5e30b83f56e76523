"""Core's own implementations of the firstresult hooks, registered ``trylast``.

A family overrides any of them by answering the hook itself. The defaults that need another hook's answer
(``converter_spec`` derives from ``tensor_layout``) get the family-restricted hook caller handed in
(``CoreDefaults(ask)``, built by ``colibri.plugins``), so this module never imports the plugin layer.

The engine binary has no default hook implementation: when a family ships none (``engine_path``), core builds its
``engine_source`` (``colibri.builder.engine_for_model``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from . import hookimpl
from .checkpoint import default_shard_set
from .convert.spec import spec_from_layout
from .decision import LabelTokenDecider, load_settings
from .planner import plan
from .prompt import render_conversation
from .records import (
    TEXT_GENERATION, ConverterSpec, EngineEnv, Geometry, PlanRequest, PreTokenizerSplit, ResolvedModel, ResourcePlan,
    ShardSet, TensorLayout,
)
from .tokenizer import load_tokenizer_dir

HookAsker = Callable[[str, str], Any]   # (family, hook name) -> a hook caller limited to that family and core


class CoreDefaults:
    """Registered once per plugin manager under the name ``colibri.defaults``."""

    def __init__(self, ask: HookAsker) -> None:
        self._ask = ask
        self._tokenizers: dict[tuple[Path, str], Any] = {}

    @hookimpl(trylast=True)
    def model_task(self, model: ResolvedModel) -> str:
        return TEXT_GENERATION

    @hookimpl(trylast=True)
    def weight_files(self, model: ResolvedModel) -> tuple[ShardSet, ...]:
        found = default_shard_set(model.path)
        return (found,) if found else ()

    @hookimpl(trylast=True)
    def plan_resources(self, model: ResolvedModel, request: PlanRequest, geometry: Geometry, layout: TensorLayout,
                       tensors: Any) -> ResourcePlan:
        return plan(model, request, geometry, layout, tensors)

    @hookimpl(trylast=True)
    def build_env(self, model: ResolvedModel, plan: ResourcePlan) -> EngineEnv:
        return EngineEnv()

    @hookimpl(trylast=True)
    def converter_spec(self, model: ResolvedModel) -> ConverterSpec | None:
        layout = self._ask(model.family, "tensor_layout")(model=model)
        return spec_from_layout(layout) if layout is not None else None

    @hookimpl(trylast=True)
    def decider(self, model: ResolvedModel, tokenizer: Any) -> Any:
        if tokenizer is None:
            tokenizer = self._ask(model.family, "load_tokenizer")(model=model)
        return LabelTokenDecider(tokenizer, load_settings(model.path))

    @hookimpl(trylast=True)
    def load_tokenizer(self, model: ResolvedModel) -> Any:
        return load_tokenizer_dir(model.path, model.config)

    @hookimpl(trylast=True)
    def byte_level_split(self, tokenizer_class: str) -> PreTokenizerSplit | None:
        return PreTokenizerSplit() if tokenizer_class in GPT2_CLASSES else None

    @hookimpl(trylast=True)
    def render_prompt(self, model: ResolvedModel, messages: Any, tools: Any, options: Any) -> str | None:
        tok = self._tokenizers.get((model.path, model.family))
        if tok is None:
            tok = self._ask(model.family, "load_tokenizer")(model=model)
            while len(self._tokenizers) >= KEEP_TOKENIZERS:
                self._tokenizers.pop(next(iter(self._tokenizers)))
            self._tokenizers[(model.path, model.family)] = tok
        if tok is None or not tok.has_chat_template:
            return None
        return render_conversation(tok, messages, tools, options)


# GPT-2's own tokenizer classes: the byte-level pre-tokenizer's built-in split rule, no normalizer.
GPT2_CLASSES = ("GPT2Tokenizer", "GPT2TokenizerFast")
# Loading a real tokenizer takes a good part of a second: a server renders every request, so keep the last few.
KEEP_TOKENIZERS = 4
