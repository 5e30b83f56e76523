"""colibri family plugin: Qwen MoE families: Qwen1.5/2 MoE, Qwen3 MoE, Qwen3-Next, Qwen3.5/3.6 MoE."""

from importlib import metadata

__version__ = metadata.version("colibri-qwen")   # stated once, in pyproject.toml
