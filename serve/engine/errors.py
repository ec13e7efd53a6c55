"""Engine and request errors, typed by recoverability (vLLM's EngineDeadError / request errors)."""

from __future__ import annotations


class RequestError(ValueError):
    """A request the engine cannot serve as asked (bad parameter, prompt too long, queue full).

    Args:
        message: what is wrong, naming the offending field.
        status: the HTTP status an API layer should answer with (400, 413, 429, 503, ...).
        field: the request field at fault, if any (for the JSON error body).
    """

    def __init__(self, message: str, status: int = 400, field: str | None = None):
        super().__init__(message)
        self.status = status
        self.field = field


class RequestFailedError(RequestError):
    """One request failed inside the engine (its sampling, stopping or detokenising raised); the
    engine ended that request alone and goes on serving the others. HTTP 500 by default."""

    def __init__(self, message: str, status: int = 500, field: str | None = None):
        super().__init__(message, status, field)


class EngineDeadError(RuntimeError):
    """The engine loop failed; every in-flight request is failed with this error and the
    deployment's health check reports unhealthy."""


class UnsupportedTargetError(ValueError):
    """The target has an architecture feature the engine cannot honour (a layer or cache type,
    an attention variant); raised when the engine is built, never answered with different
    output. The message names the model type and the feature."""
