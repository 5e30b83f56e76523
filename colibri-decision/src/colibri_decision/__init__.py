"""colibri family plugin: Decision checkpoints: GLiNER2-style extractors."""

__version__ = "0.1.0"
