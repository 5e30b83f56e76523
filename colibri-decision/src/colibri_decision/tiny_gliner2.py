"""A tiny random-weight GLiNER2 checkpoint built with the ``gliner2`` package's own classes (no download): a
DeBERTa-v3-style encoder at small width, GLiNER2's span / classifier / count heads, saved by GLiNER2's own
``save_pretrained`` (``config.json`` with ``model_type: extractor``, ``encoder_config/config.json``,
``model.safetensors``, the tokenizer with GLiNER2's special tokens added).

The tokenizer is a DeBERTa-v3-style one (a Unigram model behind a Metaspace pre-tokenizer, ``[CLS] $A [SEP]``)
trained here on the fixed offline corpus, since no hub access exists.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from colibri.testing.tiny import TinyModel, redraw_weights, stored_elements, training_text

SPECIALS = ("[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]")


def deberta_v3_tokenizer(vocab_size: int = 400) -> Any:
    """A DeBERTa-v3-shaped fast tokenizer (transformers object) trained on the offline corpus."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.Sequence([normalizers.Replace("``", '"'), normalizers.Replace("''", '"')])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    trainer = trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS), unk_token="[UNK]",
                                      show_progress=False)
    corpus = [line.lower() for line in training_text()] + list(training_text())
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]",
                                   unk_token="[UNK]", mask_token="[MASK]", model_max_length=512)


def build_gliner2(out_dir: str | os.PathLike, *, seed: int = 0, dtype: str = "float32",
                  **overrides: Any) -> TinyModel:
    """The checkpoint in ``out_dir``; ``overrides`` go to the DeBERTa config (e.g. ``share_att_key=False``,
    ``position_buckets=-1``). ``num_parameters`` counts every stored tensor (GLiNER2's model as saved)."""
    import torch
    from gliner2.configuration import ExtractorConfig
    from gliner2.models.span.model import SpanExtractorModel
    from transformers import DebertaV2Config

    out = Path(out_dir)
    # deberta-v3-base's shape at small width: relative attention in log buckets, no absolute positions
    enc_fields: dict[str, Any] = dict(
        vocab_size=400, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=512, type_vocab_size=0, relative_attention=True, position_buckets=16,
        max_relative_positions=-1, position_biased_input=False, pos_att_type=["p2c", "c2p"],
        norm_rel_ebd="layer_norm", share_att_key=True, hidden_act="gelu", layer_norm_eps=1e-7)
    enc_fields.update(overrides)
    torch.manual_seed(seed)
    config = ExtractorConfig(model_name="tiny-deberta-v3", max_width=8, counting_layer="count_lstm",
                             token_pooling="first")
    model = SpanExtractorModel(config, encoder_config=DebertaV2Config(**enc_fields),
                               tokenizer=deberta_v3_tokenizer(enc_fields["vocab_size"]))
    redraw_weights(model, seed, salt="gliner2")
    # N(0, 1/fan_in) everywhere makes attention almost uniform and every [L] state alike: sharper queries and a
    # larger classifier output spread the labels' probabilities, so a 1e-4 check can tell a wrong position term.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("query_proj.weight", "key_proj.weight")):
                param.mul_(3.0)
            elif name == "classifier.2.weight":
                param.mul_(4.0)
    if dtype in ("bfloat16", "bf16"):
        model = model.to(torch.bfloat16)
    model.eval()
    model.save_pretrained(str(out))
    num = sum(v.numel() for v in model.state_dict().values())
    return TinyModel(out, "extractor", "extractor", int(num), stored_elements(out))
