"""colibri family plugin: Diffusers text-to-image pipelines."""

__version__ = "0.1.0"
