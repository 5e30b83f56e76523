"""colibri family plugin: Qwen MoE families: Qwen1.5/2 MoE, Qwen3 MoE, Qwen3-Next, Qwen3.5/3.6 MoE."""

__version__ = "0.1.0"
