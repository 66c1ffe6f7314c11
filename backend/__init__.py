"""In-flight batching LLM engine: paged KV cache, prefix caching, chunked prefill,
preemption, priorities. No Triton imports here; model_repository/ adapts it."""

from backend.config import EngineConfig
from backend.engine import Engine, EngineStats
from backend.errors import InvalidRequestError, QueueFullError, ShuttingDownError
from backend.outputs import RequestOutput
from backend.sampling_params import SamplingParams

__all__ = ["Engine", "EngineConfig", "EngineStats", "InvalidRequestError", "QueueFullError",
           "RequestOutput", "SamplingParams", "ShuttingDownError"]
