"""Streaming client for the Triton-served LLM (gRPC via tritonclient, plus HTTP SSE)."""

from client.llm_client import Completion, LLMClient, LLMError, StreamChunk, http_generate_stream, prefix_key_for

__all__ = ["Completion", "LLMClient", "LLMError", "StreamChunk", "http_generate_stream", "prefix_key_for"]
