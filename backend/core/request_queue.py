"""The waiting queue, in scheduling-policy order."""

from __future__ import annotations

import heapq
from typing import Iterator

from backend.core.request import Request


class WaitingQueue:
    """Requests ordered by a key: (priority, arrival) or (0, arrival) for FCFS. A preempted
    request keeps its arrival number, so it re-enters ahead of later arrivals."""

    def __init__(self, use_priority: bool) -> None:
        self.use_priority = use_priority
        self._heap: list[tuple[tuple[int, int], Request]] = []

    def key(self, request: Request) -> tuple[int, int]:
        return (request.sampling_params.priority if self.use_priority else 0, request.arrival_seq)

    def push(self, request: Request) -> None:
        heapq.heappush(self._heap, (self.key(request), request))

    def remove(self, request: Request) -> None:
        self._heap = [item for item in self._heap if item[1] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """In policy order, lazily: admission looks at the first few of a queue that may hold
        hundreds, every step (keys are unique: arrival numbers never tie)."""
        heap = list(self._heap)
        while heap:
            yield heapq.heappop(heap)[1]
