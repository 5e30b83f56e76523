"""The tensor names a Hugging Face MoE decoder checkpoint uses, assembled once for every family's ``tensor_layout``.

Families whose checkpoints follow transformers' decoder naming (``model.layers.{i}.``, ``input_layernorm``,
``mlp.experts.{e}.gate_proj``, DeepSeek-style multi-head latent attention, ``model.norm``, a tied or separate
``lm_head``) build their :class:`~colibri.records.TensorLayout` from these pieces and add only what is theirs.
Nothing here knows a family: the caller says which pieces a layer has.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from . import fp8, source_quant
from .configs import layer_range_prefixes
from .convert.spec import spec_from_layout
from .records import ConverterSpec, ExpertTensors, TensorLayout

GATE_UP_DOWN = ("gate", "up", "down")
# An expert's (gate, up, down) weights under transformers' names, and under the w1/w3/w2 names of DeepSeek's and
# Moonshot's reference code.
EXPERT_PROJ = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")
EXPERT_W = ("w1.weight", "w3.weight", "w2.weight")


def projections(prefix: str, kinds: Iterable[str] = GATE_UP_DOWN) -> list[str]:
    """``{prefix}{kind}_proj.weight`` for each kind (a dense SwiGLU MLP by default)."""
    return [f"{prefix}{kind}_proj.weight" for kind in kinds]


def mla_attention(sa: str, q_lora: int, bias: bool = False, indexer: bool = False) -> tuple[list[str], list[str]]:
    """(norms, required weights) of multi-head latent attention under ``sa`` (``...self_attn.``): the q path
    low-rank when ``q_lora`` is non-zero, the compressed kv path, the output; ``bias`` adds the biases DeepSeek's
    ``attention_bias`` names; ``indexer`` the DSA lightning indexer."""
    norms, req = [sa + "kv_a_layernorm.weight"], []
    if q_lora:
        norms.append(sa + "q_a_layernorm.weight")
        req += [sa + "q_a_proj.weight", sa + "q_b_proj.weight"] + ([sa + "q_a_proj.bias"] if bias else [])
    else:
        req.append(sa + "q_proj.weight")
    req += [sa + "kv_a_proj_with_mqa.weight", sa + "kv_b_proj.weight", sa + "o_proj.weight"]
    if bias:
        req += [sa + "kv_a_proj_with_mqa.bias", sa + "o_proj.bias"]
    if indexer:
        ix = sa + "indexer."
        norms.append(ix + "k_norm.weight")
        req += [ix + "wq_b.weight", ix + "wk.weight", ix + "k_norm.bias", ix + "weights_proj.weight"]
    return norms, req



def indexer_f32_spec(layout: TensorLayout) -> ConverterSpec | None:
    """Core's converter spec with the DSA lightning indexer (``mla_attention(..., indexer=True)``) kept F32 like a
    router: its hard top-k over keys flips when rounding moves its scores, changing which keys attention sees
    (docs/formats.md, "Quality, measured")."""
    return spec_from_layout(layout, selectors=(n for n in layout.required if ".indexer." in n))

@dataclass
class LayoutParts:
    """A decoder's tensor roles, gathered layer by layer, then frozen into a TensorLayout by :meth:`layout`."""

    norms: list[str] = field(default_factory=lambda: ["model.norm.weight"])
    routers: list[tuple[int, str]] = field(default_factory=list)
    experts: list[ExpertTensors] = field(default_factory=list)
    required: list[str] = field(default_factory=list)
    buffers: list[str] = field(default_factory=list)
    packed_int4: list[str] = field(default_factory=list)   # I32 tensors holding eight int4 values each

    def layer(self, p: str, attention: tuple[list[str], list[str]]) -> None:
        """Layer ``p``'s two decoder norms and its attention's (norms, required weights)."""
        self.norms += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        self.norms += attention[0]
        self.required += attention[1]

    def moe(self, layer: int, m: str, experts: int, shared: int, expert_names: tuple[str, ...] = EXPERT_PROJ,
            bias: str | None = "gate.e_score_correction_bias", shared_names: tuple[str, ...] = EXPERT_PROJ) -> None:
        """A routed MoE block under ``m`` (``...mlp.``): the router ``gate.weight``; its ``bias`` (the selection
        bias or a hash table: a buffer in transformers, not a parameter) unless None; ``experts`` experts with
        ``expert_names`` (gate, up, down) each; and, when ``shared``, the always-on shared experts'
        ``shared_names``."""
        self.routers.append((layer, m + "gate.weight"))
        if bias is not None:
            self.buffers.append(m + bias)
        for e in range(experts):
            q = f"{m}experts.{e}."
            self.experts.append(ExpertTensors(layer, e, tuple(q + name for name in expert_names)))
        if shared:
            self.required += [f"{m}shared_experts.{name}" for name in shared_names]

    def layout(self, config: Mapping[str, Any], layers: int, nextn: int = 0, head: str = "lm_head.weight",
               skipped: tuple[str, ...] = ()) -> TensorLayout:
        """The TensorLayout: ``model.embed_tokens`` and ``head`` unless ``tie_word_embeddings``; the ``nextn``
        multi-token-prediction layers stored after the last decoder layer (and ``skipped``) left out."""
        tied = bool(config.get("tie_word_embeddings", False))
        return TensorLayout(
            embeddings=("model.embed_tokens.weight",) if tied else ("model.embed_tokens.weight", head),
            lm_head=None if tied else head, norms=tuple(self.norms), routers=tuple(self.routers),
            experts=tuple(self.experts), required=tuple(self.required), buffers=tuple(self.buffers),
            skipped_prefixes=layer_range_prefixes("model.layers.", layers, nextn) + skipped,
            packed_int4=tuple(self.packed_int4), paged=() if tied else ("model.embed_tokens.weight",))

    def _dense(self, config: Mapping[str, Any], head: str) -> list[str]:
        tied = bool(config.get("tie_word_embeddings", False))
        return self.required + ["model.embed_tokens.weight"] + ([] if tied else [head]) + [n for _, n in self.routers]

    def add_fp8_scales(self, model_dir: Path, config: Mapping[str, Any], head: str = "lm_head.weight") -> None:
        """Block-FP8 checkpoints: each weight with a ``weight_scale_inv`` companion on disk gets it. Which weights
        are fp8 is read from the checkpoint, never from names; an expert's scales belong to its bytes (a cache slot
        holds them); scales are buffers, not parameters (colibri.fp8)."""
        self.experts, scales = fp8.with_scales(fp8.tensor_names(model_dir), self._dense(config, head), self.experts)
        self.buffers += scales

    def add_source_quant(self, model_dir: Path, config: Mapping[str, Any], where: str,
                         head: str = "lm_head.weight") -> None:
        """The weights as a quantized release stores them (colibri.source_quant): FP8 scale companions, or int4
        pack-quantized routed experts (their ``_packed`` tensors, scales and shapes); unquantized: unchanged."""
        stored = source_quant.quantized_layout(config, where, model_dir, self._dense(config, head), self.experts)
        self.experts = list(stored.experts)
        self.buffers += stored.buffers
        self.packed_int4 += stored.packed_int4
