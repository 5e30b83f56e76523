"""colibri family plugin: DeepSeek MoE families: DeepSeek-V3/R1, V3.2 (DSA), V4."""

__version__ = "0.1.0"
