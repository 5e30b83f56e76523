"""colibri family plugin: Kimi (Moonshot) MoE families: Kimi K2, Kimi Linear."""

__version__ = "0.1.0"
