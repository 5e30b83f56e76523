"""colibri family plugin: Diffusers text-to-image pipelines."""

from importlib import metadata

__version__ = metadata.version("colibri-image")   # stated once, in pyproject.toml
