"""What core asks a family, one typed function per hook.

Core never calls a hook by its name as a string: it calls ``hooks.tensor_layout(model)`` and gets a
``TensorLayout | None`` back. Model hooks go to the family that claimed the model (plus core's defaults, see
``colibri.plugins.family_hook``); discovery hooks go to every installed family. The specifications, with their
documentation, are ``colibri.hookspecs``; ``docs/hooks.md`` describes each for plugin authors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence, cast

from . import plugins
from .decision import Decider
from .errors import EngineError, FamilyError
from .records import (
    Claim, ConverterSpec, DemoModel, EngineEnv, EngineSource, FamilyDescriptor, Geometry, Limits, PlanRequest,
    PreTokenizerSplit, ResolvedModel, ResourcePlan, RouteSpec, RunOption, ShardSet, TensorLayout,
)


def model_geometry(model: ResolvedModel) -> Geometry | None:
    return plugins.family_hook(model.family, "model_geometry")(model=model)


def tensor_layout(model: ResolvedModel) -> TensorLayout | None:
    return plugins.family_hook(model.family, "tensor_layout")(model=model)


def weight_files(model: ResolvedModel) -> tuple[ShardSet, ...]:
    return tuple(plugins.family_hook(model.family, "weight_files")(model=model) or ())


def limits(model: ResolvedModel) -> Limits | None:
    return plugins.family_hook(model.family, "limits")(model=model)


def plan_resources(model: ResolvedModel, request: PlanRequest, geometry: Geometry, layout: TensorLayout | None,
                   tensors: Any) -> ResourcePlan:
    return plugins.family_hook(model.family, "plan_resources")(model=model, request=request, geometry=geometry,
                                                                layout=layout, tensors=tensors)


def engine_source(model: ResolvedModel) -> EngineSource | None:
    """The C sources of the engine that runs this model (a family may have one composition per model type)."""
    return family_engine_source(model.family, model)


def family_engine_source(family: str, model: ResolvedModel | None = None) -> EngineSource | None:
    """The ``engine_source`` answer of one family: for ``model``, or its main engine when ``model`` is None
    (``coli build FAMILY``, ``coli families``)."""
    if family not in plugins.families() and family not in dict(plugins.manager().list_name_plugin()):
        raise EngineError(f"family {family!r} is not installed", "coli families lists the installed ones")
    return plugins.family_hook(family, "engine_source")(model=model)


def engine_path(model: ResolvedModel) -> Path | None:
    """A binary the family ships for this model, or None (core then builds ``engine_source``: see
    ``colibri.builder.engine_for_model``)."""
    return plugins.family_hook(model.family, "engine_path")(model=model)


def build_env(model: ResolvedModel, plan: ResourcePlan) -> EngineEnv:
    return plugins.family_hook(model.family, "build_env")(model=model, plan=plan) or EngineEnv()


def converter_spec(model: ResolvedModel) -> ConverterSpec | None:
    return plugins.family_hook(model.family, "converter_spec")(model=model)


def load_tokenizer(model: ResolvedModel) -> Any:
    """A :class:`colibri.tokenizer.TextTokenizer` (typed ``Any`` so this module does not import the tokenizers
    library)."""
    return plugins.family_hook(model.family, "load_tokenizer")(model=model)


def byte_level_split(tokenizer_class: str) -> PreTokenizerSplit | None:
    """How ``tokenizer_class`` splits text before byte-level BPE (asked of every family; core knows GPT-2's)."""
    return plugins.manager().hook.byte_level_split(tokenizer_class=tokenizer_class)


def render_prompt(model: ResolvedModel, messages: Sequence[Mapping[str, Any]],
                  tools: Sequence[Mapping[str, Any]] | None, options: Mapping[str, Any]) -> str | None:
    """The prompt text of a conversation (the family's own encoder, else the checkpoint's chat template)."""
    return plugins.family_hook(model.family, "render_prompt")(model=model, messages=messages, tools=tools,
                                                              options=options)


def parse_output(model: ResolvedModel) -> Any:
    """A fresh :class:`colibri.output_parser.OutputParser` for one reply, or ``None`` (plain text)."""
    return plugins.family_hook(model.family, "parse_output")(model=model)


def model_task(model: ResolvedModel) -> str:
    """What the model does: ``records.TEXT_GENERATION`` unless its family says otherwise."""
    return str(plugins.family_hook(model.family, "model_task")(model=model))


def run_options() -> list[RunOption]:
    """Every installed family's extra ``coli run`` flags, the first of each name kept."""
    seen: set[str] = set()
    out = []
    for answer in plugins.manager().hook.run_options():
        for option in answer or ():
            if option.name not in seen:
                seen.add(option.name)
                out.append(option)
    return out


def run_handler(model: ResolvedModel, prompt: str, options: Mapping[str, Any]) -> int | None:
    return plugins.family_hook(model.family, "run_handler")(model=model, prompt=prompt, options=options)


def server_routes(model: ResolvedModel, options: Mapping[str, Any]) -> tuple[RouteSpec, ...]:
    return tuple(plugins.family_hook(model.family, "server_routes")(model=model, options=options) or ())


def decider(model: ResolvedModel, tokenizer: Any) -> Decider:
    """The model's ``colibri.decision.Decider`` (core's default scores label tokens)."""
    return plugins.family_hook(model.family, "decider")(model=model, tokenizer=tokenizer)


def describe_family(family: str) -> FamilyDescriptor | None:
    """The family's own ``describe_family`` answer (not whichever plugin answers first); None when it has none.
    Exceptions of the family's implementation propagate (``coli families`` reports them on the family's row)."""
    for impl in plugins.manager().hook.describe_family.get_hookimpls():
        if impl.plugin_name == family:
            return cast("FamilyDescriptor | None", impl.function())
    return None


def claims(model_dir: Path, config: Mapping[str, Any] | None) -> list[Claim]:
    """Every installed family's claim on a model directory.

    A family that does not implement ``detect_config`` claims a config whose ``model_type`` is one of the
    ``model_types`` of its ``describe_family`` (stated once, there). A claim must name the family that made it
    (``Claim.family`` equal to the plugin's entry-point name): model hooks are routed by that name, so a mismatch
    would silently ask nobody. It is refused here instead.
    """
    pm = plugins.manager()
    detectors = pm.hook.detect_config.get_hookimpls()
    found = [*_claims_by_model_type(config, {impl.plugin_name for impl in detectors})]
    # reversed: the order pluggy itself calls them in (last registered first)
    for impl in reversed(detectors):
        claim = cast("Claim | None", impl.function(**_kwargs(impl.argnames, model_dir=model_dir, config=config)))
        if claim is None:
            continue
        if claim.family != impl.plugin_name:
            raise FamilyError(f"the family plugin {impl.plugin_name!r} claims {model_dir} as family "
                              f"{claim.family!r}", f"its Claim.family must be its entry-point name "
                              f"{impl.plugin_name!r} (fix the plugin, or its entry point)")
        found.append(claim)
    return found


def claim_by_model_type(family: FamilyDescriptor, config: Mapping[str, Any] | None) -> Claim | None:
    """The default claim: ``config.json``'s ``model_type`` is one of the family's ``model_types``. A family's
    ``detect_config`` may simply return this (``claim_by_model_type(describe_family(), config)``); a family that
    does not implement ``detect_config`` at all is claimed this way by core."""
    model_type = config.get("model_type") if config else None
    if isinstance(model_type, str) and model_type in family.model_types:
        return Claim(family.name, model_type, f"config.json model_type {model_type!r}")
    return None


def _claims_by_model_type(config: Mapping[str, Any] | None, detectors: set[str]) -> list[Claim]:
    found = []
    for impl in reversed(plugins.manager().hook.describe_family.get_hookimpls()):
        if impl.plugin_name in detectors:
            continue
        claim = claim_by_model_type(cast(FamilyDescriptor, impl.function()), config)
        if claim is not None:
            found.append(Claim(impl.plugin_name, claim.model_type, claim.reason))
    return found


def demo_model(cache_dir: Path, synthetic: bool) -> DemoModel | None:
    return plugins.manager().hook.demo_model(cache_dir=cache_dir, synthetic=synthetic)


def _kwargs(argnames: tuple[str, ...], **given: Any) -> dict[str, Any]:
    """The arguments an implementation declares (pluggy lets an implementation take a subset of the spec's)."""
    return {name: given[name] for name in argnames if name in given}
