"""Error types the engine raises at request submission.

They map one-to-one onto Triton error codes in the serving layer:
``InvalidRequestError`` -> INVALID_ARG, ``QueueFullError`` and ``ShuttingDownError``
-> UNAVAILABLE, anything else -> INTERNAL.
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request (prompt or sampling parameter) is invalid. ``field`` names the culprit; the
    message starts with it unless ``verbatim`` (a message another server's clients match
    word for word)."""

    def __init__(self, field: str, message: str, *, verbatim: bool = False) -> None:
        super().__init__(message if verbatim else f"{field}: {message}")
        self.field = field


class QueueFullError(RuntimeError):
    """The waiting queue holds ``max_waiting_requests`` already; retry later."""


class ShuttingDownError(RuntimeError):
    """The server is draining (shutdown or model unload): no new requests; retry elsewhere."""
