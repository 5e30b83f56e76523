"""Frozen records that hooks return and core consumes.

Hooks never return loose dicts: every piece of family knowledge crosses the plugin boundary as one of these,
so a third-party family can see exactly what core expects of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Awaitable, Callable, Mapping

# What a model does (``model_task``): core's text commands run TEXT_GENERATION; any other task is run by its
# family's ``run_handler`` and served by its ``server_routes``.
TEXT_GENERATION = "text-generation"
TEXT_TO_IMAGE = "text-to-image"


@dataclass(frozen=True)
class FamilyDescriptor:
    """What a family plugin says about itself (returned by ``describe_family``)."""

    name: str
    model_types: tuple[str, ...]
    description: str = ""


@dataclass(frozen=True)
class Claim:
    """A family's claim on a model directory (returned by ``detect_config``)."""

    family: str
    model_type: str
    reason: str = ""
    # Evidence beyond config.json's model_type (marker files such as a decision head's beside an LM): when several
    # families claim a directory, only the claims of the highest priority stand.
    priority: int = 0


@dataclass(frozen=True)
class ResolvedModel:
    """A model directory together with the family that claimed it.

    ``config`` is the checkpoint's own metadata (config.json, or model_index.json for pipelines), read-only.
    ``text_config`` is the language model's part of it: the same mapping for plain LMs, the ``text_config``
    sub-dict for multimodal wrappers.
    """

    path: Path
    family: str
    model_type: str
    config: Mapping[str, Any]

    @property
    def text_config(self) -> Mapping[str, Any]:
        inner = self.config.get("text_config")
        return MappingProxyType(dict(inner)) if isinstance(inner, Mapping) else self.config


@dataclass(frozen=True)
class ShardSet:
    """Safetensors files that together hold one component's tensors.

    ``prefix`` is prepended to tensor names (used by multi-component pipelines such as diffusers, where
    ``unet/`` and ``vae/`` would otherwise clash). ``index_file`` is a ``*.safetensors.index.json`` when the
    component is sharded; ``files`` lists the shards the index names (or the lone file).
    """

    directory: Path
    files: tuple[Path, ...]
    index_file: Path | None = None
    prefix: str = ""


@dataclass(frozen=True)
class Geometry:
    """The shape of a model as info/plan need it. MoE fields are 0/empty for dense or non-LLM families."""

    model_type: str
    architecture: str                      # human-readable, e.g. "OLMoE decoder"
    attention: str                         # e.g. "MHA + RoPE", "GQA + RoPE", "MLA (compressed KV)"
    num_layers: int = 0
    hidden_size: int = 0
    vocab_size: int = 0
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    num_experts: int = 0
    top_k: int = 0
    expert_intermediate: int = 0
    num_shared_experts: int = 0
    moe_layers: tuple[int, ...] = ()
    dense_layers: tuple[int, ...] = ()
    max_context: int = 0
    kv_bytes_per_token: int = 0            # one sequence, all layers, at the engine's cache dtype
    state_bytes_per_slot: int = 0          # recurrent (linear-attention) state for one sequence
    notes: tuple[tuple[str, str], ...] = ()  # family-specific facts worth showing, (label, value)


@dataclass(frozen=True)
class ExpertTensors:
    """The tensors of one routed expert: gate, up, down (in that order), plus any scale tensors."""

    layer: int
    expert: int
    tensors: tuple[str, ...]


@dataclass(frozen=True)
class TensorLayout:
    """Which tensors play which role, derived from the config (not from what happens to be on disk).

    doctor checks that every named tensor exists; info/plan use the roles to split bytes into dense,
    routed-expert and embedding parts. Tensors matching ``skipped_prefixes`` (e.g. multi-token-prediction
    layers) are counted but never loaded.
    """

    embeddings: tuple[str, ...]            # input embedding and an untied LM head
    lm_head: str | None                    # None when tied to the input embedding
    norms: tuple[str, ...]
    routers: tuple[tuple[int, str], ...]   # (layer, router weight name)
    experts: tuple[ExpertTensors, ...]
    required: tuple[str, ...] = ()         # every other tensor the engine needs
    skipped_prefixes: tuple[str, ...] = ()
    buffers: tuple[str, ...] = ()          # stored tensors that are not parameters (e.g. e_score_correction_bias,
                                           # tid2eid): loaded and counted in bytes, never in parameter counts
    packed_fp4: tuple[str, ...] = ()       # FP4 weights stored as I8/U8, two values per byte (DeepSeek-V4's
                                           # experts): each stored element is two parameters
    packed_int4: tuple[str, ...] = ()      # int4 compressed-tensors weights stored as I32, eight values per element
                                           # (Kimi K2-Thinking's experts, colibri.int4_packed)
    shapes: Mapping[str, tuple[int, ...]] = field(default_factory=lambda: MappingProxyType({}))
                                           # the stored shape of a tensor as the config implies it (any role but
                                           # routed experts); doctor --deep, convert and run refuse a mismatch
    expert_shapes: tuple[tuple[int, ...], ...] = ()  # the shape of each position of ExpertTensors.tensors (gate,
                                           # up, down, ...), the same for every routed expert; () = not stated
    paged: tuple[str, ...] = ()            # embeddings the engine maps and gathers by the row instead of holding
                                           # (the shared decoder's untied input embedding): counted in the
                                           # checkpoint's bytes, not in what stays resident


