"""colibri: tiny engine, immense model.

Run Mixture-of-Experts language models larger than RAM: dense weights stay resident, routed experts stream from
disk into a bounded cache. Families (OLMoE, Qwen, GLM, DeepSeek, Kimi, ...) are plugins; see ``colibri.hookspecs``.
"""

from __future__ import annotations

from importlib import metadata

import pluggy

# The version is stated once, in pyproject.toml; the installed distribution's metadata carries it here.
__version__ = metadata.version("colibri-core")

hookimpl = pluggy.HookimplMarker("colibri")

__all__ = ["__version__", "hookimpl"]
