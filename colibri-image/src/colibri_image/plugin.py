"""colibri family plugin for diffusers pipeline directories (text-to-image and kin).

A pipeline directory has ``model_index.json`` at its root (``_class_name`` plus one ``[library, class]`` entry per
component) and one subfolder per component; components with weights keep safetensors there
(``diffusion_pytorch_model.safetensors`` for diffusers models, ``model.safetensors`` for transformers ones, either
possibly sharded or with ``.fp16``-style variants). Tensor names are prefixed ``<component>/`` so the UNet's and
the VAE's ``conv_in.weight`` do not clash.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from colibri import hookimpl
from colibri.checkpoint import TensorIndex, read_index
from colibri.errors import ConfigError
from colibri.records import (
    TEXT_TO_IMAGE, Claim, EngineSource, FamilyDescriptor, Geometry, Limits, PreTokenizerSplit, ResolvedModel, ShardSet,
    TensorLayout,
)

FAMILY = "image"
MODEL_TYPE = "diffusers"
MARKER = "model_index.json"


@hookimpl
def describe_family() -> FamilyDescriptor:
    return FamilyDescriptor(FAMILY, (MODEL_TYPE,), "diffusers pipeline directories (model_index.json)")


@hookimpl
def detect_config(model_dir: Path, config: Mapping[str, Any] | None) -> Claim | None:
    # A root config.json with a model_type belongs to a language-model family, even next to a model_index.json.
    if (config and config.get("model_type")) or not (Path(model_dir) / MARKER).is_file():
        return None
    return Claim(FAMILY, MODEL_TYPE, f"{MARKER} present (diffusers pipeline)")


def read_json_object(path: Path, missing_hint: str) -> Any:
    """A pipeline JSON file, parsed; a clear ConfigError naming it when it is missing or not JSON."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror})", missing_hint) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})", f"restore {path.name} from the pipeline") from None


def read_model_index(model_dir: Path) -> dict[str, Any]:
    """The parsed ``model_index.json``; a clear ConfigError when it is missing or malformed."""
    path = Path(model_dir) / MARKER
    data = read_json_object(path, "point --model at a diffusers pipeline")
    if not isinstance(data, dict) or not isinstance(data.get("_class_name"), str):
        raise ConfigError(f"{path}: no '_class_name' naming the pipeline class",
                          "restore model_index.json from the pipeline")
    return data


def components(model_dir: Path) -> dict[str, tuple[str, str]]:
    """Component name -> (library, class) for every component model_index.json names (null ones left out)."""
    out = {}
    for name, value in read_model_index(model_dir).items():
        if name.startswith("_") or not isinstance(value, list) or len(value) != 2 or None in value:
            continue
        out[name] = (str(value[0]), str(value[1]))
    return out


def _variant_rank(path: Path) -> tuple[int, str]:
    # "diffusion_pytorch_model.safetensors" before "diffusion_pytorch_model.fp16.safetensors": one set, not both.
    return (path.name.count("."), path.name)


def _component_shards(directory: Path, prefix: str) -> ShardSet | None:
    indexes = sorted(directory.glob("*.safetensors.index.json"), key=_variant_rank)
    if indexes:
        weight_map = read_index(indexes[0])
        files = tuple(directory / f for f in sorted(set(weight_map.values())))
        return ShardSet(directory, files, indexes[0], prefix)
    found = sorted(directory.glob("*.safetensors"), key=_variant_rank)
    if not found:
        return None
    stem_dots = found[0].name.count(".")
    return ShardSet(directory, tuple(f for f in found if f.name.count(".") == stem_dots)[:1], None, prefix)


@hookimpl
def weight_files(model: ResolvedModel) -> tuple[ShardSet, ...]:
    sets = []
    for name in components(model.path):
        sub = model.path / name
        if sub.is_dir():
            found = _component_shards(sub, f"{name}/")
            if found:
                sets.append(found)
    if not sets:
        raise ConfigError(f"{model.path / MARKER}: no component folder holds safetensors weights",
                          "download the pipeline with its .safetensors files")
    return tuple(sets)


def _component_config(model_dir: Path, name: str) -> dict[str, Any]:
    for fname in ("config.json", "scheduler_config.json"):
        path = model_dir / name / fname
        if path.is_file():
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError):
                raise ConfigError(f"{path}: not valid JSON", "restore the component's config file") from None
            return data if isinstance(data, dict) else {}
    return {}


def _text_config(model_dir: Path) -> dict[str, Any]:
    """The text encoder's config; a multimodal encoder's (Qwen2.5-VL) language part."""
    text = _component_config(model_dir, "text_encoder")
    inner = text.get("text_config")
    return inner if isinstance(inner, dict) else text


@hookimpl
def model_geometry(model: ResolvedModel) -> Geometry:
    index = read_model_index(model.path)
    comps = components(model.path)
    notes = [(name, f"{lib}.{cls}") for name, (lib, cls) in comps.items()]
    text = _text_config(model.path)
    unet = _component_config(model.path, "unet") or _component_config(model.path, "transformer")
    if unet.get("sample_size"):
        notes.append(("latent sample size", str(unet["sample_size"])))
    return Geometry(
        model_type=MODEL_TYPE, architecture=index["_class_name"], attention="—",
        hidden_size=int(text.get("hidden_size") or 0), vocab_size=int(text.get("vocab_size") or 0),
        num_layers=int(text.get("num_hidden_layers") or 0), max_context=int(text.get("max_position_embeddings") or 0),
        notes=tuple(notes),
    )


