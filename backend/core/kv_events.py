"""KV-cache events: what the prefix cache stores and drops, told to routers that track every
replica's cache (NVIDIA Dynamo's KV router, llm-d's KV-cache indexer, ...) in vLLM's format.

The block pool reports to a ``KVEventRecorder`` on the engine thread. The recorder makes one
small event object per report and hands it to a queue; encoding and sending belong to the
publisher thread (backend/engine/kv_event_publisher.py). With events off (the default) the
pool holds no recorder and none of this runs. The wire contract is in docs/scaling.md
("KV-cache events").
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Union

if TYPE_CHECKING:
    from backend.config import EngineConfig
    from backend.core.kv_cache_manager import KVCacheManager
    from backend.core.request import Request

# vLLM's name for the engine's own KV pool, whatever the device: consumers read other media
# (CPU, disk) as offload tiers and weigh them lower.
MEDIUM = "GPU"


def external_hash(block_hash: bytes) -> int:
    """The published form of a chained sha256 block hash: its last 8 bytes read as a big-endian
    unsigned 64-bit integer. vLLM converts its own sha256 hashes the same way, and llm-d reads
    bytes hashes so; Dynamo 1.6.1 decodes integers only."""
    return int.from_bytes(block_hash[-8:], "big")


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Consecutive blocks of one request entered the prefix cache. ``parent_block_hash`` is
    the hash of the block before the first one (None: the first starts the sequence)."""
    TAG: ClassVar[str] = "BlockStored"
    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: list[int]            # block_size tokens per block, in order
    block_size: int
    lora_id: int | None
    lora_name: str | None

    def to_wire(self) -> list[Any]:
        """vLLM's positional form: [tag, block_hashes, parent_block_hash, token_ids, block_size,
        lora_id, medium, lora_name]."""
        parent = None if self.parent_block_hash is None else external_hash(self.parent_block_hash)
        return [self.TAG, [external_hash(h) for h in self.block_hashes], parent, self.token_ids,
                self.block_size, self.lora_id, MEDIUM, self.lora_name]


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks left the prefix cache (evicted, or their hash dropped)."""
    TAG: ClassVar[str] = "BlockRemoved"
    block_hashes: tuple[bytes, ...]

    def to_wire(self) -> list[Any]:
        return [self.TAG, [external_hash(h) for h in self.block_hashes], MEDIUM]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The prefix cache was reset: every block this replica published is gone."""
    TAG: ClassVar[str] = "AllBlocksCleared"

    def to_wire(self) -> list[Any]:
        return [self.TAG]


KVCacheEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class Publisher(str, enum.Enum):
    ZMQ = "zmq"
    NULL = "null"       # vLLM's "null": nothing is published (here: nothing is started)


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``kv_events_config`` keys, read from EngineConfig's ``enable_kv_cache_events``
    and ``kv_events_*`` fields."""
    enable_kv_cache_events: bool = False
    publisher: Publisher = Publisher.ZMQ
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    topic: str = ""

    @classmethod
    def from_engine_config(cls, config: "EngineConfig") -> "KVEventsConfig":
        return cls(config.enable_kv_cache_events, Publisher(config.kv_events_publisher), config.kv_events_endpoint,
                   config.kv_events_replay_endpoint, config.kv_events_buffer_steps, config.kv_events_hwm,
                   config.kv_events_topic)

    @property
    def binds(self) -> bool:
        """vLLM's rule: an endpoint with a wildcard host ("*", "::") or an ipc:// or inproc://
        one is bound (a stable address subscribers connect to); any other is connected to (a
        subscriber that binds, as llm-d's indexer does)."""
        return "*" in self.endpoint or "::" in self.endpoint or self.endpoint.startswith(("ipc://", "inproc://"))


class KVEventRecorder:
    """Turns the block pool's reports into events and hands each to ``put`` (the publisher's
    queue). Runs on the engine thread, so it does no more than build the event.

    Blocks of requests with a ``cache_salt`` are never published, nor is their removal: the
    consumers recompute their keys from token ids (and the LoRA name), and none that reads the
    positional form keeps salts apart, so a published salted block would credit its replica
    with a prefix that no request of another salt can hit. (It would also put the salt, a
    tenant's secret, on the event bus.)"""

    def __init__(self, block_size: int, put: Callable[[KVCacheEvent], None]) -> None:
        self.block_size = block_size
        self._put = put
        self._unpublished: set[bytes] = set()    # cached salted blocks: their removal is not published either

    def blocks_stored(self, request: "Request", indices: list[int]) -> None:
        """``indices``: positions (ascending) of the request's blocks just registered in the
        prefix cache. One event per run of consecutive positions."""
        hashes = request.block_hashes
        if request.cache_salt is not None:
            self._unpublished.update(hashes[i] for i in indices)
            return
        lora_name = request.lora.name if request.lora is not None else None
        size = self.block_size
        start = indices[0]
        for k, i in enumerate(indices):
            if k + 1 < len(indices) and indices[k + 1] == i + 1:
                continue
            self._put(BlockStored(tuple(hashes[start:i + 1]), hashes[start - 1] if start > 0 else None,
                                  request.token_ids[start * size:(i + 1) * size], size, request.lora_id, lora_name))
            if k + 1 < len(indices):
                start = indices[k + 1]

    def blocks_removed(self, block_hashes: list[bytes]) -> None:
        if self._unpublished:
            published = [h for h in block_hashes if h not in self._unpublished]
            self._unpublished.difference_update(block_hashes)
            block_hashes = published
        if block_hashes:
            self._put(BlockRemoved(tuple(block_hashes)))

    def all_cleared(self) -> None:
        self._unpublished.clear()
        self._put(AllBlocksCleared())


def record_events(kv_cache: "KVCacheManager", put: Callable[[KVCacheEvent], None]) -> KVEventRecorder:
    """Make ``kv_cache``'s block pool report to a new recorder handing events to ``put``."""
    recorder = KVEventRecorder(kv_cache.block_size, put)
    kv_cache.pool.events = recorder
    return recorder
