"""Streaming client for the Triton-served LLM (gRPC via tritonclient, plus HTTP SSE)."""

from client.llm_client import (
    NO_RETRY, Completion, LLMClient, LLMError, RetryPolicy, StreamChunk, http_generate_stream, prefix_key_for,
)

__all__ = ["NO_RETRY", "Completion", "LLMClient", "LLMError", "RetryPolicy", "StreamChunk", "http_generate_stream",
           "prefix_key_for"]
