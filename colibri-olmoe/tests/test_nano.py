"""colibri-nano, the trained model shipped as package data (``colibri_olmoe/nano``): it is a standard Hugging Face
checkpoint, colibri's engine generates exactly what transformers generates from it, and the committed training
script reproduces its recorded first-step loss."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from colibri_olmoe.plugin import NANO_DIR, NANO_INT8_DIR, engine_hparams

TRAINING = Path(__file__).resolve().parents[1] / "training" / "train_nano.py"
# Candidates in order; the first three whose greedy path has no near-tie are compared (a trained model can have a
# genuine tie, where summation order legitimately picks either token).
PROMPTS = ("def fibonacci(n):", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):",
           "    def __repr__(self):\n        return", "for key, value in", "if __name__ == '__main__':\n")
COMPARED = 3
GREEDY_TOKENS = 32
LOGIT_TOL = 1e-4     # bf16 weights upcast exactly on both sides, f32 arithmetic: only summation order differs
MIN_MARGIN = 1e-3    # every greedy step's top-1/top-2 gap, ten times the tolerance: rounding cannot flip it


def metrics() -> dict:
    return json.loads((NANO_DIR / "metrics.json").read_text())


def test_shipped_files_describe_one_small_bf16_moe():
    names = {p.name for p in NANO_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", "MODEL_CARD.md", "metrics.json", "loss_curve.png"} <= names
    cfg = json.loads((NANO_DIR / "config.json").read_text())
    assert cfg["model_type"] == "olmoe" and cfg["architectures"] == ["OlmoeForCausalLM"]
    assert cfg["num_experts"] >= 16 and cfg["num_experts_per_tok"] >= 2
    size = (NANO_DIR / "model.safetensors").stat().st_size
    assert size < 60_000_000
    m = metrics()
    assert m["saved_dtype"] == "bfloat16" and size < 2 * m["parameters"] + 1_000_000
    assert m["heldout_perplexity"] < 0.2 * m["run_config"]["vocab"]      # far below a uniform guess
    assert m["final_train_loss"] < m["first_step_loss"] - 2
    card = (NANO_DIR / "MODEL_CARD.md").read_text()
    assert "PSF" in card and "train_nano.py" in card and str(m["heldout_perplexity"]) in card


def test_shipped_int8_container_is_the_same_model_at_int8():
    """The container `coli demo` runs: stamped colibri-quant, int8 experts, made from the shipped bf16 weights, and
    agreeing with them on >= 98% of next-token predictions over 512 positions of code it never saw (colibri's own
    planner: Python, but not the standard library it was trained on)."""
    import colibri.planner
    from colibri.convert.quality import run_quality
    from colibri.model import resolve_model

    shards = sorted(NANO_INT8_DIR.glob("*.safetensors"))
    assert shards and (NANO_INT8_DIR / "tokenizer.json").is_file()
    raw = shards[0].read_bytes()
    meta = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])["__metadata__"]
    assert meta["colibri.container"] == "colibri-quant"
    assert "int8-row" in {scheme for shard in shards for scheme in json.loads(
        json.loads(shard.read_bytes()[8:8 + int.from_bytes(shard.read_bytes()[:8], "little")])["__metadata__"]
        ["colibri.schemes"]).values()}
    assert sum(p.stat().st_size for p in shards) < 0.7 * (NANO_DIR / "model.safetensors").stat().st_size
    held_out = Path(colibri.planner.__file__).read_text(encoding="utf-8")
    report = run_quality(resolve_model(str(NANO_INT8_DIR)), resolve_model(str(NANO_DIR)), [held_out],
                         positions=512, threads=2)
    assert report.positions == 512
    assert report.top1_agreement >= 0.98, report
    assert 0 < report.mean_kl < 0.01, report


@pytest.fixture(scope="module")
def reference():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(NANO_DIR, dtype=torch.float32)
    model.eval()
    return model


def greedy_reference(model, ids: list[int]):
    """transformers' greedy continuation (no stop token; the whole sequence re-run each step, no cache), the prompt
    logits and the smallest top-1/top-2 gap along the way."""
    import torch

    seq, margins = list(ids), []
    with torch.no_grad():
        prompt_logits = model(torch.tensor([seq])).logits[0]
        nxt = prompt_logits[-1]
        for _ in range(GREEDY_TOKENS):
            top2 = nxt.topk(2).values
            margins.append(float(top2[0] - top2[1]))
            seq.append(int(nxt.argmax()))
            nxt = model(torch.tensor([seq])).logits[0, -1]
    return seq[len(ids):], prompt_logits, min(margins)


def test_engine_greedy_equals_transformers_on_the_shipped_checkpoint(reference):
    import torch

    from colibri.builder import build_family
    from colibri.engine import Engine
    from colibri.model import read_config
    from colibri.records import ResolvedModel
    from colibri.tokenizer import load_tokenizer_dir

    tok = load_tokenizer_dir(NANO_DIR)
    resolved = ResolvedModel(NANO_DIR, "olmoe", "olmoe", read_config(NANO_DIR))
    argv = [str(build_family("olmoe")), "--model", str(NANO_DIR), "--ctx", "256", "--slots", "1", "--cap", "8",
            "--threads", "2", *engine_hparams(resolved)]
    compared = []
    with Engine(argv, env={"COLIBRI_PREFETCH": "0"}) as engine:
        for prompt in PROMPTS:
            if len(compared) == COMPARED:
                break
            ids = tok.encode(prompt)
            want, ref_logits, margin = greedy_reference(reference, ids)
            if margin < MIN_MARGIN:
                continue
            compared.append(prompt)
            engine.reset(0)
            got = engine.generate(ids, max_tokens=GREEDY_TOKENS, logits=True)
            diff = (torch.tensor(got.logits) - ref_logits).abs().max().item()
            assert diff < LOGIT_TOL, f"{prompt!r}: prompt logits differ by {diff}"
            assert got.tokens == want, f"{prompt!r}: {tok.decode(got.tokens)!r} != {tok.decode(want)!r}"
    assert len(compared) == COMPARED, f"only {compared} of the candidate prompts are free of near-ties"


def test_training_script_reproduces_the_first_step_loss():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    m = metrics()
    if sys.version.split()[0] != m["corpus"]["python"]:
        pytest.skip(f"the corpus is the Python {m['corpus']['python']} standard library; this is {sys.version}")
    spec = importlib.util.spec_from_file_location("train_nano", TRAINING)
    train_nano = importlib.util.module_from_spec(spec)
    sys.modules["train_nano"] = train_nano          # dataclasses resolve their module by name
    spec.loader.exec_module(train_nano)
    from tokenizers import Tokenizer

    cfg = train_nano.RunConfig(**m["run_config"])
    assert cfg == train_nano.RunConfig(), "the script's defaults must be the run that made the shipped model"
    tok = Tokenizer.from_file(str(NANO_DIR / "tokenizer.json"))
    loss = train_nano.first_step_loss(cfg, tok)
    assert abs(loss - m["first_step_loss"]) < 1e-4, (loss, m["first_step_loss"])
    other = train_nano.first_step_loss(train_nano.RunConfig(seed=cfg.seed + 1), tok)
    assert abs(other - m["first_step_loss"]) > 1e-4        # the check can fail: another seed is another loss
