"""Next-token selection: per-step batched sampling metadata, logits processors, the sampler,
and speculative drafts (proposal and verification)."""
