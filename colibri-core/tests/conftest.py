"""Shared fixtures: a tiny OLMoE checkpoint (built once per session) and an in-test family that claims it.

Installed family packages are switched off (``COLIBRI_LOAD_PLUGINS=""``) so core's tests see only the families
they register themselves, whatever else is installed in the environment.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from colibri import hookimpl, plugins
from colibri.testing.kv_dir import private_kv_dir  # noqa: F401  (each module its own COLIBRI_KV_DIR)
from colibri.records import Claim, ExpertTensors, FamilyDescriptor, Geometry, Limits, TensorLayout

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class OlmoeTestFamily:
    """A minimal but real family for OLMoE checkpoints: what a family package would answer, derived from config."""

    name = "testolmoe"
    model_type = "olmoe"

    @hookimpl
    def describe_family(self):
        return FamilyDescriptor(self.name, (self.model_type,), "OLMoE, as core's tests see it")

    @hookimpl
    def detect_config(self, model_dir, config):
        if config is not None and config.get("model_type") == self.model_type:
            return Claim(self.name, self.model_type, "model_type")
        return None

    @hookimpl
    def model_geometry(self, model):
        c = model.config
        layers, hidden, heads = c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"]
        kv_heads = c.get("num_key_value_heads", heads)
        head_dim = hidden // heads
        return Geometry(
            model_type=self.model_type, architecture="OLMoE decoder", attention="MHA + RoPE",
            num_layers=layers, hidden_size=hidden, vocab_size=c["vocab_size"], num_heads=heads,
            num_kv_heads=kv_heads, head_dim=head_dim, num_experts=c["num_experts"],
            top_k=c["num_experts_per_tok"], expert_intermediate=c["intermediate_size"],
            moe_layers=tuple(range(layers)), max_context=c.get("max_position_embeddings", 0),
            kv_bytes_per_token=2 * layers * kv_heads * head_dim * 4,
        )

    @hookimpl
    def tensor_layout(self, model):
        c = model.config
        layers, experts = c["num_hidden_layers"], c["num_experts"]
        hidden, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
        heads = c["num_attention_heads"]
        kv = c.get("num_key_value_heads", heads) * (hidden // heads)
        tied = bool(c.get("tie_word_embeddings", False))
        p = "model.layers"
        norms = ["model.norm.weight"]
        required = []
        shapes = {"model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden),
                  "model.norm.weight": (hidden,)}
        for i in range(layers):
            q = f"{p}.{i}."
            norms += [q + "input_layernorm.weight", q + "post_attention_layernorm.weight",
                      q + "self_attn.q_norm.weight", q + "self_attn.k_norm.weight"]
            required += [f"{q}self_attn.{n}_proj.weight" for n in "qkvo"]
            shapes.update({q + "input_layernorm.weight": (hidden,), q + "post_attention_layernorm.weight": (hidden,),
                           q + "self_attn.q_norm.weight": (hidden,), q + "self_attn.k_norm.weight": (kv,),
                           q + "self_attn.q_proj.weight": (hidden, hidden), q + "self_attn.k_proj.weight": (kv, hidden),
                           q + "self_attn.v_proj.weight": (kv, hidden), q + "self_attn.o_proj.weight": (hidden, hidden),
                           q + "mlp.gate.weight": (experts, hidden)})
        return TensorLayout(
            embeddings=("model.embed_tokens.weight",) + (() if tied else ("lm_head.weight",)),
            lm_head=None if tied else "lm_head.weight",
            norms=tuple(norms),
            routers=tuple((i, f"{p}.{i}.mlp.gate.weight") for i in range(layers)),
            experts=tuple(ExpertTensors(i, e, tuple(f"{p}.{i}.mlp.experts.{e}.{m}_proj.weight"
                                                    for m in ("gate", "up", "down")))
                          for i in range(layers) for e in range(experts)),
            required=tuple(required),
            shapes=shapes,
            expert_shapes=((inter, hidden), (inter, hidden), (hidden, inter)),
        )

    @hookimpl
    def limits(self, model):
        return Limits(max_context=model.config.get("max_position_embeddings", 4096), max_kv_slots=8,
                      has_engine=False, reason_no_engine="core's test family has no engine")


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def tiny_olmoe(tiny_root):
    """The pristine tiny OLMoE-layout checkpoint core writes itself (.path, .num_parameters; no torch, no family
    package). Tests must not modify it: use ``olmoe_copy``."""
    from tiny_checkpoint import write_checkpoint

    return write_checkpoint(tiny_root / "olmoe")


@pytest.fixture
def olmoe_copy(tiny_olmoe, tmp_path) -> Path:
    """A private copy of the tiny OLMoE that a test may break."""
    dest = tmp_path / "olmoe"
    shutil.copytree(tiny_olmoe.path, dest)
    return dest


@pytest.fixture
def no_installed_plugins(monkeypatch):
    monkeypatch.setenv("COLIBRI_LOAD_PLUGINS", "")
    monkeypatch.delenv("COLI_MODEL", raising=False)
    monkeypatch.delenv("COLIBRI_MODEL", raising=False)
    plugins.reset()
    yield
    plugins.reset()


@pytest.fixture
def family_class():
    """The test family class, for tests that register a variant of it."""
    return OlmoeTestFamily


@pytest.fixture
def olmoe_family(no_installed_plugins) -> OlmoeTestFamily:
    family = OlmoeTestFamily()
    plugins.register(family, "testolmoe", package="colibri-core-tests", version="0")
    return family


# --------------------------------------------------------------------------------- checkpoint surgery helpers

class Surgery:
    """Byte-level edits of safetensors checkpoints, to build the broken inputs doctor must catch."""

    @staticmethod
    def header(path: Path) -> tuple[dict, bytes]:
        raw = path.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        return json.loads(raw[8:8 + n]), raw[8 + n:]

    @staticmethod
    def write(path: Path, header: dict, data: bytes) -> None:
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        path.write_bytes(len(blob).to_bytes(8, "little") + blob + data)

    @classmethod
    def rewrite_header(cls, path: Path, mutate) -> None:
        header, data = cls.header(path)
        mutate(header)
        cls.write(path, header, data)

    @classmethod
    def shard(cls, directory: Path, parts: int = 2) -> list[Path]:
        """Split ``model.safetensors`` into ``parts`` shards plus ``model.safetensors.index.json``."""
        single = directory / "model.safetensors"
        header, data = cls.header(single)
        meta = header.pop("__metadata__", None)
        names = sorted(header)
        files = []
        weight_map = {}
        for i in range(parts):
            chunk = names[i::parts]
            fname = f"model-{i + 1:05d}-of-{parts:05d}.safetensors"
            out_header, out_data, offset = {}, bytearray(), 0
            for name in chunk:
                begin, end = header[name]["data_offsets"]
                out_header[name] = dict(header[name], data_offsets=[offset, offset + end - begin])
                out_data += data[begin:end]
                offset += end - begin
                weight_map[name] = fname
            if meta:
                out_header["__metadata__"] = meta
            cls.write(directory / fname, out_header, bytes(out_data))
            files.append(directory / fname)
        single.unlink()
        (directory / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": len(data)}, "weight_map": weight_map}))
        return files


@pytest.fixture
def surgery() -> type[Surgery]:
    return Surgery
