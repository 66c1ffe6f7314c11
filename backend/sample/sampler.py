"""Next-token selection over one step's logits, as a numbered pipeline over the step's
``SamplingMetadata`` (built once per step by ``prepare``):

1. raw logprobs (the model's distribution, before any processing, as in vLLM), if asked;
2. logits processors, in list order (logit_bias, penalties, min_tokens, bad_words, token masks);
3. greedy: the argmax of every row;
4. random rows without a seed: temperature, top-k, top-p, min-p, one batched draw with the
   engine-wide generator;
5. seeded requests: row by row with the request's own generator, so its tokens do not
   depend on what else is in the batch;
6. speculative verification: drafts kept while they equal the samples (``speculative.accept``);
7. the logprobs of the emitted token, and the top n.

Random rows are drawn by inverting each row's cumulative distribution at one uniform point
(``draw``): exactly a draw from ``probs``, one random number per row.

A request with speculative drafts has one logits row per position to verify; each row is
sampled exactly as a lone row would be. A seeded request samples its rows one at a time and
stops at the first mismatch, so it draws the same noise per emitted token as without drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.core.request import Request
from backend.outputs import Logprob, logprob_entry
from backend.sample.logits_processors import LogitsProcessor, default_processors
from backend.sample.metadata import RowFilter, SamplingBatch, SamplingMetadata
from backend.sample.speculative import accept
from kernels import cpu_native


@dataclass
class SamplerOutput:
    token_ids: list[list[int]]                # per request: the tokens it emits this step (>= 1)
    logprobs: list[dict[int, Logprob] | None]  # per request: its (single) token + top-n, when asked
                                               # (decoded_token is filled in by the engine)


class Sampler:
    def __init__(self, seed: int, processors: list[LogitsProcessor] | None = None) -> None:
        self.seed = seed
        self.processors = default_processors() if processors is None else processors
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

    def prepare(self, requests: list[Request], drafts: list[list[int]] | None, vocab_size: int,
                device: torch.device) -> SamplingMetadata:
        """The step's metadata: ``requests`` in logits-row order, each with its drafts."""
        batch = SamplingBatch(requests, drafts if drafts is not None else [[] for _ in requests])
        return SamplingMetadata.build(batch, self.processors, vocab_size, device)

    def __call__(self, logits: torch.Tensor, requests: list[Request],
                 drafts: list[list[int]] | None = None) -> SamplerOutput:
        """``prepare`` and ``sample`` in one call."""
        return self.sample(logits, self.prepare(requests, drafts, logits.shape[-1], logits.device))

    def sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """The tokens each request emits this step: one, or with drafts the accepted drafts
        plus one. One device-to-host copy of the step's token ids, except for seeded rows."""
        batch = meta.batch
        # 1. Raw logprobs.
        raw_logprobs = torch.log_softmax(logits, dim=-1) if meta.wants_logprobs else None
        # 2-4.
        logits, chosen = self.choose(logits, meta)
        row_tokens = chosen.tolist()
        samples = [[row_tokens[row] for row in rows] for rows in batch.rows]
        # 5. Seeded requests, row by row: no noise is drawn past a rejected draft.
        for seeded in meta.seeded:
            rows, drafts = batch.rows[seeded.index], batch.drafts[seeded.index]
            drawn: list[int] = []
            for j, row in enumerate(rows):
                probs = filtered_probs(logits[row].unsqueeze(0), seeded.filter).cpu()
                drawn.append(int(draw(probs, seeded.generator)[0]))
                if j >= len(drafts) or drawn[-1] != drafts[j]:
                    break
            samples[seeded.index] = drawn
        # 6. Verification.
        token_ids = [accept(drafts, request_samples) for drafts, request_samples in zip(batch.drafts, samples)]
        # 7. Logprobs (requests that want them take no drafts: their one row is their first).
        logprobs: list[dict[int, Logprob] | None] = [None] * len(batch.requests)
        if raw_logprobs is not None:
            for i, n in enumerate(meta.num_logprobs):
                if n is None:
                    continue
                token, row_logprobs = token_ids[i][0], raw_logprobs[batch.rows[i][0]]
                values, ids = row_logprobs.topk(n) if n > 0 else (row_logprobs[:0], row_logprobs[:0])
                value = row_logprobs[token]
                logprobs[i] = logprob_entry(token, float(value), 1 + int((row_logprobs > value).sum()),
                                            ids.tolist(), values.tolist())
        return SamplerOutput(token_ids, logprobs)

    def choose(self, logits: torch.Tensor, meta: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps 2-4: the processed logits, and each row's token (int64 [rows]; seeded rows are
        drawn after, by ``sample``) left where the logits are: nothing waits for the device, so
        a step whose requests need no more (async_scheduling) can launch the next before reading it."""
        # 2. Logits processors (on a copy: the caller's logits stay as they were).
        if meta.processor_states:
            logits = logits.clone()
            for processor, state in meta.processor_states:
                processor.apply(logits, state)
        # 3. Greedy.
        chosen = greedy(logits)
        # 4. Random rows without a seed.
        if meta.random_rows is not None:
            probs = filtered_probs(logits[meta.random_rows], meta.random_filter)
            chosen[meta.random_rows] = draw(probs, self._generator_on(probs.device))
        return logits, chosen


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Every row's argmax (int64 [rows]). Float32 CPU logits go to the C kernel
    (kernels/csrc/sampling.c: torch.argmax's answer, ties and NaN included, in a fraction of
    torch's CPU argmax's time; docs/benchmarks.md, "Sampling a token on CPU"); anything else to
    torch."""
    if (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.stride(-1) == 1 and cpu_native.load() is not None):
        return cpu_native.argmax_rows(logits)
    return logits.argmax(dim=-1)


def draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row of ``probs`` ([rows, vocab], zeros allowed), drawn from the row's
    distribution: the first token whose cumulative probability reaches a uniform point in
    (0, row total]. A zero-probability token is a flat step of the cumulative sum, which the
    search never stops on. Not the exponential race vLLM uses on GPUs (argmax of probs over
    Exp(1) noise): torch draws exponentials on CPU slowly for a 49k-token row, many times this
    search's cost for a step's sampled rows (docs/benchmarks.md, "Sampling a token on CPU")."""
    cdf = probs.cumsum(dim=-1)
    uniform = torch.rand(probs.shape[0], 1, generator=generator, device=probs.device, dtype=cdf.dtype)
    points = (1.0 - uniform) * cdf[:, -1:]     # rand is in [0, 1): the point is never 0
    return torch.searchsorted(cdf, points).squeeze(1).clamp_(max=probs.shape[1] - 1)


def filtered_probs(logits: torch.Tensor, filter: RowFilter) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p, row by row: the distribution a random row is
    drawn from. ``logits``: [rows, vocab] float32."""
    logits = logits / filter.temperature
    if filter.top_k is not None:
        kth = logits.sort(dim=-1, descending=True).values.gather(1, filter.top_k - 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))      # ties with the k-th stay
    probs = torch.softmax(logits, dim=-1)
    if filter.top_p is not None:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Drop a token when the tokens ranked above it already reach top_p (keeps >= 1).
        drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= filter.top_p
        probs = torch.zeros_like(probs).scatter(1, order, sorted_probs.masked_fill(drop, 0.0))
    if filter.min_p is not None:
        probs = probs.masked_fill(probs < filter.min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs
