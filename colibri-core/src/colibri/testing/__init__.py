"""Test support shipped with colibri-core.

``colibri.testing.tiny`` builds tiny random-weight checkpoints (every supported family, a diffusers pipeline and
a decision checkpoint) with transformers/diffusers at test time. It imports torch lazily, so importing this
package costs nothing for users who never build a model.
"""
