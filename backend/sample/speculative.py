"""Speculative decoding with n-gram (prompt lookup) drafts, verified in the same packed step.

A decoding request whose own text repeats itself (a document being edited, an answer quoting
its context, code with repeated identifiers) often continues the way it continued the last
time the same few tokens appeared. ``NgramProposer`` finds the most recent earlier occurrence
of the request's last n tokens (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``)
and proposes the tokens that followed it. The scheduler then gives the request 1 + k tokens
in the step: its last verified token and the k drafts. The forward pass produces logits at
all 1 + k positions, which is k + 1 next-token distributions computed for the price of one
weight read.

Verification (``accept``) samples the target's own token at each position, exactly as a
step without drafts would, and keeps drafts while they equal those samples. The first sample
that differs (or the sample after the last draft, the "bonus" token) ends the run. Every
emitted token is therefore a sample of the target distribution at its position. For greedy
requests this is the argmax, so the output is token for token that of transformers.

For a deterministic draft (a point mass on the proposed token) this is the same distribution
as rejection sampling, as vLLM does it: the draft is accepted with probability p(draft), and
a rejection emits a token drawn from p with the draft excluded. Both emit every token x with
probability p(x). Sampling first has one more property: the noise consumed per emitted token
is the same as without speculation. A request with a seed therefore gets the very same tokens
with speculation on or off, whatever else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from backend.core.request import Request
from backend.sample.logits_processors import blocks_drafts


@dataclass(frozen=True)
class NgramProposer:
    min_n: int
    max_n: int
    num_tokens: int           # k: drafts proposed at most

    def propose(self, token_ids: list[int], max_drafts: int | None = None) -> list[int]:
        """Up to k tokens that followed the most recent earlier occurrence of the longest
        suffix of ``token_ids`` (between min_n and max_n tokens long); [] when none is found."""
        k = self.num_tokens if max_drafts is None else min(self.num_tokens, max_drafts)
        length = len(token_ids)
        if k <= 0 or length < self.min_n + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            pattern = tokens[-n:]
            # Windows that start at 0 .. length-n-1, i.e. every occurrence but the suffix itself.
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            matches = np.flatnonzero((windows == pattern).all(axis=1))
            if matches.size:
                start = int(matches[-1]) + n      # the most recent occurrence
                return tokens[start:start + k].tolist()
        return []


def can_speculate(request: Request) -> bool:
    """Whether a decoding request may take drafts. Not with penalties or while min_tokens
    masks EOS (a position's distribution would depend on the drafts before it in the same
    step), nor with logprobs (one row of logprobs per step); not when the request opted out."""
    p = request.sampling_params
    return p.speculative and p.logprobs is None and not blocks_drafts(request)


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
