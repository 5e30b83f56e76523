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
    Claim, FamilyDescriptor, Geometry, Limits, ResolvedModel, ShardSet, TensorLayout,
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


def read_model_index(model_dir: Path) -> dict[str, Any]:
    """The parsed ``model_index.json``; a clear ConfigError when it is missing or malformed."""
    path = Path(model_dir) / MARKER
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror})", "point --model at a diffusers pipeline") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})", "restore model_index.json from the pipeline") from None
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


@hookimpl
def model_geometry(model: ResolvedModel) -> Geometry:
    index = read_model_index(model.path)
    comps = components(model.path)
    notes = [(name, f"{lib}.{cls}") for name, (lib, cls) in comps.items()]
    text = _component_config(model.path, "text_encoder")
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


@hookimpl
def limits(model: ResolvedModel) -> Limits:
    text = _component_config(model.path, "text_encoder")
    return Limits(max_context=int(text.get("max_position_embeddings") or 0), has_engine=False,
                  reason_no_engine=f"no engine for {FAMILY} yet")
