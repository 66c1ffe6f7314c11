"""Batch slots over engine steps, from the server's own step records: the seeds' picture of
continuous vs static batching, drawn from a real run.

The engine writes one JSON line per step (``EngineConfig.step_trace_path``: which requests
it computed, how many tokens each, prompt or generated). A request holds a slot from the
first step that computes it to the last one; slots are handed out lowest-free-first, as a
batch's rows are. A slot is *busy* in a step when its request is computed in it; held or
not, it is otherwise *idle*: the slot of a request that finished early in a static batch
stays idle until the whole batch has drained, while continuous batching refills it the
step after. Occupancy is busy cells over all cells (slots x steps), with as many slots as
requests were ever held at once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

STEPS_FILE = "steps.jsonl"


@dataclass
class SlotTimeline:
    request: np.ndarray    # [slots, steps] int: index of the request holding the slot, -1 idle
    prefill: np.ndarray    # [slots, steps] bool: the slot computed prompt tokens (a prefill chunk)
    step_ms: np.ndarray    # [steps] measured step time

    @property
    def occupancy(self) -> float:
        return float((self.request >= 0).mean()) if self.request.size else 0.0


def read_steps(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def slot_timeline(steps: list[dict]) -> SlotTimeline:
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, step in enumerate(steps):
        for request_id, _, _ in step["rows"]:
            first.setdefault(request_id, i)
            last[request_id] = i
    order = {request_id: n for n, request_id in enumerate(first)}
    slot_of: dict[str, int] = {}
    free: list[int] = []
    num_slots = 0
    releases: dict[int, list[str]] = {}
    for request_id, i in last.items():
        releases.setdefault(i, []).append(request_id)
    cells: list[tuple[int, int, int, bool]] = []   # (slot, step, request index, prefill)
    for i, step in enumerate(steps):
        for request_id, _, prefill in step["rows"]:
            if request_id not in slot_of:
                if free:
                    free.sort()
                    slot_of[request_id] = free.pop(0)
                else:
                    slot_of[request_id] = num_slots
                    num_slots += 1
            cells.append((slot_of[request_id], i, order[request_id], bool(prefill)))
        for request_id in releases.get(i, []):
            free.append(slot_of[request_id])
    request = np.full((num_slots, len(steps)), -1, dtype=np.int64)
    prefill = np.zeros((num_slots, len(steps)), dtype=bool)
    for slot, i, index, is_prefill in cells:
        request[slot, i] = index
        prefill[slot, i] = is_prefill
    return SlotTimeline(request, prefill, np.array([s["ms"] for s in steps], dtype=float))
