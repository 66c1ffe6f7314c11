"""Next-token selection: penalties, min_tokens, greedy or temperature / top-k / top-p / min-p.

Random rows use the exponential-race trick (argmax of probs / Exp(1) noise), which is
equivalent to sampling from ``probs``; the noise comes from the request's own generator
when it has a seed, so its tokens do not depend on what else is in the batch.
Logprobs are those of the model's raw distribution (before penalties and temperature),
as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.request import Request


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]   # per row: sampled token + top-n, when asked


class Sampler:
    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)   # for requests without a seed

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        raw_logprobs = (torch.log_softmax(logits, dim=-1)
                        if any(r.sampling_params.logprobs is not None for r in requests) else None)
        token_ids = logits.argmax(dim=-1).tolist()   # greedy rows without processing keep this
        for row, request in enumerate(requests):
            params = request.sampling_params
            if not params.is_greedy or _needs_processing(request):
                row_logits = _process(logits[row].clone(), request)
                if params.is_greedy:
                    token_ids[row] = int(row_logits.argmax())
                else:
                    token_ids[row] = self._sample_row(row_logits, request)
        logprobs: list[dict[int, float] | None] = [None] * len(requests)
        if raw_logprobs is not None:
            for row, request in enumerate(requests):
                n = request.sampling_params.logprobs
                if n is None:
                    continue
                entry = {token_ids[row]: float(raw_logprobs[row, token_ids[row]])}
                if n > 0:
                    values, ids = raw_logprobs[row].topk(n)
                    entry.update(zip(ids.tolist(), values.tolist()))
                logprobs[row] = entry
        return SamplerOutput(token_ids, logprobs)

    def _sample_row(self, logits: torch.Tensor, request: Request) -> int:
        params = request.sampling_params
        logits = logits / params.temperature
        if params.top_k > 0 and params.top_k < logits.numel():
            kth = logits.topk(params.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if params.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # Drop a token when the tokens ranked above it already reach top_p (keeps >= 1).
            drop = (sorted_probs.cumsum(0) - sorted_probs) >= params.top_p
            probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
        if params.min_p > 0.0:
            probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
        generator = request.generator or self.generator
        noise = torch.empty(probs.shape, dtype=torch.float32).exponential_(generator=generator)
        return int((probs.cpu() / noise).argmax())


def _needs_processing(request: Request) -> bool:
    p = request.sampling_params
    return (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
            or request.num_output_tokens < p.min_tokens)


def _process(logits: torch.Tensor, request: Request) -> torch.Tensor:
    """Penalties and min_tokens masking on one row of float32 logits."""
    p = request.sampling_params
    device = logits.device
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(request.token_ids)), dtype=torch.int64, device=device)
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0) and request.num_output_tokens:
        outputs = torch.tensor(request.output_token_ids, dtype=torch.int64, device=device)
        counts = torch.bincount(outputs, minlength=logits.numel())[: logits.numel()].to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    if request.num_output_tokens < p.min_tokens:
        banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(request.eos_token_ids))
        banned_ids = [t for t in banned if t < logits.numel()]
        if banned_ids:
            logits[torch.tensor(banned_ids, dtype=torch.int64, device=device)] = float("-inf")
    return logits