@hookimpl
def tensor_layout(model: ResolvedModel) -> TensorLayout:
    # Pipelines have no routed experts and no single layout rule across component classes, so roles come from the
    # shard headers (no weight bytes are read): normalisation tensors vs everything else.
    tensors = TensorIndex(weight_files(model))
    names = sorted(tensors.tensors)
    norms = tuple(n for n in names if "norm" in n.rsplit("/", 1)[-1].lower())
    embeddings = tuple(n for n in names if n.endswith("token_embedding.weight"))
    required = tuple(n for n in names if n not in set(norms) | set(embeddings))
    return TensorLayout(embeddings=embeddings, lm_head=None, norms=norms, routers=(), experts=(), required=required)


ENGINE_DIR = Path(__file__).resolve().parent / "engine"
ENGINE_PIPELINES = ("QwenImagePipeline", "QwenImage21Pipeline")
TOKENIZER_FOLDERS = ("tokenizer", "processor")
# The Qwen-Image text encoder's tokenizer/ is a transformers Qwen2Tokenizer saved as vocab.json + merges.txt: NFC,
# its split regex, then byte-level BPE without GPT-2's regex (what transformers' converter builds for the class).
TOKENIZER_CLASSES = ("Qwen2Tokenizer", "Qwen2TokenizerFast")
TOKENIZER_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                   r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
ENGINE_SOURCES = ("image_ops.c", "qwen_image.c", "qwen_image21.c")


def _pipeline_class(model: ResolvedModel | None) -> str | None:
    if model is None:
        return ENGINE_PIPELINES[0]
    cls = model.config.get("_class_name") if model.config else None
    if cls is None and (model.path / MARKER).is_file():
        cls = read_model_index(model.path)["_class_name"]
    return cls if isinstance(cls, str) else None


@hookimpl
def engine_source(model: ResolvedModel | None) -> EngineSource | None:
    if _pipeline_class(model) not in ENGINE_PIPELINES:
        return None
    return EngineSource("colibri-qwen-image", tuple(ENGINE_DIR / name for name in ENGINE_SOURCES), runtime_api=1)


@hookimpl
def limits(model: ResolvedModel) -> Limits:
    text = _text_config(model.path)
    has_engine = engine_source(model) is not None
    return Limits(max_context=int(text.get("max_position_embeddings") or 0), has_engine=has_engine,
                  reason_no_engine="" if has_engine else
                  f"the engine runs {', '.join(ENGINE_PIPELINES)} only, not {_pipeline_class(model)}")


@hookimpl
def model_task(model: ResolvedModel) -> str:
    return TEXT_TO_IMAGE


@hookimpl
def byte_level_split(tokenizer_class: str) -> PreTokenizerSplit | None:
    return PreTokenizerSplit(TOKENIZER_SPLIT, nfc=True) if tokenizer_class in TOKENIZER_CLASSES else None


@hookimpl
def load_tokenizer(model: ResolvedModel) -> Any:
    # diffusers keeps the tokenizer in its own component folder (tokenizer/, or processor/ for pipelines whose text
    # encoder takes a multimodal processor, as Qwen-Image-2.1); there is no chat template to look for
    from colibri.tokenizer import load_tokenizer_dir

    for name in TOKENIZER_FOLDERS:
        folder = model.path / name
        if folder.is_dir():
            return load_tokenizer_dir(folder, None)
    return None


@hookimpl
def run_options() -> list[Any]:
    from .cli import run_options as options

    return options()


@hookimpl
def run_handler(model: ResolvedModel, prompt: str, options: Mapping[str, Any]) -> int:
    from .cli import run

    return run(model, prompt, options)


@hookimpl
def server_routes(model: ResolvedModel, options: Mapping[str, Any]) -> Any:
    from .serve import routes

    return routes(model, options)


RUNTIME_RESERVE = 64 * 1024 * 1024


def stage_bytes(tensors: Any) -> tuple[tuple[str, int], ...]:
    """What each engine stage holds while it runs: the tensors it loads, at the size it keeps them (matrices as
    stored, the VAE's convolutions and every norm in f32), plus the runtime's reserve. The text stage loads the
    language model only (not the vision tower); the VAE stage the decoder and post_quant_conv only."""
    sizes = {"text_encoder": 0, "transformer": 0, "vae": 0}
    for t in tensors:
        component, _, name = t.name.partition("/")
        if component == "text_encoder" and ("visual" in name or name.startswith("lm_head")):
            continue
        if component == "vae" and not (name.startswith("decoder.") or name.startswith("post_quant_conv.")):
            continue
        if component in sizes:
            sizes[component] += t.numel * 4 if component == "vae" or len(t.shape) < 2 else t.nbytes
    return tuple((name, size + RUNTIME_RESERVE) for name, size in sizes.items() if size)


@hookimpl
def plan_resources(model: ResolvedModel, request: Any, geometry: Geometry, layout: Any, tensors: Any) -> Any:
    from colibri.records import ResourcePlan

    stages = stage_bytes(tensors)
    peak = max((size for _, size in stages), default=0)
    return ResourcePlan(
        ram_bytes=request.ram_bytes, dense_bytes=peak - RUNTIME_RESERVE if peak else 0, kv_bytes=0, state_bytes=0,
        reserve_bytes=RUNTIME_RESERVE, expert_bytes=0, experts_per_layer=0, moe_layers=0, cache_slots_per_layer=0,
        cache_bytes=0, routed_bytes_per_token=0, disk_bandwidth=request.disk_bandwidth, disk_bound_tokens_per_s=0.0,
        fits=request.ram_bytes >= peak, min_ram_bytes=peak, stages=stages,
        notes=("stages run one at a time and free their weights: the peak is the largest stage",))
