"""Error types the engine raises at request submission.

They map one-to-one onto Triton error codes in the serving layer:
``InvalidRequestError`` -> INVALID_ARG, ``QueueFullError``, ``ShuttingDownError`` and
``EngineUnhealthyError`` -> UNAVAILABLE, anything else -> INTERNAL. Clients retry the
UNAVAILABLE ones by their text (client/llm_client.py RETRYABLE_MESSAGES).
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


class EngineUnhealthyError(RuntimeError):
    """The engine failed in a way it cannot isolate (a device error, or steps failing that no
    request explains): requests in flight end with it and new ones are refused until the
    server is restarted; retry elsewhere."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"engine is unhealthy ({reason}); retry on another replica")
        self.reason = reason


# CUDA reports errors as RuntimeError (torch.AcceleratorError from torch 2.8 on) with these in
# the text; after most of them the context is unusable (every later call fails), so a step
# that hits one cannot be retried without the request that seemed to cause it.
DEVICE_ERROR_MARKERS = ("CUDA error", "CUBLAS_STATUS", "CUDNN_STATUS", "device-side assert",
                        "an illegal memory access", "unspecified launch failure")


def is_device_error(error: BaseException) -> bool:
    import torch   # here, so that importing the error types stays cheap

    if isinstance(error, getattr(torch, "AcceleratorError", ())):
        return True
    return any(marker in str(error) for marker in DEVICE_ERROR_MARKERS)


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
