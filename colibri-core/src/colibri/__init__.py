"""colibri: tiny engine, immense model.

Run Mixture-of-Experts language models larger than RAM: dense weights stay resident, routed experts stream from
disk into a bounded cache. Families (OLMoE, Qwen, GLM, DeepSeek, Kimi, ...) are plugins; see ``colibri.hookspecs``.
"""

from __future__ import annotations

import pluggy

__version__ = "0.1.0"

hookimpl = pluggy.HookimplMarker("colibri")

__all__ = ["__version__", "hookimpl"]
