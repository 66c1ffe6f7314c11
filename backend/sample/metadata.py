"""What the sampler knows about one step, built once per step from its requests.

``SamplingBatch`` is the layout: which logits rows belong to which request (its first row,
then one per speculative draft) and the drafts those rows verify. ``SamplingMetadata`` adds
the batched per-row settings the sampling pipeline reads (temperature, top-k, top-p, min-p
as tensors over the random rows without a seed; the seeded requests with their generators;
how many logprobs each request wants) and each logits processor's prepared state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from backend.core.request import Request

if TYPE_CHECKING:
    from backend.sample.logits_processors import LogitsProcessor


def to_device(values: list[float] | list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a tensor on ``device``. On CUDA through pinned memory without
    waiting: a plain copy from pageable memory would wait for all the device's queued work,
    which under async_scheduling includes the step before."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


@dataclass
class SamplingBatch:
    requests: list[Request]              # in logits-row order
    drafts: list[list[int]]              # per request: the drafts its rows 1.. verify ([] for none)
    rows: list[range] = field(init=False)

    def __post_init__(self) -> None:
        if len(self.drafts) != len(self.requests):
            raise ValueError("need one draft list per request")
        self.rows, start = [], 0
        for drafts in self.drafts:
            self.rows.append(range(start, start + 1 + len(drafts)))
            start += 1 + len(drafts)

    @property
    def num_rows(self) -> int:
        return self.rows[-1].stop if self.rows else 0


@dataclass
class RowFilter:
    """Temperature, top-k, top-p and min-p of some rows, as ``[rows, 1]`` tensors; a filter
    no row uses is None (and costs nothing)."""
    temperature: torch.Tensor
    top_k: torch.Tensor | None            # int64; ranks kept (vocab when disabled)
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None

    @classmethod
    def of(cls, requests: list[Request], vocab_size: int, device: torch.device) -> "RowFilter":
        params = [r.sampling_params for r in requests]

        def column(values: list[float] | list[int], dtype: torch.dtype) -> torch.Tensor:
            return to_device(values, dtype, device).unsqueeze(1)

        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        return cls(temperature=column([p.temperature for p in params], torch.float32),
                   top_k=column(top_k, torch.int64) if min(top_k) < vocab_size else None,
                   top_p=column(top_p, torch.float32) if min(top_p) < 1.0 else None,
                   min_p=column(min_p, torch.float32) if max(min_p) > 0.0 else None)


@dataclass
class SeededRequest:
    """A random request with its own generator: sampled row by row (see the sampler)."""
    index: int                            # in the batch
    generator: torch.Generator
    filter: RowFilter                     # one row


@dataclass
class SamplingMetadata:
    batch: SamplingBatch
    all_greedy: bool
    # Random rows without a seed: drawn together from the engine-wide generator.
    random_rows: torch.Tensor | None      # int64 row indices
    random_filter: RowFilter | None       # one row per random row
    seeded: list[SeededRequest]
    num_logprobs: list[int | None]        # per request: top-n logprobs wanted (None: none)
    processor_states: list[tuple["LogitsProcessor", Any]]   # only processors with work this step

    @classmethod
    def build(cls, batch: SamplingBatch, processors: list["LogitsProcessor"], vocab_size: int,
              device: torch.device) -> "SamplingMetadata":
        random_rows: list[int] = []
        random_requests: list[Request] = []        # one entry per random row
        seeded: list[SeededRequest] = []
        for i, request in enumerate(batch.requests):
            if request.sampling_params.is_greedy:
                continue
            if request.generator is not None:
                seeded.append(SeededRequest(i, request.generator, RowFilter.of([request], vocab_size, device)))
            else:
                random_rows += batch.rows[i]
                random_requests += [request] * len(batch.rows[i])
        states = []
        for processor in processors:
            state = processor.prepare(batch, vocab_size, device)
            if state is not None:
                states.append((processor, state))
        return cls(
            batch=batch,
            all_greedy=not random_rows and not seeded,
            random_rows=to_device(random_rows, torch.int64, device) if random_rows else None,
            random_filter=RowFilter.of(random_requests, vocab_size, device) if random_requests else None,
            seeded=seeded,
            num_logprobs=[r.sampling_params.logprobs for r in batch.requests],
            processor_states=states)

    @property
    def wants_logprobs(self) -> bool:
        return any(n is not None for n in self.num_logprobs)
