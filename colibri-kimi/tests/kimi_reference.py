"""The transformers reference of the Kimi K2 tests: DeepSeek-V3 on a kimi_k2 checkpoint."""

from __future__ import annotations

import json
from pathlib import Path


def load_reference(path: Path):
    """transformers' DeepSeek-V3 in f32 on the kimi_k2 checkpoint (its config read as a DeepseekV3Config)."""
    import torch
    import transformers

    data = json.loads((path / "config.json").read_text())
    data["model_type"] = "deepseek_v3"
    config = transformers.DeepseekV3Config.from_dict(data)
    return transformers.DeepseekV3ForCausalLM.from_pretrained(path, config=config, dtype=torch.float32).eval()
