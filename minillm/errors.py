"""Exceptions a caller may want to catch by type.

Bad arguments raise plain ``ValueError`` / ``TypeError`` naming the offending value; the
types below exist for conditions a server or notebook typically handles specially.
"""

from __future__ import annotations


class ModelNotFoundError(FileNotFoundError):
    """A model name or folder could not be resolved to files on disk."""


class ModelLoadError(ValueError):
    """A model folder exists but cannot be loaded: incomplete, corrupt or unsupported."""


class PromptTooLongError(ValueError):
    """The prompt (plus at least one generated token) does not fit in ``max_model_len``."""


class RequestFailed(ValueError):
    """One request's own processing raised inside a step (a sampling setting the engine could
    not apply): that request ends with this error, naming the setting in ``param`` where it
    can; the other requests of the step go on (``engine/isolation.py``)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
