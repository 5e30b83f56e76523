"""colibri family plugin: GLM MoE families: GLM-4.5/4.6/4.7, GLM-4.7-Flash, GLM-5 (DSA)."""

__version__ = "0.1.0"
