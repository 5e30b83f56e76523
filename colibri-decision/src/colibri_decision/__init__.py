"""colibri family plugin: Decision checkpoints: GLiNER2-style extractors."""

from importlib import metadata

__version__ = metadata.version("colibri-decision")   # stated once, in pyproject.toml
