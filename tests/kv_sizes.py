"""Saved KV bytes per token of each real release (docs/formats.md "Saved KV files"), from its config.json through
its family's own geometry: the rows the engine keeps per token are exactly what a saved file holds per token (plus
the 4-byte token id), against full f32 K/V (every attention layer's K and V heads, MLA decompressed).

``python tests/kv_sizes.py`` prints the table; tests/test_kv_sizes_doc.py checks docs/formats.md carries it.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_layouts

F32 = 4
TOKEN_ID = 4


def _text_config(cfg: dict) -> dict:
    return {**cfg, **cfg["text_config"]} if isinstance(cfg.get("text_config"), dict) else cfg


def attention_layers(cfg: dict) -> int:
    """Layers that keep K/V per token (the rest are linear attention with a fixed-size state)."""
    if cfg.get("layer_types"):
        return sum(t == "full_attention" for t in cfg["layer_types"])
    if cfg.get("linear_attn_config"):
        return len(cfg["linear_attn_config"]["full_attn_layers"])
    if cfg.get("full_attention_interval"):
        return cfg["num_hidden_layers"] // cfg["full_attention_interval"]
    return cfg["num_hidden_layers"]


def full_kv_bytes(cfg: dict) -> int:
    """Full f32 K and V per token: MLA decompressed to its heads, else the K/V heads."""
    if cfg.get("kv_lora_rank"):
        per_layer = cfg["num_attention_heads"] * (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"] +
                                                  cfg["v_head_dim"])
    else:
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        per_layer = 2 * cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * head_dim
    return per_layer * F32 * attention_layers(cfg)


def rows() -> list[dict]:
    from colibri import hooks
    from colibri.model import resolve_model

    out = []
    for release in real_layouts.RELEASES:
        cfg = real_layouts.config_of(release)
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "config.json").write_text(json.dumps(cfg))
            geometry = hooks.model_geometry(resolve_model(tmp))
        saved = geometry.kv_bytes_per_token + TOKEN_ID
        # DeepSeek-V4 keeps its own compressed per-token rows (one shared head, compressor and indexer state):
        # there is no per-head K/V to compare with
        full = None if cfg["model_type"] == "deepseek_v4" else full_kv_bytes(_text_config(cfg))
        out.append({"name": release.name, "family": cfg["model_type"], "saved": saved, "full": full,
                    "state": geometry.state_bytes_per_slot})
    return out


def table() -> str:
    lines = ["| release | model_type | saved per token | full f32 K/V per token | smaller by | recurrent state per "
             "conversation |", "|---|---|---|---|---|---|"]
    for r in rows():
        state = f"{r['state'] / 2 ** 20:.1f} MiB (x2 with its checkpoint)" if r["state"] else "-"
        full, ratio = ((f"{r['full'] / 1024:.1f} KiB", f"{r['full'] / r['saved']:.1f}x") if r["full"] else
                       ("n/a", "n/a"))
        lines.append(f"| {r['name']} | {r['family']} | {r['saved'] / 1024:.1f} KiB | {full} | {ratio} | {state} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
