"""colibri family plugin: Kimi (Moonshot) MoE families: Kimi K2, Kimi Linear."""

from importlib import metadata

__version__ = metadata.version("colibri-kimi")   # stated once, in pyproject.toml
