"""Scheduling state, owned by the engine thread: requests, the KV block pool and its
prefix cache, and the per-step scheduler. No tensors and no model here."""
