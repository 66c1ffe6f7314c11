"""In-flight batching LLM engine: paged KV cache, prefix caching, chunked prefill,
preemption, priorities. No Triton imports here; model_repository/ adapts it.

The names below are imported on first use: ``backend.config`` alone (what the launcher reads
to check engine parameters) then does not import torch and the model code (slow to import)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "EngineConfig": "backend.config",
    "Engine": "backend.engine.engine",
    "EngineStats": "backend.engine.stats",
    "EngineLoop": "backend.engine.loop",
    "EngineUnhealthyError": "backend.errors",
    "InvalidRequestError": "backend.errors",
    "QueueFullError": "backend.errors",
    "ShuttingDownError": "backend.errors",
    "FinishReason": "backend.outputs",
    "RequestOutput": "backend.outputs",
    "SamplingParams": "backend.sampling_params",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from backend.config import EngineConfig
    from backend.engine.engine import Engine
    from backend.engine.stats import EngineStats
    from backend.engine.loop import EngineLoop
    from backend.errors import EngineUnhealthyError, InvalidRequestError, QueueFullError, ShuttingDownError
    from backend.outputs import FinishReason, RequestOutput
    from backend.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'backend' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
