"""async_scheduling: the engine launches step n+1 before it reads step n's tokens (vLLM's async
scheduling), so that on a GPU the host's work (scheduling and packing one step, then turning
the step before's tokens into outputs) runs while the device computes.

A step, with step n still on the device (``InFlightStep``):
1. Schedule step n+1. A request that step n samples for is one token ahead of its token list
   (``Request.num_pending_tokens``): its decode is scheduled as usual and takes that token as
   input on the device (``PendingTokens``), and one whose pending tokens reach its max_tokens
   is not scheduled again.
2. Launch step n+1: pack, forward, choose the tokens (``Sampler.choose``). Nothing waits for
   the device; the tokens are copied to pinned host memory behind an event.
3. Read step n's tokens (their copy finished long before step n+1 can) and process them as a
   synchronous step would: stop checks, detokenization, outputs. A request that ended there
   (EOS, a stop string, its length) or was aborted meanwhile was launched in step n+1 already:
   the token that step gives it is dropped.

Only steps whose requests need nothing from their last token on the host overlap
(``overlappable``): a seeded request's generator, logprobs, prompt logprobs and the logits
processors that read the history (penalties, min_tokens, bad_words, grammars) do. Before any
other step the engine reads the step on the device, then runs it synchronously. On a CPU the
device is the host: the order is the same and nothing overlaps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.core.request import Request
from backend.sample.logits_processors import LogitsProcessor
from backend.worker.step_buffers import PendingTokens


def overlappable(request: Request, processors: list[LogitsProcessor]) -> bool:
    """Whether a step with this request may be launched before its last token is on the host.
    Once true it stays true (``Request.overlappable`` keeps it): a running request's processors
    only ever stop applying (min_tokens once reached), never start."""
    if request.overlappable:
        return True
    params = request.sampling_params
    if request.generator is not None or params.logprobs is not None or request.wants_prompt_logprobs:
        return False
    request.overlappable = not any(processor.reads_history and processor.applies_to(request)
                                   for processor in processors)
    return request.overlappable


class HostTokenBuffers:
    """Pinned host memory for the tokens of the steps in flight, two buffers used in turn:
    step n's copy is read after step n+1's has been queued into the other one."""

    def __init__(self, size: int, device: torch.device) -> None:
        self._buffers = ([torch.empty(size, dtype=torch.int64, pin_memory=True) for _ in range(2)]
                         if device.type == "cuda" else None)
        self._next = 0

    def copy(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """``tokens`` on the host (when the copy's event has completed) and that event; on CPU
        the tokens themselves."""
        if self._buffers is None:
            return tokens, None
        buffer = self._buffers[self._next][:tokens.shape[0]]
        self._next ^= 1
        buffer.copy_(tokens, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return buffer, copied


@dataclass
class InFlightStep:
    """A step launched on the device whose tokens the host has not read yet."""
    sampling: list[Request]               # the requests it samples for, in row order
    tokens: torch.Tensor                  # [rows] int64 on the device: the next step's pending inputs
    host_tokens: torch.Tensor             # their host copy, valid once ``copied`` has completed
    copied: torch.cuda.Event | None       # None on CPU

    @classmethod
    def launch(cls, sampling: list[Request], tokens: torch.Tensor, buffers: HostTokenBuffers) -> "InFlightStep":
        host_tokens, copied = buffers.copy(tokens)
        return cls(sampling, tokens, host_tokens, copied)

    @property
    def pending(self) -> PendingTokens:
        return PendingTokens(self.tokens, {request.request_id: row for row, request in enumerate(self.sampling)})

    def read(self) -> list[int]:
        """The tokens, on the host: waits for the copy (and the step) to finish."""
        if self.copied is not None:
            self.copied.synchronize()
        return self.host_tokens.tolist()
