"""colibri family plugin: OLMoE."""

from importlib import metadata

__version__ = metadata.version("colibri-olmoe")   # stated once, in pyproject.toml
