"""The hooks a colibri family plugin implements.

A family is one Python module registered under the entry-point group ``colibri.families``::

    [project.entry-points."colibri.families"]
    olmoe = "colibri_olmoe.plugin"

The entry-point name is the family name: ``Claim.family`` and ``FamilyDescriptor.name`` must equal it. Core calls
hooks through the typed functions of ``colibri.hooks``.

Two kinds of hooks exist:

* *Discovery hooks* (``describe_family``, ``detect_config``, ``demo_model``) are called on every installed family.
* *Model hooks* (everything that takes ``model``) are called only on the family that claimed the model,
  followed by core's own defaults (registered ``trylast``); for ``firstresult`` hooks the family's answer wins
  and core's default applies when the family returns ``None`` or does not implement the hook.

Every hook is documented with its signature in ``docs/hooks.md``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import pluggy

from .records import (
    Claim,
    ConverterSpec,
    DemoModel,
    EngineEnv,
    EngineSource,
    FamilyDescriptor,
    Geometry,
    Limits,
    PlanRequest,
    PreTokenizerSplit,
    ResolvedModel,
    ResourcePlan,
    RouteSpec,
    RunOption,
    ShardSet,
    TensorLayout,
)

if TYPE_CHECKING:   # the decision layer is not needed to declare the hooks
    from .decision import Decider

hookspec = pluggy.HookspecMarker("colibri")


@hookspec
def describe_family() -> FamilyDescriptor:
    """Name the family and the model types it runs.

    Called once per installed family (not firstresult); ``coli families`` lists the answers.

    :returns: the family's :class:`~colibri.records.FamilyDescriptor`.
    """


@hookspec
def detect_config(model_dir: Path, config: Mapping[str, Any] | None) -> Claim | None:
    """Claim a model directory.

    Called on every installed family (not firstresult). Core collects all claims: none is an error naming the
    ``model_type`` (or marker file) and the installed families; two or more is an error naming them and the
    ``--family`` option that settles it. A family that does not implement this hook is claimed by the
    ``model_types`` of its ``describe_family``. ``Claim.family`` must be the plugin's entry-point name (model hooks
    are routed by it); a claim naming another family is refused.

    :param model_dir: the checkpoint directory.
    :param config: the parsed ``config.json``, or ``None`` when the directory has none (pipelines, for example,
        keep ``model_index.json`` instead).
    :returns: a :class:`~colibri.records.Claim` when this family runs the model, else ``None``.
    """


@hookspec(firstresult=True)
def model_geometry(model: ResolvedModel) -> Geometry | None:
    """Describe the model's shape from its config, in every spelling real checkpoints use.

    firstresult: the claiming family answers.

    :param model: the resolved model.
    :returns: its :class:`~colibri.records.Geometry`.
    """


@hookspec(firstresult=True)
def tensor_layout(model: ResolvedModel) -> TensorLayout | None:
    """Say which tensor names play which role (embeddings, norms, routers, each routed expert, the rest).

    Derived from the config alone, so ``doctor --deep`` can report what is missing on disk.
    firstresult: the claiming family answers.

    :param model: the resolved model.
    :returns: its :class:`~colibri.records.TensorLayout`.
    """


@hookspec(firstresult=True)
def weight_files(model: ResolvedModel) -> tuple[ShardSet, ...] | None:
    """List the safetensors files that hold the model's weights.

    firstresult: core's default finds ``model.safetensors.index.json`` or the ``*.safetensors`` files in the
    model directory; multi-component families (diffusion pipelines) return one set per component.

    :param model: the resolved model.
    :returns: the shard sets, in load order.
    """


@hookspec(firstresult=True)
def limits(model: ResolvedModel) -> Limits | None:
    """State what the family's engine supports for this model (context, slots, dtypes, whether it exists).

    firstresult: the claiming family answers.

    :param model: the resolved model.
    :returns: its :class:`~colibri.records.Limits`.
    """


@hookspec(firstresult=True)
def plan_resources(
    model: ResolvedModel, request: PlanRequest, geometry: Geometry, layout: TensorLayout, tensors: Any
) -> ResourcePlan | None:
    """Place the model in RAM: dense weights, KV/state, reserve, and expert cache slots per layer.

    firstresult: core's default planner (``colibri.planner``) applies unless the family knows better.

    :param model: the resolved model.
    :param request: the RAM budget, context and slots asked for.
    :param geometry: the model's geometry (from ``model_geometry``).
    :param layout: the model's tensor roles (from ``tensor_layout``).
    :param tensors: the :class:`~colibri.checkpoint.TensorIndex` read from the shard headers.
    :returns: the :class:`~colibri.records.ResourcePlan`.
    """


@hookspec(firstresult=True)
def engine_source(model: ResolvedModel | None) -> EngineSource | None:
    """Name the C sources of the engine that runs ``model`` (compiled by core together with the shared runtime).

    A family with several compositions (one per attention kind, say) answers with the one this model needs, each
    under its own binary name, so the binary never has to dispatch on its arguments. Called on one family's plugin
    only. firstresult.

    :param model: the resolved model; ``None`` asks for the family's main engine (what ``coli build FAMILY``
        builds and ``coli families`` reports when no model is named).
    :returns: an :class:`~colibri.records.EngineSource`, or ``None`` when the family (or this model) has no engine.
    """


@hookspec(firstresult=True)
def engine_path(model: ResolvedModel) -> Path | None:
    """Return the engine binary that runs this model.

    firstresult; no core default: when no family answers, core builds (or finds in the build cache) the
    family's ``engine_source(model)`` (``colibri.builder.engine_for_model``). A family that ships a prebuilt
    binary answers with its path.

    :param model: the resolved model.
    :returns: path to an executable engine.
    """


@hookspec(firstresult=True)
def build_env(model: ResolvedModel, plan: ResourcePlan) -> EngineEnv | None:
    """Give the family-specific engine arguments and environment for this model and plan.

    firstresult. Core itself passes the model directory, context, slots, cache capacity and threads; the family
    adds what only it knows (typically the hyperparameters read from the config, as ``--set key=value``:
    ``colibri.engine_args.set_args``).

    :param model: the resolved model.
    :param plan: the resource plan the engine will run under (no family reads it today; it is there so one can
        size engine-side buffers from the plan without another hook).
    :returns: an :class:`~colibri.records.EngineEnv`.
    """


@hookspec(firstresult=True)
def converter_spec(model: ResolvedModel) -> ConverterSpec | None:
    """Say how ``coli convert`` may quantize this model: expert and dense schemes, and the dense matrices.

    firstresult: core's default derives a spec from ``tensor_layout`` (experts from the layout, dense matrices =
    embeddings, LM head and ``required`` tensors); it answers ``None`` — no converter, ``coli convert`` refuses —
    when the family has no layout or no routed experts.

    :param model: the resolved model.
    :returns: a :class:`~colibri.records.ConverterSpec`, or ``None`` when the family cannot be converted.
    """


@hookspec(firstresult=True)
def load_tokenizer(model: ResolvedModel) -> Any:
    """Load the model's tokenizer, special tokens, stop ids and chat template.

    firstresult: core's default reads ``tokenizer.json`` (with the ``tokenizers`` library), ``tokenizer_config.json``,
    ``special_tokens_map.json``, ``generation_config.json`` and the chat template files of the model directory. A
    family whose checkpoints keep their tokenizer or prompt format elsewhere answers itself.

    :param model: the resolved model.
    :returns: a :class:`colibri.tokenizer.TextTokenizer`.
    """


@hookspec(firstresult=True)
def byte_level_split(tokenizer_class: str) -> PreTokenizerSplit | None:
    """Say how a byte-level BPE tokenizer class splits text, for a checkpoint that ships ``vocab.json`` +
    ``merges.txt`` and no ``tokenizer.json`` (``tokenizer_config.json`` names the class).

    A discovery hook: asked of every installed family (the class is a file format, not a model, e.g. a diffusers
    pipeline's ``tokenizer/`` folder), firstresult. Core's default knows GPT-2's own classes; a class nobody
    answers for is refused with one line naming it and the command that writes ``tokenizer.json``.

    :param tokenizer_class: ``tokenizer_config.json``'s ``tokenizer_class`` (e.g. ``"GPT2TokenizerFast"``).
    :returns: a :class:`~colibri.records.PreTokenizerSplit` (what transformers' converter for the class builds),
        or ``None`` when the family does not know the class.
    """


@hookspec(firstresult=True)
def render_prompt(model: ResolvedModel, messages: Sequence[Mapping[str, Any]],
                  tools: Sequence[Mapping[str, Any]] | None, options: Mapping[str, Any]) -> str | None:
    """Render a conversation into the prompt text the model continues (its special tokens spelled out).

    firstresult: core's default renders the checkpoint's own chat template exactly as transformers'
    ``apply_chat_template`` does, with ``tools``, ``tool`` messages, assistant ``tool_calls`` and any template
    variable in ``options["template_kwargs"]`` (the thinking switch). A family whose release ships a Python
    encoder instead of a template answers itself.

    :param model: the resolved model.
    :param messages: OpenAI-shaped messages (``role``, ``content``; assistant ``tool_calls`` with ``arguments``
        as a mapping; ``tool`` messages with ``tool_call_id``; ``reasoning_content``).
    :param tools: the tools offered (OpenAI's ``{"type": "function", "function": {...}}``), or ``None``.
    :param options: ``add_generation_prompt`` (default ``True``), ``template_kwargs`` (a mapping passed to the
        template), ``template`` (a named template of the checkpoint), ``continue_final_message`` (``True``: the
        final message is an assistant prefill that the model continues, as transformers' option of that name
        renders it: no end of turn after it and no generation prompt).
    :returns: the prompt text, or ``None`` when the model has no way to render a conversation.
    """


@hookspec(firstresult=True)
def parse_output(model: ResolvedModel) -> Any:
    """Give a fresh streaming parser for one generation's output: reasoning apart from the answer, tool calls
    recognized in the family's own syntax, partial markers held back.

    firstresult: the claiming family answers with ``colibri.output_parser.OutputParser(SYNTAX)``, ``SYNTAX`` its
    table of markers; no core default (``None``: the output is plain answer text and tools are refused).

    :param model: the resolved model.
    :returns: a :class:`colibri.output_parser.OutputParser`, or ``None``.
    """


@hookspec(firstresult=True)
def model_task(model: ResolvedModel) -> str | None:
    """Say what the model does, so core knows whether its own text commands run it.

    firstresult: core's default answers ``"text-generation"`` (``colibri.records.TEXT_GENERATION``). A family
    whose models do something else (``"text-to-image"``) answers itself; ``coli run`` then hands the prompt to its
    ``run_handler``, ``coli serve`` mounts its ``server_routes`` instead of starting a text engine, and
    ``coli doctor`` does not ask for a chat template.

    :param model: the resolved model.
    :returns: the task's name.
    """


@hookspec
def run_options() -> Sequence[RunOption]:
    """Offer extra ``coli run`` flags for the family's own tasks.

    A discovery hook: called on every installed family when ``coli run`` is built (not firstresult); a flag whose
    name is already taken is dropped. Their values reach the family's ``run_handler`` in ``options``; a text model
    given one of them is refused with one line naming the flag.

    :returns: the flags, as :class:`~colibri.records.RunOption` records.
    """


@hookspec(firstresult=True)
def run_handler(model: ResolvedModel, prompt: str, options: Mapping[str, Any]) -> int | None:
    """Run one ``coli run`` prompt for a model whose ``model_task`` is not text generation.

    firstresult: the claiming family answers; no core default (``coli run`` refuses a non-text model nobody runs).

    :param model: the resolved model.
    :param prompt: the prompt, as ``coli run`` read it (argument, ``--prompt-file`` or stdin).
    :param options: core's options that apply to any task (``seed``, ``threads``, ``ram``, ``json``) and the
        values of the ``run_options`` flags, by parameter name (``None`` when not given).
    :returns: the exit code (0 on success), or ``None`` when the family does not run this model.
    """


@hookspec(firstresult=True)
def server_routes(model: ResolvedModel, options: Mapping[str, Any]) -> Sequence[RouteSpec] | None:
    """Give the HTTP routes ``coli serve`` mounts for a model whose ``model_task`` is not text generation.

    firstresult: the claiming family answers; no core default. Core serves them behind its own gate (API key,
    body limit, cross-site rules) and error envelope; a handler reads its JSON body with
    ``await request.app.state.read_json(request)`` (the ``--max-body`` limit and timeout) and queues with
    ``request.app.state.services.scheduler.acquire(None)`` (the ``--kv-slots``/``--max-queue`` limits, 429 past
    them), releasing the lease it gets.

    :param model: the resolved model.
    :param options: the serve options that reach an engine: ``threads``, ``ram``.
    :returns: the routes, or ``None`` when the family serves nothing for this model.
    """


@hookspec(firstresult=True)
def decider(model: ResolvedModel, tokenizer: Any) -> Decider:
    """Say how the model answers System One questions (``POST /v1/systemone``, ``coli decide``).

    firstresult: core's default is ``colibri.decision.LabelTokenDecider`` (the decision prompts of the model's
    ``decision.json`` / template, scored by their label tokens' logits through the engine's ``decide`` op), right
    for any causal LM. A family whose models decide otherwise (a decision head over a backbone, an encoder with
    classification heads) answers with its own object of the ``colibri.decision.Decider`` shape: ``check``
    refuses questions it cannot answer (``DecisionInputError`` naming question and field, a 422), ``decide`` runs
    them on the engine and returns a ``colibri.decision.Decision``. Core still checks that the engine announces
    ``"decide"`` in its ``ready`` abilities.

    :param model: the resolved model.
    :param tokenizer: what ``load_tokenizer`` gave for the model (the server's own copy), or ``None``.
    :returns: a ``Decider``; raise ``colibri.errors.ColibriError`` when the model cannot decide (a 400).
    """


@hookspec(firstresult=True)
def demo_model(cache_dir: Path, synthetic: bool) -> DemoModel | None:
    """Offer a checkpoint for ``coli demo`` (``coli demo --synthetic`` asks with ``synthetic=True``).

    A discovery hook: called on every installed family, firstresult, no core default (``coli demo`` says which
    package to install when nobody answers). colibri-olmoe answers with its bundled trained model (package data)
    or, for ``synthetic``, a random-weight checkpoint it writes once into ``cache_dir``.

    :param cache_dir: a writable directory for this hook (``<colibri cache>/demo``); a family that writes or
        copies its checkpoint there must do so atomically (temporary directory renamed into place).
    :param synthetic: ``True`` to ask for a random-weight model bigger than the demo's RAM budget.
    :returns: a :class:`~colibri.records.DemoModel`, or ``None`` when the family has no demo model of that kind.
    """
