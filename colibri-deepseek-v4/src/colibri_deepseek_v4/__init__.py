"""colibri family plugin: DeepSeek MoE families: DeepSeek-V3/R1, V3.2 (DSA), V4."""

from importlib import metadata

__version__ = metadata.version("colibri-deepseek-v4")   # stated once, in pyproject.toml
