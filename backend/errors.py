"""Error types the engine raises at request submission.

They map one-to-one onto Triton error codes in the serving layer:
``InvalidRequestError`` -> INVALID_ARG, ``QueueFullError`` and ``ShuttingDownError``
-> UNAVAILABLE, anything else -> INTERNAL.
"""

from __future__ import annotations

import reprlib
from typing import Any


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


def _shallow_repr(limit: int) -> reprlib.Repr:
    shallow = reprlib.Repr()
    shallow.maxlevel, shallow.maxlist, shallow.maxtuple, shallow.maxdict = 3, 8, 8, 8
    shallow.maxstring = shallow.maxother = limit
    return shallow


def show(value: Any, limit: int = 80) -> str:
    """A user-supplied value for an error message: repr (which escapes control characters such
    as NUL, which would otherwise cut the message short in transport), truncated. Nested
    values are shown 3 levels deep: a full repr of a deeply nested JSON value raised
    RecursionError inside the server's request handler (an INTERNAL error for a bad request)."""
    text = _shallow_repr(limit).repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def is_encodable(text: str) -> bool:
    """Valid Unicode (no lone surrogates, e.g. from a JSON "\\ud800" escape)."""
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False