@dataclass(frozen=True)
class Limits:
    """What a family's engine supports; values past these are refused, never silently ignored."""

    max_context: int = 0                   # the longest --ctx the engine takes; 0: the model's own (Geometry's)
    max_kv_slots: int = 64
    weight_dtypes: tuple[str, ...] = ("F32", "BF16", "F16")
    has_engine: bool = False
    reason_no_engine: str = ""
    quant_schemes: tuple[str, ...] = ()


@dataclass(frozen=True)
class PlanRequest:
    """What the user asked the planner for."""

    ram_bytes: int
    ctx: int
    kv_slots: int = 1
    disk_bandwidth: float = 0.0            # bytes/s; 0 = unknown
    cap: int = 0                           # force expert slots per layer (0 = from the budget)
    prefill_rows: int = 0                  # the streaming prefill chunk launch will ask for (0 = the default 128)


@dataclass(frozen=True)
class ResourcePlan:
    """The RAM placement of one model under one budget."""

    ram_bytes: int
    dense_bytes: int
    kv_bytes: int
    state_bytes: int
    reserve_bytes: int
    expert_bytes: int                      # bytes of one routed expert as stored
    experts_per_layer: int
    moe_layers: int
    cache_slots_per_layer: int
    cache_bytes: int
    routed_bytes_per_token: int            # read per token when every routed expert misses
    disk_bandwidth: float
    disk_bound_tokens_per_s: float
    fits: bool
    min_ram_bytes: int
    notes: tuple[str, ...] = ()
    # a pipeline that runs its stages one at a time: (stage, bytes it needs while it runs); dense_bytes is the peak
    stages: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class EngineSource:
    """C sources a family ships; core compiles them together with the shared runtime."""

    name: str                              # binary name, e.g. "colibri-olmoe"
    sources: tuple[Path, ...]
    include_dirs: tuple[Path, ...] = ()
    defines: tuple[str, ...] = ()
    runtime_api: int | None = None         # the runtime C API version (CB_RUNTIME_API) the sources are written
                                           # for; the builder refuses another with one line (None: not checked)


@dataclass(frozen=True)
class EngineEnv:
    """Family-specific engine arguments and environment.

    Core adds the arguments every engine takes (model path, context, slots, cache capacity, threads);
    the family adds what only it knows, typically the model's hyperparameters as ``key=value`` pairs.
    """

    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True)
class ConverterSpec:
    """What ``coli convert`` may do to a family's checkpoint (returned by ``converter_spec``).

    Routed experts come from ``tensor_layout``; ``dense_matrices`` names the other 2-D weights that ``--dense``
    applies to. Routers, norms, biases and every other float tensor of the layout are stored as F32; tensors the
    layout does not mention are copied unchanged.
    """

    expert_schemes: tuple[str, ...] = ("int8", "int4")
    dense_schemes: tuple[str, ...] = ("bf16", "f32", "int8", "int4")
    dense_matrices: tuple[str, ...] = ()


@dataclass(frozen=True)
class DemoModel:
    """A checkpoint ``coli demo`` can run (returned by ``demo_model``).

    ``path`` is a complete checkpoint directory the family's engine runs; ``prompt`` is what the demo completes
    by default; ``is_random`` says the weights are random (the demo then warns that the text is noise and ignores
    stop tokens); ``cache_fraction`` is the share of each MoE layer's experts the demo's RAM budget caches, so a
    run really streams experts from disk.
    """

    path: Path
    description: str
    prompt: str
    is_random: bool = False
    cache_fraction: float = 0.25


@dataclass(frozen=True)
class RouteSpec:
    """One HTTP route a family adds to ``coli serve`` (returned by ``server_routes``).

    Core wraps ``handler`` like its own routes: the API key, body limits and cross-site rules apply before it,
    an ``colibri.server.errors.APIError`` it raises becomes the error envelope, anything else a logged 500.
    """

    path: str                                                   # e.g. "/v1/images/generations"
    handler: Callable[[Any], Awaitable[Any]]                    # async (starlette Request) -> Response
    methods: tuple[str, ...] = ("POST",)
    name: str = ""                                              # the metrics/access-log route label


@dataclass(frozen=True)
class PreTokenizerSplit:
    """How a byte-level BPE tokenizer class splits text before its bytes are encoded (``byte_level_split``): what
    transformers' converter for that class builds from ``vocab.json`` + ``merges.txt``."""

    pattern: str | None = None  # a regex each match of which is a piece (isolated); None: GPT-2's own split rule,
    #                             inside the byte-level pre-tokenizer
    nfc: bool = False           # NFC-normalize the text first


@dataclass(frozen=True)
class RunOption:
    """One ``coli run`` flag a family adds for its own task (returned by ``run_options``); its value reaches the
    family's ``run_handler`` under ``name`` (the flag without dashes, ``-`` as ``_``), ``None`` when not given."""

    flag: str                   # e.g. "--negative-prompt"
    help: str
    kind: type = str            # str, int or float
    metavar: str = ""

    @property
    def name(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")
