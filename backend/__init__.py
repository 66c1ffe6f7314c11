"""In-flight batching LLM engine: paged KV cache, prefix caching, chunked prefill,
preemption, priorities. No Triton imports here; model_repository/ adapts it."""

from backend.config import EngineConfig
from backend.engine.engine import Engine, EngineStats
from backend.engine.loop import EngineLoop
from backend.errors import EngineUnhealthyError, InvalidRequestError, QueueFullError, ShuttingDownError
from backend.outputs import FinishReason, RequestOutput
from backend.sampling_params import SamplingParams

__all__ = ["Engine", "EngineConfig", "EngineLoop", "EngineStats", "EngineUnhealthyError", "FinishReason",
           "InvalidRequestError", "QueueFullError", "RequestOutput", "SamplingParams", "ShuttingDownError"]
