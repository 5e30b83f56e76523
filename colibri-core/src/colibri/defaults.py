"""Core's own implementations of the firstresult hooks, registered ``trylast``.

A family overrides any of them by answering the hook itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from . import hookimpl
from .records import (
    ConverterSpec, EngineEnv, Geometry, PlanRequest, ResolvedModel, ResourcePlan, ShardSet, TensorLayout,
)


@hookimpl(trylast=True)
def weight_files(model: ResolvedModel) -> tuple[ShardSet, ...]:
    from .checkpoint import default_shard_set

    found = default_shard_set(model.path)
    return (found,) if found else ()


@hookimpl(trylast=True)
def plan_resources(model: ResolvedModel, request: PlanRequest, geometry: Geometry, layout: TensorLayout,
                   tensors: Any) -> ResourcePlan:
    from .planner import plan

    return plan(model, request, geometry, layout, tensors)


@hookimpl(trylast=True)
def engine_path(model: ResolvedModel) -> Path | None:
    from .builder import engine_for_family

    return engine_for_family(model.family)


@hookimpl(trylast=True)
def build_env(model: ResolvedModel, plan: ResourcePlan) -> EngineEnv:
    return EngineEnv()


@hookimpl(trylast=True)
def converter_spec(model: ResolvedModel) -> ConverterSpec | None:
    from . import plugins
    from .convert.spec import spec_from_layout

    layout = plugins.family_hook(model.family, "tensor_layout")(model=model)
    return spec_from_layout(layout) if layout is not None else None


@hookimpl(trylast=True)
def load_tokenizer(model: ResolvedModel) -> Any:
    from .tokenizer import load_tokenizer_dir

    return load_tokenizer_dir(model.path, model.config)


@hookimpl(trylast=True)
def render_prompt(model: ResolvedModel, messages: Any, tools: Any, options: Any) -> str | None:
    from .prompt import render_conversation

    tok = _tokenizers.get((model.path, model.family))
    if tok is None:
        from . import plugins

        tok = plugins.family_hook(model.family, "load_tokenizer")(model=model)
        while len(_tokenizers) >= _KEEP_TOKENIZERS:
            _tokenizers.pop(next(iter(_tokenizers)))
        _tokenizers[(model.path, model.family)] = tok
    if tok is None or not tok.has_chat_template:
        return None
    return render_conversation(tok, messages, tools, options)


# Loading a real tokenizer takes a good part of a second: a server renders every request, so keep the last few.
_tokenizers: dict[tuple[Path, str], Any] = {}
_KEEP_TOKENIZERS = 4
