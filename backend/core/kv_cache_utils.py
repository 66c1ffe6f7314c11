"""Block hashing for the prefix cache, and small arithmetic shared by the KV-cache layers.

A full block's hash chains its parent's hash, its token ids and its *extra keys*: anything
besides the tokens that changes the block's K/V or who may reuse it. Two requests share a
cached block only when all three agree, so a prefix computed under one LoRA adapter is never
served to another adapter or to the base model, and requests with different cache salts
(tenants that must not observe each other's cache hits) never share a block.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from backend.core.request import Request

_ROOT_HASH = b"\x00" * 32
ExtraKeys = tuple[Any, ...]   # JSON-serialisable values


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def hash_block(parent_hash: bytes | None, token_ids: list[int], extra_keys: ExtraKeys = ()) -> bytes:
    """Chained hash of one full block: it identifies the block's tokens, everything before
    them (through the parent), and the extra keys. sha256 so that collisions are not a
    correctness risk. No extra keys hash exactly as the tokens alone."""
    digest = hashlib.sha256(parent_hash or _ROOT_HASH)
    digest.update(array("q", token_ids).tobytes())
    if extra_keys:
        digest.update(json.dumps(list(extra_keys), separators=(",", ":")).encode())
    return digest.digest()


def block_extra_keys(request: "Request", block_index: int) -> ExtraKeys:
    """The extra keys of the request's ``block_index``-th block.

    - The LoRA adapter id goes into every block: K/V of every position depend on it.
    - The cache salt goes into the first block only; chaining carries it into all later ones
      (as vLLM does), so the salt costs one extra hash update per request.
    """
    keys: list[Any] = []
    if request.lora_id is not None:
        keys.append(("lora", request.lora_id))
    if block_index == 0 and request.cache_salt is not None:
        keys.append(("salt", request.cache_salt))
    return tuple(keys)


def request_block_hashes(request: "Request", block_size: int) -> list[bytes]:
    """Extend ``request.block_hashes`` to every full block of its tokens; returns it."""
    hashes = request.block_hashes
    tokens = request.token_ids
    for i in range(len(hashes), len(tokens) // block_size):
        hashes.append(hash_block(hashes[-1] if hashes else None, tokens[i * block_size:(i + 1) * block_size],
                                 block_extra_keys(request, i)))
    return hashes
