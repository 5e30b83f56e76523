"""Tiny random-weight decision checkpoints for tests (``colibri.testing.tiny.tiny_model("extractor" | "laya" |
"gliner2", ...)``): a GLiNER2-style transformers encoder plus span/classifier heads, a Laya checkpoint built with
laya's classes, and a GLiNER2 checkpoint built with gliner2's (tiny_gliner2.py).

Registered under the entry-point group ``colibri.testing.tiny``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from colibri.testing.tiny import (
    VOCAB, ChatStyle, TinyModel, redraw_weights, stored_elements, train_tokenizer, write_json,
)

from .tiny_gliner2 import build_gliner2   # a GLiNER2 checkpoint, built by the gliner2 package's own classes

# The encoder's tokenizer: a byte-level BPE with end-of-text and padding tokens (the heads never read a chat
# template; one is written so the checkpoint looks like any other).
STYLE = ChatStyle(("<|endoftext|>", "<|padding|>", "<|system|>", "<|user|>", "<|assistant|>"),
                  "<|endoftext|>", "<|endoftext|>", "<|padding|>",
                  "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '\\n' }}{% endfor %}")


# A Laya checkpoint's tokenizer is ModernBERT's: [CLS] / [SEP] / [MASK] / [PAD] / [UNK] specials (laya's sequences are
# built from the first three), no chat template that anything reads.
LAYA_STYLE = ChatStyle(("[CLS]", "[SEP]", "[MASK]", "[PAD]", "[UNK]"), None, "[SEP]", "[PAD]", STYLE.template)
LAYA_SPECIALS = {"cls_token": "[CLS]", "sep_token": "[SEP]", "mask_token": "[MASK]", "unk_token": "[UNK]"}
# What rl_agent_config.json says besides the head: the sequence budget (laya's defaults are 512 / 192; the tiny
# encoder has 128 positions) and calibrated temperatures per question type (choice, score, noul) and per
# type-and-option-count bucket, so the answers go through laya's temperature path.
LAYA_AGENT = {"max_len": 128, "head_max_len": 64, "temperature": [1.7, 0.6, 2.5],
              "temperature_by_options": {"choice:3-5": 0.8}}


EXTRACTOR_HEADS: dict[str, tuple[str, ...]] = {
    # GLiNER2-style heads over the encoder's hidden states: a span representation (start/end projections fused by
    # an MLP), a classifier scoring each (span or [CLS], label) pair, and a count predictor for structures.
    "span_rep.project_start": ("0.weight", "0.bias", "3.weight", "3.bias"),
    "span_rep.project_end": ("0.weight", "0.bias", "3.weight", "3.bias"),
    "span_rep.out_project": ("0.weight", "0.bias", "3.weight", "3.bias"),
    "classifier": ("0.weight", "0.bias", "2.weight", "2.bias"),
    "count_pred": ("0.weight", "0.bias", "2.weight", "2.bias"),
}


def build_extractor(out_dir: str | os.PathLike, *, seed: int = 0, dtype: str = "float32",
                    **overrides: Any) -> TinyModel:
    """A GLiNER2-style decision checkpoint: tiny encoder (``encoder.*``) + span/classifier heads.

    ``encoder="bert"`` (default) or ``"deberta-v2"`` (what GLiNER2 ships) picks the encoder; other ``overrides`` go
    to the encoder config (e.g. ``num_hidden_layers=3``); ``max_width`` and ``max_count`` set the head geometry.
    ``num_parameters`` = encoder parameters + head parameters.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import BertConfig, BertModel, DebertaV2Config, DebertaV2Model

    out = Path(out_dir)
    encoder_kind = str(overrides.pop("encoder", "bert"))
    max_width = int(overrides.pop("max_width", 8))
    max_count = int(overrides.pop("max_count", 20))
    enc_fields: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=64, max_position_embeddings=128)
    torch.manual_seed(seed)
    if encoder_kind == "bert":
        enc_fields.update(type_vocab_size=2, **overrides)
        enc_config = BertConfig(**enc_fields)
        encoder = BertModel(enc_config, add_pooling_layer=False)
    elif encoder_kind == "deberta-v2":
        # deberta-v3-base style: relative attention, no absolute positions, no token types
        enc_fields.update(type_vocab_size=0, relative_attention=True, position_buckets=16, max_relative_positions=-1,
                          position_biased_input=False, pos_att_type=["p2c", "c2p"], norm_rel_ebd="layer_norm",
                          share_att_key=True, **overrides)
        enc_config = DebertaV2Config(**enc_fields)
        encoder = DebertaV2Model(enc_config)
    else:
        raise ValueError(f"encoder {encoder_kind!r}: use 'bert' or 'deberta-v2'")
    redraw_weights(encoder, seed, salt="extractor")
    h = enc_config.hidden_size
    head_shapes = {
        "span_rep.project_start": ((4 * h, h), (4 * h,), (h, 4 * h), (h,)),
        "span_rep.project_end": ((4 * h, h), (4 * h,), (h, 4 * h), (h,)),
        "span_rep.out_project": ((4 * h, 2 * h), (4 * h,), (h, 4 * h), (h,)),
        "classifier": ((2 * h, h), (2 * h,), (1, 2 * h), (1,)),
        "count_pred": ((2 * h, h), (2 * h,), (max_count, 2 * h), (max_count,)),
    }
    heads = torch.nn.ParameterDict()
    for module, leaves in EXTRACTOR_HEADS.items():
        for leaf, shape in zip(leaves, head_shapes[module]):
            heads[f"{module}.{leaf}".replace(".", "__")] = torch.nn.Parameter(torch.zeros(shape))
    redraw_weights(heads, seed, salt="extractor-heads")
    tensors: dict[str, Any] = {f"encoder.{k}": v for k, v in encoder.state_dict().items()}
    tensors.update({k.replace("__", "."): v.data for k, v in heads.items()})
    target = torch.bfloat16 if dtype in ("bfloat16", "bf16") else torch.float32
    tensors = {k: (v.detach().to(target) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    enc_dict = enc_config.to_dict()
    for key in ("transformers_version", "_name_or_path", "architectures"):
        enc_dict.pop(key, None)
    write_json(out / "config.json", {
        "model_type": "extractor", "model_name": f"tiny-{encoder_kind}", "encoder_config": enc_dict,
        "max_width": max_width, "counting_layer": "count_lstm", "max_count": max_count,
        "hidden_size": h, "token_pooling": "first",
    })
    train_tokenizer(out, STYLE, VOCAB, enc_fields["max_position_embeddings"])
    num = sum(p.numel() for p in encoder.parameters()) + sum(p.numel() for p in heads.parameters())
    return TinyModel(out, "extractor", "extractor", int(num), stored_elements(out))


def build_laya(out_dir: str | os.PathLike, *, seed: int = 0, dtype: str = "float32", **overrides: Any) -> TinyModel:
    """A Laya checkpoint built with the ``laya`` package's own classes: ``rl_agent_config.json``, a tiny ModernBERT
    described by ``encoder/config.json``, ``model.safetensors`` (encoder + decision heads) and ``tokenizer/``.

    ``overrides`` go to the encoder config; ``head_layers`` sets the decision head's depth (default 1), and the keys
    of ``LAYA_AGENT`` (``max_len``, ``temperature``, ...) override rl_agent_config.json's.
    """
    import torch
    from laya.common import build_model
    from safetensors.torch import save_file
    from transformers import ModernBertConfig

    out = Path(out_dir)
    head_layers = int(overrides.pop("head_layers", 1))
    agent = {key: overrides.pop(key, value) for key, value in LAYA_AGENT.items()}
    enc = ModernBertConfig(**{**dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=96, max_position_embeddings=128, global_attn_every_n_layers=2,
                                     local_attention=16, pad_token_id=3, bos_token_id=0, eos_token_id=1,
                                     cls_token_id=0, sep_token_id=1), **overrides})
    (out / "encoder").mkdir(parents=True, exist_ok=True)
    enc.save_pretrained(out / "encoder")
    cfg = {"encoder": "answerdotai/ModernBERT-base", "head_layers": head_layers, "act_costs": {}, **agent}
    torch.manual_seed(seed)
    model = build_model(cfg, encoder_dir=str(out / "encoder"), pretrained=False)
    redraw_weights(model, seed, salt="laya")
    target = torch.bfloat16 if dtype in ("bfloat16", "bf16") else torch.float32
    tensors = {k: (v.detach().to(target) if v.is_floating_point() else v).contiguous()
               for k, v in model.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    write_json(out / "rl_agent_config.json", cfg)
    train_tokenizer(out / "tokenizer", LAYA_STYLE, VOCAB, enc.max_position_embeddings)
    tok_config = json.loads((out / "tokenizer" / "tokenizer_config.json").read_text(encoding="utf-8"))
    write_json(out / "tokenizer" / "tokenizer_config.json", {**tok_config, **LAYA_SPECIALS})
    num = sum(v.numel() for v in tensors.values())   # parameters and the calibration buffer (temperature)
    return TinyModel(out, "laya", "laya", int(num), stored_elements(out))


def _jev_models() -> dict[str, Any]:
    from .jev_tiny import TINY_MODELS as JEV

    return JEV


TINY_MODELS = {"extractor": build_extractor, "laya": build_laya, "gliner2": build_gliner2, **_jev_models()}
