"""Test support shipped with colibri-core.

``colibri.testing.tiny`` builds tiny random-weight checkpoints with transformers at test time, of every kind the
installed family packages register (entry-point group ``colibri.testing.tiny``); ``colibri.testing.parity`` holds
a family's engine to transformers at every expert-cache size; ``checks`` and ``quality`` check layouts and
quantized containers. Everything imports torch lazily, so importing this package costs nothing for users who
never build a model.
"""
