"""The random-weight OLMoE checkpoint of ``coli demo --synthetic`` (and of tests that need a big model fast).

It is deliberately larger than the RAM budget the demo runs it under, so the run really streams routed experts
from disk. Weights are N(0, 1/fan_in) (norms 1 + 0.1·N), drawn with numpy from a fixed seed and written shard by
shard: no torch, no download. Built once into ``<cache_dir>/<spec.name>`` by ``colibri.demo.ensure_directory``
(a temporary directory renamed into place, under a lock).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator


@dataclass(frozen=True)
class DemoSpec:
    """The synthetic model's shape. The default is ~430 MB of f32 with 256 routed experts of 1.5 MiB each."""

    hidden: int = 512
    layers: int = 8
    heads: int = 8
    experts: int = 32
    top_k: int = 4
    expert_width: int = 256
    vocab: int = 4096
    max_context: int = 4096
    layers_per_shard: int = 2
    seed: int = 0
    tokenizer_corpus_bytes: int = 2_000_000
    version: int = 1                      # bump when the layout or the weights' recipe changes

    @property
    def name(self) -> str:
        return (f"olmoe-demo-v{self.version}-h{self.hidden}-l{self.layers}-e{self.experts}k{self.top_k}"
                f"-i{self.expert_width}-v{self.vocab}-s{self.seed}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def expert_bytes(self) -> int:
        return 3 * self.hidden * self.expert_width * 4

    @property
    def total_bytes(self) -> int:
        h, v = self.hidden, self.vocab
        per_layer = 4 * h * h + 4 * h + self.experts * h + self.experts * 3 * h * self.expert_width
        return 4 * (2 * v * h + h + self.layers * per_layer)


def config_json(spec: DemoSpec, eos_id: int, pad_id: int) -> dict:
    return {
        "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe",
        "vocab_size": spec.vocab, "hidden_size": spec.hidden, "intermediate_size": spec.expert_width,
        "num_hidden_layers": spec.layers, "num_attention_heads": spec.heads, "num_key_value_heads": spec.heads,
        "head_dim": spec.head_dim, "hidden_act": "silu", "max_position_embeddings": spec.max_context,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None, "attention_bias": False,
        "attention_dropout": 0.0, "clip_qkv": None, "num_experts": spec.experts,
        "num_experts_per_tok": spec.top_k, "norm_topk_prob": False, "output_router_logits": False,
        "router_aux_loss_coef": 0.01, "tie_word_embeddings": False, "use_cache": True,
        "bos_token_id": None, "eos_token_id": eos_id, "pad_token_id": pad_id, "torch_dtype": "float32",
        "colibri_demo": "synthetic: random weights, not a trained model",
    }


def _layer_tensors(spec: DemoSpec, layer: int, rng) -> Iterator[tuple[str, Any]]:
    import numpy as np

    h, width = spec.hidden, spec.expert_width

    def matrix(rows: int, cols: int):
        return (rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(1 / math.sqrt(cols)))

    def norm(n: int):
        return (1 + 0.1 * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)

    p = f"model.layers.{layer}."
    yield p + "input_layernorm.weight", norm(h)
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        yield f"{p}self_attn.{proj}.weight", matrix(h, h)
    yield p + "self_attn.q_norm.weight", norm(h)       # OLMoE normalises the full projected width
    yield p + "self_attn.k_norm.weight", norm(h)
    yield p + "post_attention_layernorm.weight", norm(h)
    yield p + "mlp.gate.weight", matrix(spec.experts, h)
    for e in range(spec.experts):
        # gate, up, down of one expert adjacent on disk: one expert is one contiguous read.
        q = f"{p}mlp.experts.{e}."
        yield q + "gate_proj.weight", matrix(width, h)
        yield q + "up_proj.weight", matrix(width, h)
        yield q + "down_proj.weight", matrix(h, width)


def write_checkpoint(spec: DemoSpec, out: Path) -> None:
    """Write config, tokenizer and weight shards of ``spec`` into the (new) directory ``out``."""
    import numpy as np

    from colibri.demo_tokenizer import EOS, stdlib_texts, train_bpe, write_tokenizer_files
    from colibri.safetensors_writer import write_safetensors

    out.mkdir(parents=True)
    tok = train_bpe(stdlib_texts(spec.tokenizer_corpus_bytes), spec.vocab, special_tokens=(EOS, "<|padding|>"))
    if tok.get_vocab_size() != spec.vocab:
        # The corpus ran out of merges: pad with unused tokens so the embedding size matches the config.
        tok.add_tokens([f"<|unused_{i}|>" for i in range(spec.vocab - tok.get_vocab_size())])
    write_tokenizer_files(out, tok)
    eos_id, pad_id = tok.token_to_id(EOS), tok.token_to_id("<|padding|>")
    (out / "config.json").write_text(json.dumps(config_json(spec, eos_id, pad_id), indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_id, "pad_token_id": pad_id,
                                                            "do_sample": True, "temperature": 0.8,
                                                            "top_p": 0.95}, indent=2) + "\n")
    rng = np.random.default_rng(spec.seed)
    shards = math.ceil(spec.layers / spec.layers_per_shard) + 1
    weight_map: dict[str, str] = {}
    total = 0

    def shard_name(i: int) -> str:
        return f"model-{i + 1:05d}-of-{shards:05d}.safetensors"

    h = spec.hidden
    embed = [("model.embed_tokens.weight", rng.standard_normal((spec.vocab, h), dtype=np.float32)),
             ("model.norm.weight", (1 + 0.1 * rng.standard_normal(h, dtype=np.float32)).astype(np.float32)),
             ("lm_head.weight", rng.standard_normal((spec.vocab, h), dtype=np.float32) * np.float32(1 / math.sqrt(h)))]
    total += write_safetensors(out / shard_name(0), embed, {"format": "pt"})
    weight_map.update({name: shard_name(0) for name, _ in embed})
    for s in range(1, shards):
        first = (s - 1) * spec.layers_per_shard
        tensors = [t for layer in range(first, min(first + spec.layers_per_shard, spec.layers))
                   for t in _layer_tensors(spec, layer, rng)]
        total += write_safetensors(out / shard_name(s), tensors, {"format": "pt"})
        weight_map.update({name: shard_name(s) for name, _ in tensors})
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "DEMO.md").write_text("Synthetic OLMoE-architecture checkpoint written by `coli demo`.\n"
                                 "The weights are random: whatever it generates is noise.\n"
                                 f"Spec: {json.dumps(asdict(spec))}\n")


def ensure_checkpoint(cache_dir: Path, spec: DemoSpec = DemoSpec()) -> tuple[Path, bool]:
    """The synthetic checkpoint under ``cache_dir``, written now if missing; (path, written_now)."""
    from colibri.demo import ensure_directory

    return ensure_directory(cache_dir / spec.name, lambda out: write_checkpoint(spec, out))
