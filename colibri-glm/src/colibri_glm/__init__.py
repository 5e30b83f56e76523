"""colibri family plugin: GLM MoE families: GLM-4.5/4.6/4.7, GLM-4.7-Flash, GLM-5 (DSA)."""

from importlib import metadata

__version__ = metadata.version("colibri-glm")   # stated once, in pyproject.toml
