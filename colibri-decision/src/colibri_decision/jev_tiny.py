"""Tiny random-weight JEV checkpoints for tests (``tiny_model("jev" | "jev-beside", ...)``), built with
transformers' own classes: ``jev`` is a ``JevForDecision`` saved with ``save_pretrained`` (config.json model_type
jev, ``decision.json``); ``jev-beside`` is a ``qwen3_5_text`` causal LM with a JEV head next to it
(``head.safetensors``, ``judge_config.json``, ``calibration.json``), as the hub's JEV releases ship it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from colibri.testing.tiny import VOCAB, TinyModel, hybrid_layer_types, redraw_weights, stored_elements, train_tokenizer


NUM_VERBALIZERS = 24
RANGES = {"noul": [0, 2], "score": [2, 8], "choice": [8, 24]}


def _style() -> Any:
    from .tiny import STYLE   # not at import: tiny registers these builders when it is imported

    return STYLE


def backbone_fields(n: int = 4, **overrides: Any) -> dict[str, Any]:
    """A Qwen3.5 dense text config: 3 Gated DeltaNet layers and 1 gated full-attention layer, a dense MLP; any
    field can be overridden (the benchmark's ~300 M model widens them all)."""
    return dict(dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=n, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
                     linear_num_key_heads=2, linear_num_value_heads=4, intermediate_size=128,
                     layer_types=hybrid_layer_types(n), max_position_embeddings=4096), **overrides)


def build_jev(out_dir: str | os.PathLike, *, seed: int = 0, dtype: str = "float32", **overrides: Any) -> TinyModel:
    """A saved ``JevForDecision``: ``softcap`` (default 3.0) and ``offsets`` go to the JevConfig, ``decision``
    (a DecisionConfig's fields) to its decision.json, the rest to the backbone."""
    import torch
    from transformers import DecisionConfig, JevConfig, JevForDecision

    out = Path(out_dir)
    head = {k: overrides.pop(k) for k in ("softcap", "offsets") if k in overrides}
    decision = overrides.pop("decision", {})
    ids = train_tokenizer(out, _style(), VOCAB, 4096)
    text = backbone_fields(**overrides)
    config = JevConfig(text_config={"model_type": "qwen3_5_text", **text,
                                    "pad_token_id": ids["pad"], "eos_token_id": ids["eos"]},
                       hidden_size=text["hidden_size"], num_verbalizers=NUM_VERBALIZERS,
                       softcap=head.get("softcap", 3.0),
                       offsets=head.get("offsets"))
    torch.manual_seed(seed)
    model = JevForDecision(config)
    redraw_weights(model, seed, salt="jev")
    model.decision_config = DecisionConfig(**decision)
    if dtype in ("bfloat16", "bf16"):
        model.to(torch.bfloat16)
    model.save_pretrained(str(out))
    return TinyModel(out, "jev", "jev", int(model.num_parameters()), stored_elements(out))


def build_jev_beside(out_dir: str | os.PathLike, *, seed: int = 0, dtype: str = "float32",
                     **overrides: Any) -> TinyModel:
    """A ``qwen3_5_text`` checkpoint with a JEV head beside it; ``softcap`` (default 3.0, None: none),
    ``temperatures`` (calibration.json per_kind) and ``head_file`` (``head.safetensors`` with proj.weight and
    proj.bias, or ``readout.safetensors`` with the weight alone) choose the head; ``max_shard_size`` shards the LM
    (with an index that does not name the head's file)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(out_dir)
    softcap = overrides.pop("softcap", 3.0)
    temperatures = overrides.pop("temperatures", {"noul": 0.5, "score": 1.0, "choice": 2.0})
    head_file = overrides.pop("head_file", "head.safetensors")
    max_shard_size = overrides.pop("max_shard_size", None)   # e.g. "200KB": a sharded LM with an index
    ids = train_tokenizer(out, _style(), VOCAB, 4096)
    torch.manual_seed(seed)
    lm = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "qwen3_5_text", **backbone_fields(**overrides), pad_token_id=ids["pad"], eos_token_id=ids["eos"]))
    redraw_weights(lm, seed, salt="jev-beside")
    target = torch.bfloat16 if dtype in ("bfloat16", "bf16") else torch.float32
    lm.to(target)
    lm.save_pretrained(str(out), **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    proj = torch.nn.Linear(lm.config.hidden_size, NUM_VERBALIZERS)
    redraw_weights(proj, seed, salt="jev-head")
    tensors = {"proj.weight": proj.weight, "proj.bias": proj.bias} if head_file == "head.safetensors" else \
        {"weight": proj.weight}
    save_file({k: v.detach().to(target).contiguous() for k, v in tensors.items()}, str(out / head_file))
    judge: dict[str, Any] = {"slots": {"verbalizers": [f"<v{i}>" for i in range(NUM_VERBALIZERS)],
                                       "num_slots": NUM_VERBALIZERS, "ranges": RANGES}}
    if softcap is not None:
        judge["softcap"] = softcap
    (out / "judge_config.json").write_text(json.dumps(judge, indent=2), encoding="utf-8")
    (out / "calibration.json").write_text(json.dumps({"per_kind": temperatures}, indent=2), encoding="utf-8")
    num = int(lm.model.num_parameters()) + sum(v.numel() for v in tensors.values())
    return TinyModel(out, "jev-beside", "qwen3_5_text", num, stored_elements(out))


TINY_MODELS = {"jev": build_jev, "jev-beside": build_jev_beside}
