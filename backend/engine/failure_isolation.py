"""When a step fails: which requests caused it, which others must be recomputed, and when
the engine itself is broken.

A failure that follows a request is that request's: the step's requests are re-run in halves
until each failing group is one request. A survivor that took a prefix hit on a block a failed
request was filling in that step would read K/V that was never written, so it is recomputed
(preempted) instead, and so on for whoever depended on it. Everything here goes through the
KV-cache manager's public API.
"""

from __future__ import annotations

from typing import Callable

from backend.core.kv_cache_manager import KVCacheManager
from backend.core.request import Request

# A step whose requests all failed (alone or together) ends them and the engine goes on: a
# poisoned request, or a transient fault. This many in a row, with no good step between,
# mark the engine unhealthy.
MAX_FAILED_STEPS_IN_A_ROW = 3


def find_culprits(requests: list[Request], run: Callable[[list[Request]], object], error: Exception,
                  ) -> dict[str, Exception]:
    """The requests that fail on their own, by request id, with their errors. ``run`` runs a
    group of the step's requests (raising as the step did); ``error`` is the whole step's.
    A failure no single request explains (it needs the whole batch, or nothing runs at all)
    is every request's."""
    culprits: dict[str, Exception] = {}

    def probe(group: list[Request], known_error: Exception | None = None) -> None:
        if known_error is None:
            try:
                run(group)
                return
            except Exception as exc:  # noqa: BLE001 - what is being looked for
                known_error = exc
        if len(group) == 1:
            culprits[group[0].request_id] = known_error
            return
        half = len(group) // 2
        probe(group[:half])
        probe(group[half:])

    probe(requests, error)
    if not culprits or (len(culprits) == len(requests) > 1):
        culprits = {r.request_id: error for r in requests}
    return culprits


def readers_of_unwritten(kv_cache: KVCacheManager, culprits: list[Request], survivors: list[Request],
                         ) -> list[Request]:
    """The survivors that read, as computed, a block some culprit (or another such survivor)
    was to write in the failed step: they must be recomputed, not run."""
    unwritten = {block_id for r in culprits for block_id in kv_cache.uncomputed_blocks(r).block_ids}
    remaining, readers = list(survivors), []
    while True:
        dependents = [r for r in remaining if not unwritten.isdisjoint(kv_cache.computed_blocks(r).block_ids)]
        if not dependents:
            return readers
        for request in dependents:
            # Not run either: the blocks it was filling stay unwritten too.
            unwritten.update(kv_cache.uncomputed_blocks(request).block_ids)
            remaining.remove(request)
            readers.append(request)


class EngineHealth:
    """Whether the engine can still be trusted: a device error, or several steps in a row that
    failed every one of their requests, says it cannot (the serving layer then refuses requests
    and its supervisor restarts the server)."""

    def __init__(self) -> None:
        self.error: str | None = None
        self.failed_steps_in_a_row = 0

    def step_succeeded(self) -> None:
        self.failed_steps_in_a_row = 0

    def step_failed(self, num_culprits: int, num_requests: int, error: Exception) -> None:
        """A step failed and ``num_culprits`` of its ``num_requests`` requests were failed."""
        self.failed_steps_in_a_row = self.failed_steps_in_a_row + 1 if num_culprits == num_requests else 0
        if self.failed_steps_in_a_row >= MAX_FAILED_STEPS_IN_A_ROW:
            self.error = f"{self.failed_steps_in_a_row} steps in a row failed every request, last with {error!r}"

    def device_failed(self, error: Exception) -> None:
        self.error = f"device error: {error!r}"
