"""n > 1: one request, n sampled completions, as vLLM V1 does it (``v1/engine/parallel_sampling.py``).

The parent is never scheduled. It fans out into n children, each an ordinary request with
n = 1: child i is ``"{request_id}/{i}"`` with seed ``seed + i`` when the parent has a seed
(so child i is exactly the single request with that seed), or no seed. The children share the
prompt's full KV blocks through the prefix cache: they are submitted together, the first
one admitted registers the prompt's blocks as it allocates them, and the others admitted in
the same step hit them, so the prompt's full blocks are computed once.

``ParentRequest`` gathers the children's outputs into one ``ParallelOutput`` per child
output: every child's latest state, with deltas only for the child that moved. The parent
is finished when every child is; a child that fails ends the parent with its error (the
serving layer then aborts the others).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from backend.outputs import RequestOutput
from backend.sampling_params import MAX_SEED, SamplingParams


@dataclass
class ParallelOutput:
    """The parent's view after some child moved: one entry per child, in index order."""
    request_id: str
    outputs: list[RequestOutput]

    @property
    def finished(self) -> bool:
        return all(output.finished for output in self.outputs)

    def merged_with(self, later: "ParallelOutput") -> "ParallelOutput":
        """This view followed by ``later`` as one (a sender that fell behind sends one response)."""
        if later.request_id != self.request_id:
            raise ValueError("only outputs of the same request can be merged")
        return ParallelOutput(self.request_id, [a.merged_with(b) for a, b in zip(self.outputs, later.outputs)])


def child_id(request_id: str, index: int) -> str:
    return f"{request_id}/{index}"


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Child ``index``'s parameters: one sequence, seed + index when seeded. Only child 0 computes
    prompt logprobs (they are the prompt's, the same for every child), so the others still share
    the prompt's blocks through the prefix cache."""
    seed = None if params.seed is None else (params.seed + index) % MAX_SEED
    prompt_logprobs = params.prompt_logprobs if index == 0 else None
    return dataclasses.replace(params, n=1, seed=seed, prompt_logprobs=prompt_logprobs)


class ParentRequest:
    """Collects the outputs of ``n`` children and hands the parent's callback a
    ``ParallelOutput`` for each, or the first error. Child callbacks run on the engine loop's
    thread only, so its state needs no lock."""

    def __init__(self, request_id: str, n: int, num_prompt_tokens: int,
                 callback: Callable[[ParallelOutput | BaseException], None]) -> None:
        self.request_id = request_id
        self.callback = callback
        self._done = False
        self._latest = [RequestOutput(request_id=child_id(request_id, i), new_token_ids=[], new_text="",
                                      finish_reason=None, num_prompt_tokens=num_prompt_tokens, num_cached_tokens=0,
                                      num_output_tokens=0) for i in range(n)]

    @property
    def n(self) -> int:
        return len(self._latest)

    @property
    def child_ids(self) -> list[str]:
        return [child_id(self.request_id, i) for i in range(self.n)]

    def child_callback(self, index: int) -> Callable[[RequestOutput | BaseException], None]:
        return lambda item: self._on_child(index, item)

    def _on_child(self, index: int, item: RequestOutput | BaseException) -> None:
        if self._done:
            return
        if isinstance(item, BaseException):
            self._done = True
            result: ParallelOutput | BaseException = item
        else:
            self._latest[index] = item
            outputs = [item if i == index else _without_deltas(o) for i, o in enumerate(self._latest)]
            result = ParallelOutput(self.request_id, outputs)
            self._done = result.finished
        self.callback(result)


def _without_deltas(output: RequestOutput) -> RequestOutput:
    return dataclasses.replace(output, new_token_ids=[], new_text="",
                               new_logprobs=[] if output.new_logprobs is not None else None)
