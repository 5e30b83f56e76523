"""A family plugin whose engine is tests/fake_engine.py, and a checkpoint directory it claims.

Lets ``coli run``/``coli chat`` be tested end to end (tokenizer, template, planner, engine client, streaming)
without a C build. ``python fakefamily.py ARGS`` runs the ``coli`` CLI with this family registered, for tests
that need a real process (stdin pipes, a pty).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

from colibri import hookimpl, plugins
from colibri.records import Claim, ExpertTensors, FamilyDescriptor, Geometry, Limits, TensorLayout

HERE = Path(__file__).resolve().parent
FAMILY = "fakemoe"
HIDDEN, EXPERTS, TOP_K, INTER = 8, 4, 2, 4
MAX_CONTEXT = 256

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def _vocab(model) -> int:
    return int(model.config["vocab_size"])


class FakeFamily:
    @hookimpl
    def describe_family(self):
        return FamilyDescriptor(FAMILY, (FAMILY,), "test family backed by a Python fake engine")

    @hookimpl
    def detect_config(self, model_dir, config):
        if config and config.get("model_type") == FAMILY:
            return Claim(FAMILY, FAMILY, "model_type")
        return None

    @hookimpl
    def model_geometry(self, model):
        return Geometry(model_type=FAMILY, architecture="fake", attention="none", num_layers=1, hidden_size=HIDDEN,
                        vocab_size=_vocab(model), num_heads=1, num_kv_heads=1, head_dim=HIDDEN,
                        num_experts=EXPERTS, top_k=TOP_K, expert_intermediate=INTER, moe_layers=(0,),
                        max_context=MAX_CONTEXT, kv_bytes_per_token=2 * HIDDEN * 4)

    @hookimpl
    def tensor_layout(self, model):
        experts = tuple(ExpertTensors(0, e, tuple(f"layers.0.experts.{e}.{p}" for p in ("gate", "up", "down")))
                        for e in range(EXPERTS))
        return TensorLayout(embeddings=("embed",), lm_head=None, norms=(), routers=((0, "layers.0.router"),),
                            experts=experts)

    @hookimpl
    def limits(self, model):
        return Limits(max_context=MAX_CONTEXT, max_kv_slots=4, has_engine=True)

    @hookimpl
    def engine_path(self, model):
        return Path(os.environ["FAKE_ENGINE_BIN"])

    @hookimpl
    def build_env(self, model, plan):
        from colibri.records import EngineEnv

        return EngineEnv(args=("--set", f"vocab={_vocab(model)}"))


    @hookimpl
    def parse_output(self, model):
        # opt-in, so the streamed text of the other tests stays exactly what the engine wrote
        if not os.environ.get("FAKE_REASONING"):
            return None
        from colibri.output_parser import OutputParser, OutputSyntax

        return OutputParser(OutputSyntax("<think>", "</think>"))


def install_engine_wrapper(directory: Path) -> Path:
    """An executable that runs the fake engine with this interpreter (engine_path must name one file)."""
    wrapper = directory / "colibri-fakemoe"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} {HERE / 'fake_engine.py'} \"$@\"\n")
    wrapper.chmod(0o755)
    return wrapper


def make_checkpoint(directory: Path, trained_tokenizer, chat_template: str | None = CHAT_TEMPLATE) -> Path:
    from safetensors.numpy import save_file

    from colibri.demo_tokenizer import write_tokenizer_files

    directory.mkdir(parents=True, exist_ok=True)
    vocab = trained_tokenizer.get_vocab_size()
    (directory / "config.json").write_text(json.dumps({"model_type": FAMILY, "vocab_size": vocab}))
    tensors = {"embed": np.zeros((vocab, HIDDEN), np.float32),
               "layers.0.router": np.zeros((EXPERTS, HIDDEN), np.float32)}
    for e in range(EXPERTS):
        tensors[f"layers.0.experts.{e}.gate"] = np.zeros((INTER, HIDDEN), np.float32)
        tensors[f"layers.0.experts.{e}.up"] = np.zeros((INTER, HIDDEN), np.float32)
        tensors[f"layers.0.experts.{e}.down"] = np.zeros((HIDDEN, INTER), np.float32)
    save_file(tensors, str(directory / "model.safetensors"))
    write_tokenizer_files(directory, trained_tokenizer, chat_template=chat_template)
    return directory


def fake_model(tmp_path: Path, monkeypatch, trained_tokenizer) -> Path:
    """For one test: only this family registered, its engine the fake one, and a checkpoint it claims."""
    for name, value in (("COLIBRI_LOAD_PLUGINS", ""), ("COLIBRI_CACHE", str(tmp_path / "cache")),
                        ("HF_HUB_OFFLINE", "1"), ("FAKE_ENGINE_BIN", str(install_engine_wrapper(tmp_path)))):
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("FAKE_ENGINE_MODE", raising=False)
    plugins.reset()
    register()
    return make_checkpoint(tmp_path / "model", trained_tokenizer)


def register() -> FakeFamily:
    family = FakeFamily()
    if FAMILY not in dict(plugins.manager().list_name_plugin()):
        plugins.register(family, FAMILY, package="colibri-core-tests", version="0")
    return family


if __name__ == "__main__":
    register()
    from colibri.cli import app

    app(prog_name="coli", args=sys.argv[1:])
