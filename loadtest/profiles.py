"""Scenarios, length distributions, profiles and SLOs: the one place every default lives.

A scenario is defined once, at the size a GPU deployment sees (the numbers of the issue:
ShareGPT-like chat, 1k-4k RAG prompts, 16 x 2048-token shared prefixes, ...). A profile
scales those lengths for a machine and sets the load, the mix weights and the SLOs, so
``cpu`` and ``smoke`` are the same traffic shape, only smaller.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np


class LengthDist(Protocol):
    def sample(self, rng: np.random.Generator) -> int: ...
    def scaled(self, factor: float, floor: int = 1) -> "LengthDist": ...


def _scale(value: int, factor: float, floor: int) -> int:
    return max(floor, int(round(value * factor)))


@dataclass(frozen=True)
class Fixed:
    value: int

    def sample(self, rng: np.random.Generator) -> int:
        return self.value

    def scaled(self, factor: float, floor: int = 1) -> "Fixed":
        return Fixed(_scale(self.value, factor, floor))


@dataclass(frozen=True)
class Uniform:
    low: int
    high: int   # inclusive

    def sample(self, rng: np.random.Generator) -> int:
        return int(rng.integers(self.low, self.high + 1))

    def scaled(self, factor: float, floor: int = 1) -> "Uniform":
        low = _scale(self.low, factor, floor)
        return Uniform(low, max(low, _scale(self.high, factor, floor)))


@dataclass(frozen=True)
class LogNormal:
    """Heavy-tailed lengths (ShareGPT prompts and replies are close to log-normal), clipped
    to [low, high]. ``mean`` is the mean before clipping; ``sigma`` the log-space spread."""
    mean: float
    sigma: float
    low: int
    high: int

    def sample(self, rng: np.random.Generator) -> int:
        mu = math.log(self.mean) - self.sigma ** 2 / 2   # so that E[exp(N(mu, sigma))] == mean
        return int(np.clip(round(float(rng.lognormal(mu, self.sigma))), self.low, self.high))

    def scaled(self, factor: float, floor: int = 1) -> "LogNormal":
        low = _scale(self.low, factor, floor)
        return LogNormal(max(float(floor), self.mean * factor), self.sigma, low,
                         max(low, _scale(self.high, factor, floor)))


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    prompt: LengthDist
    output: LengthDist
    # shared-prefix: requests of one group share a `prefix`-token system prompt
    groups: int = 0
    prefix: LengthDist | None = None
    # cancel: the client cancels after a token drawn uniformly in this fraction of max_tokens
    cancel_fraction: tuple[float, float] | None = None
    # priority: (class name, engine priority (lower is served first), share of requests)
    classes: tuple[tuple[str, int, float], ...] = ()

    def scaled(self, prompt_factor: float, output_factor: float) -> "Scenario":
        # A cancelled request must still be running when the abort reaches the engine (the
        # server checks for cancellation every 100 ms), so its output is never tiny.
        output_floor = MIN_CANCEL_OUTPUT if self.cancel_fraction else 1
        return replace(self, prompt=self.prompt.scaled(prompt_factor),
                       output=self.output.scaled(output_factor, output_floor),
                       prefix=self.prefix.scaled(prompt_factor) if self.prefix else None)


MIN_CANCEL_OUTPUT = 64

_CHAT_PROMPT = LogNormal(mean=160, sigma=1.0, low=4, high=1024)
_CHAT_OUTPUT = LogNormal(mean=340, sigma=1.0, low=1, high=2048)

# Full size: what a GPU deployment of a small model sees.
SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("chat", "ShareGPT-like conversation turns: short prompts and replies, heavy-tailed",
             prompt=_CHAT_PROMPT, output=_CHAT_OUTPUT),
    Scenario("rag", "retrieval-augmented: long prompts, short answers",
             prompt=Uniform(1024, 4096), output=LogNormal(mean=48, sigma=0.6, low=8, high=256)),
    Scenario("rag-long", "retrieval-augmented, 2-4k-token prompts, short answers (arriving into chat traffic)",
             prompt=Uniform(2048, 4096), output=LogNormal(mean=48, sigma=0.6, low=8, high=256)),
    Scenario("shared-prefix", "16 groups share a 2048-token system prompt, 128-token questions (prefix caching)",
             prompt=Fixed(128), output=LogNormal(mean=64, sigma=0.6, low=8, high=256),
             groups=16, prefix=Fixed(2048)),
    Scenario("long-generation", "short prompt, long output",
             prompt=Uniform(16, 128), output=Uniform(1024, 2048)),
    Scenario("cancel", "the client cancels part-way, at a random token",
             prompt=_CHAT_PROMPT, output=Uniform(512, 1024), cancel_fraction=(0.05, 0.25)),
    Scenario("priority", "a premium class (served first) and a bulk class, chat-sized",
             prompt=_CHAT_PROMPT, output=_CHAT_OUTPUT,
             classes=(("premium", 0, 0.3), ("bulk", 10, 0.7))),
)}


@dataclass(frozen=True)
class SLO:
    """Per-request objectives. A request is *good* when it completed and met all of them;
    the run passes when at least ``min_attainment`` of its requests were good."""
    ttft_s: float
    tpot_s: float
    e2e_s: float | None = None
    min_attainment: float = 0.9


@dataclass(frozen=True)
class Profile:
    name: str
    prompt_scale: float
    output_scale: float
    users: int
    duration_s: float
    weights: dict[str, int]
    slo: SLO
    # Engine parameters used when the load test starts the server itself. Priority
    # scheduling makes the priority scenario meaningful; everything else is the default.
    server_params: dict[str, str] = field(default_factory=lambda: {"scheduling_policy": "priority"})
    drain_timeout_s: float = 120.0
    prefix_groups: int | None = None   # shared-prefix groups, when a short run needs repeats
    full_size_prompts: tuple[str, ...] = ()   # scenarios whose prompts keep their full size

    def scenarios(self, names: list[str] | None = None) -> dict[str, Scenario]:
        chosen = names or [n for n, w in self.weights.items() if w > 0]
        unknown = sorted(set(chosen) - set(SCENARIOS))
        if unknown:
            raise ValueError(f"unknown scenario(s) {unknown}; known: {sorted(SCENARIOS)}")
        scenarios = {n: SCENARIOS[n].scaled(1.0 if n in self.full_size_prompts else self.prompt_scale,
                                            self.output_scale) for n in chosen}
        if self.prefix_groups:
            scenarios = {n: replace(s, groups=self.prefix_groups) if s.groups else s for n, s in scenarios.items()}
        return scenarios


# Weights are requests: one in 41 is a long RAG prompt, whose prefill still takes about a third
# of the compute on 2 CPU cores.
MIXED_WEIGHTS = {"chat": 40, "rag-long": 1}
DEFAULT_WEIGHTS = {"chat": 35, "rag": 10, "shared-prefix": 20, "long-generation": 5, "cancel": 10, "priority": 20}

PROFILES: dict[str, Profile] = {p.name: p for p in (
    # GPU-sized: the scenarios as defined above.
    Profile("full", 1.0, 1.0, users=32, duration_s=300, weights=DEFAULT_WEIGHTS,
            slo=SLO(ttft_s=2.0, tpot_s=0.1), drain_timeout_s=300),
    # Two CPU cores at ~90-160 output tokens/s in all: lengths / 8, 16 users. A started server
    # runs at most 12 sequences, so a few requests queue and the priority classes differ.
    Profile("cpu", 1 / 8, 1 / 8, users=16, duration_s=180, weights=DEFAULT_WEIGHTS,
            slo=SLO(ttft_s=5.0, tpot_s=0.5),
            server_params={"scheduling_policy": "priority", "max_num_seqs": "12"}),
    # Mixed-length traffic on 2 CPU cores (issue 24): chat (prompts / 2, outputs / 8) from 8
    # users, among which 2-4k-token RAG prompts arrive at full size. Default engine settings:
    # what is measured is how the scheduler keeps the chat streams going.
    Profile("mixed", 1 / 2, 1 / 8, users=8, duration_s=180, weights=MIXED_WEIGHTS,
            slo=SLO(ttft_s=5.0, tpot_s=0.2), server_params={}, full_size_prompts=("rag-long",)),
    # The smoke run of `make test`: every scenario equally often, tiny lengths, loose SLOs
    # (it checks correctness, not speed).
    Profile("smoke", 1 / 32, 1 / 32, users=4, duration_s=20, weights={n: 1 for n in SCENARIOS},
            slo=SLO(ttft_s=30.0, tpot_s=5.0, min_attainment=0.0), drain_timeout_s=30, prefix_groups=2),
)}
DEFAULT_PROFILE = "cpu"
DEFAULT_HOST = "127.0.0.1:8001"     # the gRPC address make serve listens on
