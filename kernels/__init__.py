"""Attention kernels over the paged KV cache.

``reference`` is the specification (plain torch). The model runner calls only the
dispatch functions below, so a faster implementation can slot in per device.
"""

from kernels.reference import paged_attention_reference, reshape_and_cache_reference

reshape_and_cache = reshape_and_cache_reference
paged_attention = paged_attention_reference

__all__ = ["paged_attention", "reshape_and_cache", "paged_attention_reference", "reshape_and_cache_reference"]
