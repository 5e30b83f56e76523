"""Header-only checkpoints at real scale: every tensor a real release stores, with its true name, shape and dtype,
in safetensors files whose data regions are holes (``truncate``), so a 1.3 TB layout costs a few MB of disk.

The tensor list comes from transformers itself: the model is built from the release's ``config.json`` on the
``meta`` device (no memory) and its state dict is mapped back to the on-disk names with transformers' own
``revert_weight_conversion`` (what ``save_pretrained`` writes: per-expert 2-D tensors, not the fused 3-D ones it
computes with). On top of that, what the release adds that transformers does not build:

* FP8 block quantization (``quantization_config.quant_method == "fp8"``, DeepSeek-V3's format): every 2-D
  projection inside the decoder layers is ``F8_E4M3`` with an F32 ``<name>_scale_inv`` of
  ``ceil(rows / 128) x ceil(cols / 128)``; routers, norms, embeddings and the LM head stay BF16, the routing bias F32;
* with ``mtp=True``, multi-token-prediction layers as DeepSeek-V3 ships them (``num_nextn_predict_layers``): a
  whole decoder layer numbered after the last, plus ``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head.norm``
  (README_WEIGHTS.md of the release).

Use: ``write_layout(config, directory, build_as=..., mtp=...)``; the directory then holds config.json, the shards
and ``model.safetensors.index.json``, as a download would, without a tokenizer. Which release needs which switch
is the caller's knowledge (tests/real_layouts.py): nothing here names a family or a model type.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from ..header_copy import write_sparse_shard

SHARD_BYTES = 5 * 10 ** 9
TORCH_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
NOT_CONFIG = ("quantization_config", "architectures", "auto_map", "model_type", "torch_dtype", "dtype")
FP8_ROUTING_BUFFERS = ("e_score_correction_bias",)


def _build(config: dict[str, Any], build_as: str | None):
    import torch
    import transformers
    from transformers import AutoConfig

    model_type = build_as or config["model_type"]
    fields = {k: v for k, v in config.items() if k not in NOT_CONFIG}
    hf_config = AutoConfig.for_model(model_type, **fields)
    with torch.device("meta"):
        if "text_config" in config:    # a multimodal wrapper: the whole model, as its release stores it
            return transformers.AutoModelForImageTextToText.from_config(hf_config)
        return transformers.AutoModelForCausalLM.from_config(hf_config)


def release_tensors(config: dict[str, Any], build_as: str | None = None,
                    mtp: bool = False) -> dict[str, tuple[tuple[int, ...], str]]:
    """``name -> (shape, safetensors dtype)`` of every tensor the release of ``config`` stores.

    ``build_as``: the transformers model type to build when the release's own is not one transformers knows (a
    release that names its own type for another's architecture); ``mtp``: the release ships its
    ``num_nextn_predict_layers`` multi-token-prediction layers."""
    from transformers.core_model_loading import revert_weight_conversion

    model = _build(config, build_as)
    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False) or config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    state = revert_weight_conversion(model, state)
    dtype = TORCH_DTYPES.get(str(config.get("torch_dtype") or config.get("dtype") or "bfloat16"), "BF16")
    out = {name: (tuple(t.shape), "F32" if name.endswith(FP8_ROUTING_BUFFERS) else dtype)
           for name, t in state.items()}
    if mtp:
        out.update(_mtp_layers(config, out))
    quant = config.get("quantization_config") or {}
    if quant.get("quant_method") == "fp8":
        out = _fp8_blocks(out, tuple(quant.get("weight_block_size") or (128, 128)))
    return out


def _mtp_layers(config: dict[str, Any], tensors: dict[str, tuple[tuple[int, ...], str]]):
    layers, extra = int(config["num_hidden_layers"]), int(config.get("num_nextn_predict_layers") or 0)
    hidden = int(config["hidden_size"])
    last = f"model.layers.{layers - 1}."
    out = {}
    for i in range(layers, layers + extra):
        for name, spec in tensors.items():
            if name.startswith(last):
                out[f"model.layers.{i}." + name[len(last):]] = spec
        dtype = tensors["model.norm.weight"][1]
        out.update({f"model.layers.{i}.enorm.weight": ((hidden,), dtype),
                    f"model.layers.{i}.hnorm.weight": ((hidden,), dtype),
                    f"model.layers.{i}.eh_proj.weight": ((hidden, 2 * hidden), dtype),
                    f"model.layers.{i}.shared_head.norm.weight": ((hidden,), dtype)})
    return out


PROJECTION = re.compile(r"\.layers\.\d+\..*(_proj|_proj_with_mqa)\.weight$")


def _fp8_blocks(tensors, block: tuple[int, int]):
    from ..fp8 import scale_name

    out = {}
    for name, (shape, dtype) in tensors.items():
        if len(shape) == 2 and PROJECTION.search(name):
            out[name] = (shape, "F8_E4M3")
            out[scale_name(name)] = ((math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])), "F32")
        else:
            out[name] = (shape, dtype)
    return out


def _layer_key(name: str) -> tuple[int, str]:
    m = re.search(r"\.layers\.(\d+)\.", name)
    return (int(m.group(1)) + 1 if m else 0, name)


def write_layout(config: dict[str, Any], directory: Path, shard_bytes: int = SHARD_BYTES, build_as: str | None = None,
                 mtp: bool = False) -> Path:
    """config.json, sparse shards of about ``shard_bytes`` each (layer order, as releases are cut) and the index;
    ``build_as`` and ``mtp`` as in :func:`release_tensors`."""
    from ..checkpoint import DTYPE_BYTES

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    tensors = release_tensors(config, build_as, mtp)
    groups: list[list[tuple[str, tuple[int, ...], str, int]]] = [[]]
    size = 0
    for name in sorted(tensors, key=_layer_key):
        shape, dtype = tensors[name]
        nbytes = int(math.prod(shape) * DTYPE_BYTES[dtype])
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, shape, dtype, nbytes))
        size += nbytes
    weight_map, total = {}, 0
    for i, group in enumerate(groups, start=1):
        file = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, shape, dtype, nbytes in group:
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[name] = file
        total += offset
        write_sparse_shard(directory / file, header)
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}), encoding="utf-8")
    return directory
