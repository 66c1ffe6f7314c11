"""Next-token selection: penalties, min_tokens, greedy or temperature / top-k / top-p / min-p.

Random rows use the exponential-race trick (argmax of probs / Exp(1) noise), which is
equivalent to sampling from ``probs``; the noise comes from the request's own generator
when it has a seed, so its tokens do not depend on what else is in the batch.
Logprobs are those of the model's raw distribution (before penalties and temperature),
as in vLLM.

A request with speculative drafts has one logits row per position to verify; each row is
sampled exactly as a lone row would be, and ``accept`` keeps the drafts that
equal those samples. A seeded request samples its rows one at a time and stops at the
first mismatch, so it draws the same noise per emitted token as without drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.request import Request
from backend.sampling_params import SamplingParams


@dataclass
class SamplerOutput:
    token_ids: list[list[int]]                # per request: the tokens it emits this step (>= 1)
    logprobs: list[dict[int, float] | None]   # per request: its (single) token + top-n, when asked


class Sampler:
    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)   # for requests without a seed
        self._device_generators: dict[torch.device, torch.Generator] = {}

    def _generator_on(self, device: torch.device) -> torch.Generator:
        """The engine-wide generator, on the logits' device (noise is drawn where it is used)."""
        if device.type == "cpu":
            return self.generator
        if device not in self._device_generators:
            self._device_generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._device_generators[device]

    def rng_state(self, requests: list[Request]) -> list[tuple[torch.Generator, torch.Tensor]]:
        """Every generator a step over ``requests`` may draw from, with its state."""
        generators = [self.generator, *self._device_generators.values(),
                      *(r.generator for r in requests if r.generator is not None)]
        return [(g, g.get_state()) for g in generators]

    @staticmethod
    def restore_rng_state(state: list[tuple[torch.Generator, torch.Tensor]]) -> None:
        for generator, saved in state:
            generator.set_state(saved)

    def __call__(self, logits: torch.Tensor, requests: list[Request],
                 drafts: list[list[int]] | None = None) -> SamplerOutput:
        """The tokens each request emits this step: one, or with ``drafts`` (per request,
        its rows follow its first row) the accepted drafts plus one. One device-to-host copy
        of the step's token ids, except for rows with their own seed (each draws from its
        request's CPU generator, so that its tokens do not depend on the batch)."""
        drafts = drafts or [[] for _ in requests]
        first_row, row = [], 0
        for request_drafts in drafts:
            first_row.append(row)
            row += 1 + len(request_drafts)
        # Requests with logprobs, penalties or min_tokens masking never have drafts
        # (speculative.can_speculate): their one row is their first row.
        raw_logprobs = (torch.log_softmax(logits, dim=-1)
                        if any(r.sampling_params.logprobs is not None for r in requests) else None)
        processed = [i for i, r in enumerate(requests) if needs_logits_processing(r)]
        if processed:
            logits = logits.clone()               # penalties must not touch the caller's logits
            for i in processed:
                logits[first_row[i]] = _process(logits[first_row[i]], requests[i])
        chosen = logits.argmax(dim=-1)            # greedy rows keep this
        batched_rows, batched_params = [], []
        for i, r in enumerate(requests):
            if not r.sampling_params.is_greedy and r.generator is None:
                batched_rows += range(first_row[i], first_row[i] + 1 + len(drafts[i]))
                batched_params += [r.sampling_params] * (1 + len(drafts[i]))
        if batched_rows:
            index = torch.tensor(batched_rows, device=logits.device)
            chosen[index] = self._sample_batch(logits[index], batched_params)
        row_tokens = chosen.tolist()
        token_ids: list[list[int]] = []
        for i, request in enumerate(requests):
            rows = range(first_row[i], first_row[i] + 1 + len(drafts[i]))
            if not request.sampling_params.is_greedy and request.generator is not None:
                samples: list[int] = []
                for j, row in enumerate(rows):   # one at a time: no noise drawn past a mismatch
                    samples.append(self._sample_row(logits[row], request))
                    if j >= len(drafts[i]) or samples[-1] != drafts[i][j]:
                        break
            else:
                samples = [row_tokens[row] for row in rows]
            token_ids.append(accept(drafts[i], samples))
        logprobs: list[dict[int, float] | None] = [None] * len(requests)
        if raw_logprobs is not None:
            for i, request in enumerate(requests):
                n = request.sampling_params.logprobs
                if n is None:
                    continue
                token, row_logprobs = token_ids[i][0], raw_logprobs[first_row[i]]
                entry = {token: float(row_logprobs[token])}
                if n > 0:
                    values, ids = row_logprobs.topk(n)
                    entry.update(zip(ids.tolist(), values.tolist()))
                logprobs[i] = entry
        return SamplerOutput(token_ids, logprobs)

    def _sample_batch(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Rows without a seed, all at once, with the engine-wide generator's noise."""
        probs = _filtered_probs(logits, params)
        noise = torch.empty_like(probs).exponential_(generator=self._generator_on(probs.device))
        return (probs / noise).argmax(dim=-1)

    def _sample_row(self, logits: torch.Tensor, request: Request) -> int:
        """A seeded row: the noise comes from the request's own (CPU) generator."""
        probs = _filtered_probs(logits.unsqueeze(0), [request.sampling_params])[0].cpu()
        noise = torch.empty(probs.shape, dtype=torch.float32).exponential_(generator=request.generator)
        return int((probs / noise).argmax())


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p, row by row ``params``: the distribution a
    random row is drawn from. ``logits``: [rows, vocab] float32."""
    device, vocab = logits.device, logits.shape[-1]
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=device)
    logits = logits / temperature.unsqueeze(1)
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if min(top_k) < vocab:
        kth_rank = torch.tensor(top_k, device=device).unsqueeze(1) - 1
        kth = logits.sort(dim=-1, descending=True).values.gather(1, kth_rank)
        logits = logits.masked_fill(logits < kth, float("-inf"))      # ties with the k-th stay
    probs = torch.softmax(logits, dim=-1)
    top_p = [p.top_p for p in params]
    if min(top_p) < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        limit = torch.tensor(top_p, dtype=probs.dtype, device=device).unsqueeze(1)
        # Drop a token when the tokens ranked above it already reach top_p (keeps >= 1).
        drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= limit
        probs = torch.zeros_like(probs).scatter(1, order, sorted_probs.masked_fill(drop, 0.0))
    min_p = [p.min_p for p in params]
    if max(min_p) > 0.0:
        scale = torch.tensor(min_p, dtype=probs.dtype, device=device).unsqueeze(1)
        probs = probs.masked_fill(probs < scale * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs


def needs_logits_processing(request: Request) -> bool:
    """Penalties or min_tokens masking apply to this request's next row (such a request takes
    no speculative drafts: the row would depend on the drafts before it)."""
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


def accept(drafts: list[int], samples: list[int]) -> list[int]:
    """The tokens a speculative step emits: drafts as long as they equal the target's samples
    at their positions, then the target's sample where they first differ (or the bonus sample
    after the last draft). ``samples`` has one entry per position verified so far; it may stop
    at the first mismatch (a seeded request samples position by position)."""
    emitted = []
    for i, sample in enumerate(samples):
        emitted.append(sample)
        if i >= len(drafts) or sample != drafts[i]:
            break
    return emitted
