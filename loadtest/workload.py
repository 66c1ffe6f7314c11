"""The seeded request stream: which scenario comes next, what each request is, when it is sent.

Reproducibility: the k-th request of a scenario is a pure function of (seed, scenario, k),
and the scenario sequence is a fixed interleaving of the weights, so two runs with the same
seed send the same requests in the same order; only which user sends which one depends on
timing.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from client.llm_client import prefix_key_for
from loadtest.profiles import Scenario
from loadtest.prompts import PromptFactory


@dataclass
class RequestSpec:
    request_id: str
    scenario: str
    name: str                 # what the report groups by: the scenario, or "priority:premium"
    prompt: str
    prompt_tokens: int
    max_tokens: int
    priority: int = 0
    group: int | None = None  # shared-prefix group
    prefix_key: str | None = None   # x-prefix-key for a proxy: the hash of the group's shared prefix
    cancel_after: int | None = None  # cancel once this many tokens arrived

    def sampling(self) -> dict[str, Any]:
        # ignore_eos + max_tokens pin the output length, so the load does not depend on
        # what the model happens to say; temperature 0 keeps the text itself reproducible.
        return {"max_tokens": self.max_tokens, "ignore_eos": True, "temperature": 0.0, "priority": self.priority}


def _stable_id(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little")


class Workload:
    def __init__(self, scenarios: dict[str, Scenario], prompts: PromptFactory, seed: int, max_model_len: int) -> None:
        self.scenarios = scenarios
        self.prompts = prompts
        self.seed = seed
        self.max_model_len = max_model_len
        self._counts = {name: 0 for name in scenarios}
        self._prefixes: dict[tuple[str, int], tuple[str, int]] = {}

    def _rng(self, scenario: str, *key: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, _stable_id(scenario), *key])

    def _prefix(self, scenario: Scenario, group: int) -> tuple[str, int]:
        key = (scenario.name, group)
        if key not in self._prefixes:
            assert scenario.prefix is not None
            rng = self._rng(scenario.name, 1, group)   # independent of the per-request streams
            # At most half the context, so that every request of the group still fits.
            length = min(scenario.prefix.sample(rng), self.max_model_len // 2)
            self._prefixes[key] = (self.prompts.text(length, rng), length)
        return self._prefixes[key]

    def next(self, scenario_name: str) -> RequestSpec:
        scenario = self.scenarios[scenario_name]
        k = self._counts[scenario_name]
        self._counts[scenario_name] += 1
        return self.build(scenario, k)

    def build(self, scenario: Scenario, k: int) -> RequestSpec:
        rng = self._rng(scenario.name, 0, k)
        max_tokens = scenario.output.sample(rng)
        question = scenario.prompt.sample(rng)
        group = int(rng.integers(scenario.groups)) if scenario.groups else None
        prefix_text, prefix_len = self._prefix(scenario, group) if group is not None else ("", 0)
        # Respect the context: output first (it is the load), then shorten the prompt.
        max_tokens = min(max_tokens, self.max_model_len - prefix_len - 1)
        question = max(1, min(question, self.max_model_len - prefix_len - max_tokens))
        text = self.prompts.text(question, rng)
        prompt = self.prompts.join(prefix_text, text) if prefix_text else text
        spec = RequestSpec(request_id=f"{scenario.name}-{self.seed}-{k}", scenario=scenario.name,
                           name=scenario.name, prompt=prompt, prompt_tokens=prefix_len + question,
                           max_tokens=max_tokens, group=group,
                           prefix_key=prefix_key_for(prefix_text) if prefix_text else None)
        if scenario.cancel_fraction:
            low, high = scenario.cancel_fraction
            spec.cancel_after = max(1, int(rng.integers(int(low * max_tokens), int(high * max_tokens) + 1)))
        if scenario.classes:
            shares = np.array([share for _, _, share in scenario.classes])
            label, priority, _ = scenario.classes[int(rng.choice(len(shares), p=shares / shares.sum()))]
            spec.name, spec.priority = f"{scenario.name}:{label}", priority
        return spec


class WeightedInterleave:
    """Smooth weighted round-robin (as nginx balances upstreams): deterministic, and every
    scenario recurs at even intervals, so a short run still covers each of them."""

    def __init__(self, weights: dict[str, int]) -> None:
        self.weights = {name: w for name, w in weights.items() if w > 0}
        if not self.weights:
            raise ValueError("no scenario has a positive weight")
        self._current = {name: 0 for name in self.weights}
        self._total = sum(self.weights.values())

    def next(self) -> str:
        for name, weight in self.weights.items():
            self._current[name] += weight
        chosen = max(self._current, key=lambda name: self._current[name])
        self._current[chosen] -= self._total
        return chosen


class Arrivals:
    """Send times. Closed loop (rate None): every user sends as soon as its previous request
    ended. Open loop: a Poisson process at ``rate`` requests/s, shared by all users;
    a request whose time has come while every user is busy is sent late, and its latency
    is still measured from the scheduled time (no coordinated omission)."""

    def __init__(self, rate: float | None, seed: int) -> None:
        self.rate = rate
        self._rng = np.random.default_rng([seed, 7])
        self._next: float | None = None

    def next_time(self, now: float) -> float:
        if self.rate is None:
            return now
        if self._next is None:
            self._next = now
        self._next += float(self._rng.exponential(1.0 / self.rate))
        return self._next
