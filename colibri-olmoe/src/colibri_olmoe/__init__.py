"""colibri family plugin: OLMoE."""

__version__ = "0.1.0"
