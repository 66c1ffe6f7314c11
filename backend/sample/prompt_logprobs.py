"""vLLM's ``prompt_logprobs``: the logprob of each prompt token given the tokens before it, and
the top-n at each prompt position, from the raw logits of the prefill (no penalties, no
temperature), as vLLM computes them.

The model runner asks for one extra logits row per prompt position a step computes of such a
request (``ModelRunner._prompt_logprob_rows``: after the sampling rows, so sampling is
unchanged); ``fill_prompt_logprobs`` turns those rows into the request's entries. Position p's
row predicts prompt token p + 1, so entry p + 1 is written; entry 0 stays None. A request
recomputed after a preemption writes the same entries again. Such a request reads no prefix-cache
blocks (``KVCacheManager.get_computed_blocks``): every position's logits must be computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.core.request import Request
from backend.outputs import logprob_entry


@dataclass(frozen=True)
class PromptLogprobRows:
    """``count`` logits rows of ``request``'s prompt positions ``first_position`` onwards."""
    request: Request
    first_position: int
    count: int


def fill_prompt_logprobs(logits: torch.Tensor, rows: list[PromptLogprobRows]) -> None:
    """``logits``: float32, the prompt-logprob rows of a step in ``rows``' order."""
    offset = 0
    for part in rows:
        request, n = part.request, part.request.sampling_params.prompt_logprobs
        block = torch.log_softmax(logits[offset:offset + part.count].float(), dim=-1)
        offset += part.count
        first = part.first_position + 1
        targets = torch.tensor(request.prompt_token_ids[first:first + part.count], dtype=torch.int64,
                               device=block.device)
        chosen = block.gather(1, targets[:, None])
        ranks = (block > chosen).sum(dim=1) + 1
        top_values, top_ids = block.topk(n, dim=-1) if n else (block[:, :0], block[:, :0])   # n = 0: empty rows
        chosen, ranks = chosen[:, 0].tolist(), ranks.tolist()
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
        for i, token in enumerate(targets.tolist()):
            request.prompt_logprobs[first + i] = logprob_entry(token, chosen[i], ranks[i], top_ids[i], top_values[i])
