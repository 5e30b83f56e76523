"""The errors colibri raises for things a user can fix.

Every error carries a one-line message naming the file, field or flag at fault, and a hint saying what to do.
The CLI prints ``message`` (and ``hint``) on one line and exits 1; ``--debug`` shows the traceback.
"""

from __future__ import annotations


class ColibriError(Exception):
    """Base class: a problem with the user's input or environment, not a bug in colibri."""

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def one_line(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message


class UsageError(ColibriError):
    """A flag or argument is missing or out of range."""


class ModelNotFoundError(ColibriError):
    """The model directory does not exist or holds no checkpoint."""


class ConfigError(ColibriError):
    """config.json (or another metadata file) is missing, not JSON, or lacks a field."""


class FamilyError(ColibriError):
    """No installed family claims the model, or several do."""


class CheckpointError(ColibriError):
    """A safetensors shard or index is malformed, truncated or incomplete."""


class EngineError(ColibriError):
    """The engine is missing, failed to build, refused a request or died."""


class BuildError(EngineError):
    """Compiling an engine failed (or no compiler is installed)."""


class InsufficientMemoryError(ColibriError):
    """The RAM budget cannot hold the dense weights, KV/state, reserve and one expert slot per MoE layer."""
