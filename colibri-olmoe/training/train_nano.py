#!/usr/bin/env python3
"""Train colibri-nano: a small OLMoE-architecture code-completion model on the Python standard library.

Everything is derived from the running interpreter's standard library sources (``sysconfig``'s ``stdlib`` path,
``*.py`` outside ``site-packages`` and outside test suites; PSF-2.0 licensed), so the run needs no download:

1. the files are split deterministically into train / held-out by a hash of their relative path;
2. a byte-level BPE tokenizer is trained on the train files with ``tokenizers``;
3. an ``OlmoeForCausalLM`` (transformers) is trained on CPU with AdamW, linear warm-up + cosine decay and the
   load-balancing auxiliary loss (``output_router_logits=True``, ``router_aux_loss_coef``), so experts specialise
   while routing stays spread;
4. the checkpoint is saved with ``save_pretrained`` (bf16 by default: what ``coli demo`` ships), with the
   tokenizer files, a generation config, ``metrics.json`` (held-out perplexity, steps, tokens, wall time, seed,
   first-step loss), ``train_log.jsonl`` and ``loss_curve.png``.

The defaults are exactly the run that produced ``colibri_olmoe/nano/`` (see its MODEL_CARD.md); on 2 shared CPU
cores it took the wall time recorded in metrics.json, and on any 2+ core machine it finishes well under two hours.
Reproducibility: same Python (stdlib version), torch and tokenizers versions, seed and thread count give the same
first-step loss (checked by ``tests/test_nano_training.py``); later steps may drift in the last bits with thread
scheduling. ``--steps 1 --tokenizer <dir>`` reproduces only the first step, quickly.

Usage::

    python colibri-olmoe/training/train_nano.py --out /tmp/nano            # the full run
    python colibri-olmoe/training/train_nano.py --out /tmp/x --steps 1 --tokenizer colibri-olmoe/src/colibri_olmoe/nano

Needs torch, transformers, tokenizers, safetensors and matplotlib (for the plot); none of them is a runtime
dependency of colibri.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

EOS = "<|endoftext|>"
PAD = "<|padding|>"
TEST_DIRS = {"test", "tests", "idle_test"}


@dataclass(frozen=True)
class RunConfig:
    seed: int = 0
    vocab: int = 8192
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    experts: int = 32
    top_k: int = 2
    expert_width: int = 192
    seq: int = 256
    batch: int = 8
    steps: int = 1500
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 60
    weight_decay: float = 0.1
    aux_coef: float = 0.01
    grad_clip: float = 1.0
    heldout_percent: int = 5
    eval_windows: int = 32
    threads: int = 1      # one: on a shared 2-core box, two OpenMP threads ran 5x slower (spin-waiting)
    max_context: int = 2048


# ---------------------------------------------------------------------------------------------------------------
# Corpus

def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path | None = None) -> list[tuple[str, Path]]:
    """(relative path, path) of every library source file, sorted by relative path."""
    root = root or stdlib_root()
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if "site-packages" in rel.parts or TEST_DIRS & set(rel.parts[:-1]):
            continue
        out.append((rel.as_posix(), path))
    return sorted(out)


def is_heldout(rel: str, percent: int) -> bool:
    return int(hashlib.sha256(rel.encode()).hexdigest(), 16) % 100 < percent


def read_texts(files: list[tuple[str, Path]]) -> list[tuple[str, str]]:
    texts = []
    for rel, path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if text.strip():
            texts.append((rel, text))
    return texts


def split_corpus(cfg: RunConfig) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    texts = read_texts(corpus_files())
    train = [t for t in texts if not is_heldout(t[0], cfg.heldout_percent)]
    held = [t for t in texts if is_heldout(t[0], cfg.heldout_percent)]
    return train, held


# ---------------------------------------------------------------------------------------------------------------
# Tokenizer

def train_tokenizer(texts: list[str], vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def write_tokenizer_files(out: Path, tok, max_context: int) -> None:
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": EOS,
              "pad_token": PAD, "unk_token": None, "model_max_length": max_context,
              "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------------------------
# Batches: byte-size-weighted file choice, a random window that runs on into the following files (EOS between).

class Sampler:
    def __init__(self, tok, texts: list[tuple[str, str]], seq: int, seed: int):
        import numpy as np

        self.np = np
        self.tok, self.texts, self.seq = tok, texts, seq
        self.eos = tok.token_to_id(EOS)
        sizes = np.array([len(t) for _, t in texts], dtype=np.float64)
        self.weights = sizes / sizes.sum()
        self.rng = np.random.default_rng(seed)
        self.cache: dict[int, "object"] = {}

    def tokens(self, i: int):
        if i not in self.cache:
            ids = self.tok.encode(self.texts[i][1]).ids + [self.eos]
            self.cache[i] = self.np.asarray(ids, dtype=self.np.int32)
        return self.cache[i]

    def window(self):
        np = self.np
        i = int(self.rng.choice(len(self.texts), p=self.weights))
        first = self.tokens(i)
        start = int(self.rng.integers(0, len(first)))
        parts, have, j = [first[start:]], len(first) - start, i
        while have < self.seq + 1:
            j = (j + 1) % len(self.texts)
            parts.append(self.tokens(j))
            have += len(parts[-1])
        return np.concatenate(parts)[: self.seq + 1]

    def batch(self, n: int):
        import torch

        return torch.from_numpy(self.np.stack([self.window() for _ in range(n)]).astype("int64"))


def eval_windows(tok, texts: list[tuple[str, str]], seq: int, limit: int):
    """Consecutive non-overlapping windows over the held-out files in path order (deterministic)."""
    import torch

    eos = tok.token_to_id(EOS)
    stream: list[int] = []
    for _, text in texts:
        stream += tok.encode(text).ids + [eos]
        if len(stream) >= limit * (seq + 1):
            break
    n = min(limit, len(stream) // (seq + 1))
    return torch.tensor(stream[: n * (seq + 1)]).view(n, seq + 1)


# ---------------------------------------------------------------------------------------------------------------
# Model

def build_model(cfg: RunConfig, eos_id: int, pad_id: int):
    import torch
    from transformers import OlmoeConfig, OlmoeForCausalLM

    config = OlmoeConfig(
        vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.expert_width,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.heads,
        max_position_embeddings=cfg.max_context, num_experts=cfg.experts, num_experts_per_tok=cfg.top_k,
        norm_topk_prob=False, router_aux_loss_coef=cfg.aux_coef, output_router_logits=False,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=eos_id, pad_token_id=pad_id,
        rope_theta=10000.0, rms_norm_eps=1e-5)
    torch.manual_seed(cfg.seed)
    return OlmoeForCausalLM(config)


def lm_and_aux_loss(model, batch):
    out = model(input_ids=batch[:, :-1], labels=batch[:, :-1], output_router_logits=True)
    # transformers shifts labels itself, so labels == inputs predicts token t+1 from tokens <= t.
    aux = out.aux_loss if out.aux_loss is not None else 0.0
    lm = out.loss - model.config.router_aux_loss_coef * aux
    return out.loss, lm, aux


def lr_at(step: int, cfg: RunConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def heldout_loss(model, windows, batch: int = 16) -> float:
    import torch

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(windows), batch):
            chunk = windows[i:i + batch]
            out = model(input_ids=chunk[:, :-1], labels=chunk[:, :-1])
            n = chunk.shape[0] * (chunk.shape[1] - 2)
            total += float(out.loss) * n
            count += n
    model.train()
    return total / count


def first_step_loss(cfg: RunConfig, tok) -> float:
    """The language-model loss of the first training batch at initialisation (what metrics.json records)."""
    import torch

    torch.set_num_threads(cfg.threads)
    train, _ = split_corpus(cfg)
    model = build_model(cfg, tok.token_to_id(EOS), tok.token_to_id(PAD))
    sampler = Sampler(tok, train, cfg.seq, cfg.seed)
    with torch.no_grad():
        _, lm, _ = lm_and_aux_loss(model, sampler.batch(cfg.batch))
    return float(lm)


def plot(log: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in log if "lm_loss" in r], [r["lm_loss"] for r in log if "lm_loss" in r],
            label="train LM loss", linewidth=0.8)
    evals = [r for r in log if "heldout_loss" in r]
    ax.plot([r["step"] for r in evals], [r["heldout_loss"] for r in evals], "o-", label="held-out loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("colibri-nano training (Python stdlib)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def train(cfg: RunConfig, out: Path, tokenizer_dir: Path | None, dtype: str, eval_every: int) -> dict:
    import torch
    from tokenizers import Tokenizer

    torch.set_num_threads(cfg.threads)
    started = time.time()
    out.mkdir(parents=True, exist_ok=True)
    train_texts, held_texts = split_corpus(cfg)
    print(f"corpus: {len(train_texts)} train files, {len(held_texts)} held-out files", flush=True)
    if tokenizer_dir is not None:
        tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    else:
        tok = train_tokenizer([t for _, t in train_texts], cfg.vocab)
    if tok.get_vocab_size() != cfg.vocab:
        raise SystemExit(f"tokenizer has {tok.get_vocab_size()} tokens, config wants {cfg.vocab}")
    write_tokenizer_files(out, tok, cfg.max_context)
    eos_id, pad_id = tok.token_to_id(EOS), tok.token_to_id(PAD)
    model = build_model(cfg, eos_id, pad_id)
    model.train()
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.1f} M parameters", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    sampler = Sampler(tok, train_texts, cfg.seq, cfg.seed)
    windows = eval_windows(tok, held_texts, cfg.seq, cfg.eval_windows)
    log: list[dict] = []
    log_file = (out / "train_log.jsonl").open("w")
    first_loss = None
    tokens_seen = 0
    t0 = time.time()
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        batch = sampler.batch(cfg.batch)
        loss, lm, aux = lm_and_aux_loss(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        tokens_seen += batch.shape[0] * (batch.shape[1] - 1)
        if first_loss is None:
            first_loss = float(lm.detach())
        record = {"step": step + 1, "lm_loss": round(float(lm.detach()), 5), "aux_loss": round(float(aux.detach()), 5),
                  "lr": lr_at(step, cfg), "tokens": tokens_seen, "elapsed_s": round(time.time() - t0, 1)}
        if (step + 1) % eval_every == 0 or step + 1 == cfg.steps:
            record["heldout_loss"] = round(heldout_loss(model, windows), 5)
            save_checkpoint(model, out, dtype, eos_id, pad_id)      # a usable checkpoint while training goes on
        log.append(record)
        log_file.write(json.dumps(record) + "\n")
        log_file.flush()
        if (step + 1) % 10 == 0 or step == 0 or "heldout_loss" in record:
            rate = tokens_seen / max(1e-9, time.time() - t0)
            print(f"step {step + 1}/{cfg.steps} lm {float(lm.detach()):.4f} aux {float(aux.detach()):.4f} "
                  f"{rate:.0f} tok/s {record.get('heldout_loss', '')}", flush=True)
    log_file.close()
    train_seconds = time.time() - t0
    final_heldout = log[-1]["heldout_loss"]
    metrics = {
        "model": "colibri-nano", "parameters": params,
        "active_parameters_per_token": active_parameters(cfg),
        "heldout_loss": final_heldout, "heldout_perplexity": round(math.exp(final_heldout), 3),
        "heldout_tokens": int(windows.shape[0] * (windows.shape[1] - 2)),
        "steps": cfg.steps, "train_tokens": tokens_seen, "first_step_loss": first_loss,
        "final_train_loss": log[-1]["lm_loss"], "train_wall_seconds": round(train_seconds, 1),
        "total_wall_seconds": round(time.time() - started, 1), "seed": cfg.seed, "saved_dtype": dtype,
        "corpus": {"source": "Python standard library (*.py, no test suites, no site-packages)",
                   "python": sys.version.split()[0], "license": "PSF-2.0",
                   "train_files": len(train_texts), "heldout_files": len(held_texts),
                   "train_chars": sum(len(t) for _, t in train_texts)},
        "versions": versions(), "run_config": asdict(cfg),
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    try:
        plot(log, out / "loss_curve.png")
    except ImportError:
        print("matplotlib missing: no loss_curve.png (pip install matplotlib)", flush=True)
    return metrics


def save_checkpoint(model, out: Path, dtype: str, eos_id: int, pad_id: int) -> None:
    import copy

    import torch

    frozen = copy.deepcopy(model).to({"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype])
    frozen.config.output_router_logits = False
    frozen.save_pretrained(out, safe_serialization=True)
    # Low-temperature nucleus sampling by default: greedy decoding of a model this small falls into loops within a
    # line or two, while at 0.3 / 0.9 it writes plausible function bodies. The transformers check asks for greedy
    # explicitly, and `coli run --temp 0` still gives it.
    gen = {"eos_token_id": eos_id, "pad_token_id": pad_id, "do_sample": True, "temperature": 0.3, "top_p": 0.9}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def active_parameters(cfg: RunConfig) -> int:
    h = cfg.hidden
    per_layer = 4 * h * h + 2 * h + 2 * h + cfg.experts * h + cfg.top_k * 3 * h * cfg.expert_width
    return cfg.vocab * h * 2 + h + cfg.layers * per_layer


def versions() -> dict:
    import tokenizers
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__}


def parse_args(argv: list[str] | None = None):
    defaults = RunConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="output checkpoint directory")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="reuse tokenizer.json from this directory instead of training one")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--eval-every", type=int, default=150)
    for name, value in asdict(defaults).items():
        parser.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    args = parser.parse_args(argv)
    cfg = RunConfig(**{k: getattr(args, k) for k in asdict(defaults)})
    return args, cfg


def main(argv: list[str] | None = None) -> int:
    args, cfg = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    metrics = train(cfg, args.out, args.tokenizer, args.dtype, args.eval_every)
    print(json.dumps({k: metrics[k] for k in ("heldout_perplexity", "first_step_loss", "train_wall_seconds")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
