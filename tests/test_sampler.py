"""Unit tests of backend.sample.sampler.Sampler on hand-made logits and hand-made Request objects.

No model is loaded: every row of logits is constructed so that the expected token (or the
expected distribution) is known exactly. Random draws use fixed seeds, so every test is
deterministic.
"""

from __future__ import annotations

import itertools
import math
import platform
from collections import Counter
from collections.abc import Iterable, Sequence

import pytest
import torch

from backend.core.request import Request
from backend.model.cpu_features import detect
from backend.sample.sampler import Sampler, SamplerOutput, draw, greedy
from kernels import cpu_native
from backend.sampling_params import SamplingParams

EOS = 2                      # same EOS id as the real model, inside the small hand-made vocab
_arrivals = itertools.count()


def make_request(params: SamplingParams, prompt: Sequence[int] = (0,), output: Sequence[int] = (),
                 eos: Iterable[int] = (EOS,), request_id: str | None = None) -> Request:
    """A Request as the engine builds it, with ``output`` already generated."""
    seq = next(_arrivals)
    request = Request(request_id=request_id or f"req-{seq}", prompt_token_ids=list(prompt),
                      sampling_params=params, arrival_seq=seq, arrival_time=0.0,
                      max_tokens=params.max_tokens or 64, eos_token_ids=frozenset(eos))
    for token in output:
        request.append_token(token)
    return request


def rows(*values: Sequence[float]) -> torch.Tensor:
    return torch.tensor([list(v) for v in values], dtype=torch.float32)


def sample_one(logits: Sequence[float], params: SamplingParams, prompt: Sequence[int] = (0,),
               output: Sequence[int] = (), sampler: Sampler | None = None) -> int:
    sampler = sampler or Sampler(seed=0)
    return sampler(rows(logits), [make_request(params, prompt, output)]).token_ids[0][0]


def draw_many(logits: Sequence[float], params: SamplingParams, n: int, sampler_seed: int = 1234) -> list[int]:
    """n independent draws from one row: a batch of n unseeded requests sharing the sampler RNG."""
    sampler = Sampler(seed=sampler_seed)
    requests = [make_request(params) for _ in range(n)]
    return [t[0] for t in sampler(rows(logits).repeat(n, 1), requests).token_ids]


def seeded_sequence(sampler: Sampler, logits: torch.Tensor, request: Request, others: list[Request],
                    other_logits: torch.Tensor, position: int, steps: int) -> list[int]:
    """Tokens drawn for ``request`` over ``steps`` calls, placed at row ``position`` among ``others``."""
    tokens: list[int] = []
    for _ in range(steps):
        batch = list(others)
        batch.insert(position, request)
        batch_logits = torch.cat([other_logits[:position], logits.unsqueeze(0), other_logits[position:]])
        out = sampler(batch_logits, batch)
        assert len(out.token_ids) == len(batch)
        tokens.append(out.token_ids[position][0])
    return tokens


# ---- greedy, top-k, top-p, min-p ------------------------------------------------------------

def test_greedy_picks_argmax_per_row() -> None:
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(16, 100, generator=generator) * 3
    requests = [make_request(SamplingParams(temperature=0.0)) for _ in range(15)]
    requests.append(make_request(SamplingParams(temperature=1e-6)))   # below the greedy threshold
    out = Sampler(seed=0)(logits, requests)
    assert isinstance(out, SamplerOutput)
    assert out.token_ids == [[t] for t in logits.argmax(dim=-1).tolist()]
    assert out.logprobs == [None] * 16


# ---- the C argmax (kernels/csrc/sampling.c) against torch.argmax ------------------------------

# version -> (flags its library is built with, beside -march=native; CPU features it needs)
ARGMAX_VERSIONS = {
    "avx512f": ((), {"avx512f"}),
    "avx2": (("-mno-avx512f",), {"avx2"}),
    "plain-c": (("-mno-avx2",), set()),
}


@pytest.fixture(scope="module", params=list(ARGMAX_VERSIONS))
def argmax_library(request):
    """A build of the C kernels whose argmax is the version named; skipped, naming the missing
    CPU features, only where this CPU cannot run it."""
    flags, needed = ARGMAX_VERSIONS[request.param]
    if platform.machine() not in ("x86_64", "AMD64") and request.param != "plain-c":
        pytest.skip(f"NOT RUN: the {request.param} argmax needs an x86 CPU, this is {platform.machine()}")
    missing = needed - detect().flags
    if missing:
        pytest.skip(f"NOT RUN: the {request.param} argmax needs CPU features {sorted(missing)}, which this CPU lacks")
    if platform.machine() not in ("x86_64", "AMD64"):
        flags = ()
    return cpu_native.open_library(cpu_native.build(cflags=cpu_native.CFLAGS + flags))


def c_argmax(library, logits: torch.Tensor, threads: int) -> torch.Tensor:
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    library.argmax_rows_f32(logits.data_ptr(), logits.shape[0], logits.shape[1], logits.stride(0), out.data_ptr(),
                            threads)
    return out


def argmax_edge_rows(vocab: int, generator: torch.Generator) -> torch.Tensor:
    """Rows that test the kernel's corners at this vocabulary size: ties (the first must win),
    NaN (torch answers the first NaN), infinities, a row of -inf, signed zeros, and maxima in
    the vector part, the tail and at both ends."""
    made = []
    for position in sorted({0, vocab // 2, vocab - 1, min(vocab - 1, 8), min(vocab - 1, 17)}):
        row = torch.randn(vocab, generator=generator)
        row[position] = 10.0
        made.append(row.clone())
        later = torch.arange(position, vocab)[::3]
        tied = row.clone()
        tied[later] = 10.0                       # the maximum again later: position still wins
        made.append(tied)
        nan = row.clone()
        nan[position] = float("nan")
        nan[later] = float("nan")
        made.append(nan)
        inf = torch.full((vocab,), -float("inf"))
        inf[position] = float("inf")
        made.append(inf)
    made.append(torch.full((vocab,), -float("inf")))
    zeros = torch.zeros(vocab)
    zeros[::2] = -0.0
    made.append(zeros)
    return torch.stack(made)


@pytest.mark.parametrize("vocab", [1, 7, 8, 9, 16, 17, 31, 100, 49152])
def test_c_argmax_equals_torch_argmax(argmax_library, vocab: int) -> None:
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.cat([torch.randn(5, vocab, generator=generator) * 4, argmax_edge_rows(vocab, generator)])
    for threads in (1, 3):
        assert torch.equal(c_argmax(argmax_library, logits, threads), logits.argmax(dim=-1)), (vocab, threads)
    # Rows of a wider tensor (a row stride past the vocabulary), as a slice of padded logits.
    wide = torch.full((logits.shape[0], vocab + 5), float("inf"))
    wide[:, :vocab] = logits
    assert torch.equal(c_argmax(argmax_library, wide[:, :vocab], 2), logits.argmax(dim=-1))


def test_c_argmax_many_rows_on_threads(argmax_library) -> None:
    """A step's worth of rows (the threaded case) and low-precision ties: logits that went
    through bfloat16 repeat values often."""
    generator = torch.Generator().manual_seed(1)
    logits = (torch.randn(40, 49152, generator=generator) * 3).bfloat16().float()
    assert torch.equal(c_argmax(argmax_library, logits, 2), logits.argmax(dim=-1))


def test_sampler_greedy_takes_the_c_argmax_on_cpu(monkeypatch) -> None:
    """Float32 CPU logits go to the kernel; other dtypes to torch. Both answer torch.argmax's."""
    calls = []
    real = cpu_native.argmax_rows
    monkeypatch.setattr(cpu_native, "argmax_rows", lambda logits: calls.append(logits.shape) or real(logits))
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(16, 49152, generator=generator)
    assert torch.equal(greedy(logits), logits.argmax(dim=-1)) and calls == [(16, 49152)]
    half = logits.bfloat16()
    assert torch.equal(greedy(half), half.argmax(dim=-1)) and len(calls) == 1


def test_greedy_hand_made_rows() -> None:
    logits = rows([0.1, 3.0, -1.0, 2.9], [5.0, -5.0, 4.99, 0.0], [-3.0, -2.0, -1.0, -1.5])
    requests = [make_request(SamplingParams(temperature=0.0)) for _ in range(3)]
    assert Sampler(seed=0)(logits, requests).token_ids == [[1], [0], [2]]


def test_top_k_1_equals_greedy_even_at_high_temperature() -> None:
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(50, generator=generator).tolist()
    best = max(range(50), key=lambda i: logits[i])
    draws = draw_many(logits, SamplingParams(temperature=100.0, top_k=1), 500)
    assert set(draws) == {best}
    # Control: the same temperature without top_k is close to uniform over 50 tokens.
    assert len(set(draw_many(logits, SamplingParams(temperature=100.0), 500))) > 30


def test_top_k_restricts_to_k_best() -> None:
    logits = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    draws = draw_many(logits, SamplingParams(temperature=10.0, top_k=3), 2000)
    assert set(draws) == {5, 6, 7}


def test_top_p_tiny_keeps_only_the_top_token() -> None:
    generator = torch.Generator().manual_seed(11)
    logits = (torch.randn(64, generator=generator) * 0.1).tolist()   # nearly flat distribution
    best = max(range(64), key=lambda i: logits[i])
    draws = draw_many(logits, SamplingParams(temperature=5.0, top_p=1e-6), 500)
    assert set(draws) == {best}
    assert len(set(draw_many(logits, SamplingParams(temperature=5.0), 500))) > 40   # control


def test_top_p_keeps_the_smallest_nucleus() -> None:
    probs = [0.1, 0.4, 0.2, 0.3]                   # sorted: 1 (0.4), 3 (0.3), 2 (0.2), 0 (0.1)
    logits = [math.log(p) for p in probs]
    draws = draw_many(logits, SamplingParams(top_p=0.55), 4000)
    # 0.4 < 0.55, so token 3 is needed as well; 0.4 + 0.3 >= 0.55, so 2 and 0 are dropped.
    assert set(draws) == {1, 3}
    share = Counter(draws)[1] / len(draws)
    assert share == pytest.approx(0.4 / 0.7, abs=0.03)


def test_min_p_masks_low_probability_tokens_across_seeds() -> None:
    probs = [0.5, 0.3, 0.15, 0.04, 0.01]          # min_p 0.2 -> threshold 0.2 * 0.5 = 0.1
    logits = rows([math.log(p) for p in probs])
    sampler = Sampler(seed=0)
    seen: Counter[int] = Counter()
    control: Counter[int] = Counter()
    for seed in range(3000):
        seen[sampler(logits, [make_request(SamplingParams(min_p=0.2, seed=seed))]).token_ids[0][0]] += 1
        control[sampler(logits, [make_request(SamplingParams(seed=seed))]).token_ids[0][0]] += 1
    assert seen[3] == 0 and seen[4] == 0
    assert set(seen) == {0, 1, 2}
    assert control[3] > 0 and control[4] > 0     # the same seeds do draw them without min_p


# ---- penalties ------------------------------------------------------------------------------

@pytest.mark.parametrize(("unseen_logit", "expected"), [(1.6, 1), (1.4, 0)])
def test_repetition_penalty_divides_positive_logits(unseen_logit: float, expected: int) -> None:
    # Token 0 (logit 3.0) is in the prompt: 3.0 / 2 = 1.5, which loses to 1.6 but beats 1.4.
    logits = [3.0, unseen_logit, -1.0, 0.0]
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert sample_one(logits, params, prompt=[0, 3]) == expected
    assert sample_one(logits, SamplingParams(temperature=0.0), prompt=[0, 3]) == 0   # no penalty: no flip


@pytest.mark.parametrize(("unseen_logit", "expected"), [(-1.9, 1), (-2.1, 0)])
def test_repetition_penalty_multiplies_negative_logits(unseen_logit: float, expected: int) -> None:
    # Token 0 (logit -1.0) was generated: -1.0 * 2 = -2.0, which loses to -1.9 but beats -2.1.
    logits = [-1.0, unseen_logit, -5.0, -4.0]
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert sample_one(logits, params, prompt=[3], output=[0]) == expected
    assert sample_one(logits, SamplingParams(temperature=0.0), prompt=[3], output=[0]) == 0


def test_repetition_penalty_below_one_rewards_seen_tokens() -> None:
    logits = [1.0, 1.5, -1.0, 0.0]
    assert sample_one(logits, SamplingParams(temperature=0.0, repetition_penalty=0.5), prompt=[0]) == 0
    assert sample_one(logits, SamplingParams(temperature=0.0), prompt=[0]) == 1


def test_repetition_penalty_applies_when_sampling() -> None:
    # Token 0 dominates (logit 10) until a penalty of 100 brings it to 0.1.
    logits = [10.0, 1.0, 0.9, 0.8]
    draws = [sample_one(logits, SamplingParams(repetition_penalty=100.0, seed=s), prompt=[0]) for s in range(300)]
    assert Counter(draws)[0] < 60                  # ~13% of the mass once penalised
    unpenalised = [sample_one(logits, SamplingParams(seed=s), prompt=[0]) for s in range(300)]
    assert Counter(unpenalised)[0] > 290


def test_presence_penalty_flips_argmax_for_output_tokens() -> None:
    logits = [-1.0, 2.0, -1.0, -1.0, 1.8]
    params = SamplingParams(temperature=0.0, presence_penalty=0.5)
    assert sample_one(logits, params, prompt=[0], output=[1]) == 4           # 2.0 - 0.5 < 1.8
    assert sample_one(logits, SamplingParams(temperature=0.0), prompt=[0], output=[1]) == 1


def test_presence_and_frequency_penalties_ignore_prompt_tokens() -> None:
    logits = [-1.0, 2.0, -1.0, -1.0, 1.8]
    for params in (SamplingParams(temperature=0.0, presence_penalty=2.0),
                   SamplingParams(temperature=0.0, frequency_penalty=2.0),
                   SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0)):
        # Token 1 appears three times, but only in the prompt: no penalty.
        assert sample_one(logits, params, prompt=[1, 1, 1, 0], output=[3]) == 1
        assert sample_one(logits, params, prompt=[1, 1, 1, 0]) == 1              # no output yet


@pytest.mark.parametrize(("occurrences", "expected"), [(1, 1), (3, 4)])
def test_frequency_penalty_scales_with_count(occurrences: int, expected: int) -> None:
    # 2.0 - 0.2 * count against 1.5: one occurrence (1.8) keeps token 1, three (1.4) flip it.
    logits = [-1.0, 2.0, -1.0, -1.0, 1.5]
    params = SamplingParams(temperature=0.0, frequency_penalty=0.2)
    assert sample_one(logits, params, prompt=[0], output=[1] * occurrences + [3]) == expected


def test_presence_penalty_does_not_scale_with_count() -> None:
    # 2.0 - 0.3 = 1.7 beats 1.5 however often token 1 was generated.
    logits = [-1.0, 2.0, -1.0, -1.0, 1.5]
    params = SamplingParams(temperature=0.0, presence_penalty=0.3)
    assert sample_one(logits, params, prompt=[0], output=[1, 1, 1, 1, 1]) == 1


def test_negative_presence_penalty_rewards_output_tokens() -> None:
    logits = [-1.0, 1.0, -1.0, 0.9, 1.2]
    params = SamplingParams(temperature=0.0, presence_penalty=-0.5)
    assert sample_one(logits, params, prompt=[0], output=[3]) == 3            # 0.9 + 0.5 > 1.2
    assert sample_one(logits, SamplingParams(temperature=0.0), prompt=[0], output=[3]) == 4


# ---- min_tokens -----------------------------------------------------------------------------

def test_min_tokens_masks_eos_until_reached() -> None:
    logits = [0.0, 1.0, 9.0, 3.0, 0.5]             # EOS (2) is the argmax
    params = SamplingParams(temperature=0.0, min_tokens=3, max_tokens=8)
    for generated in range(3):
        assert sample_one(logits, params, output=[4] * generated) == 3
    assert sample_one(logits, params, output=[4] * 3) == EOS
    assert sample_one(logits, params, output=[4] * 5) == EOS


def test_min_tokens_masks_stop_token_ids_until_reached() -> None:
    logits = [0.0, 1.0, 9.0, 8.0, 0.5]             # EOS 2, then stop token 3
    params = SamplingParams(temperature=0.0, min_tokens=2, max_tokens=8, stop_token_ids=[3])
    assert sample_one(logits, params) == 1
    assert sample_one(logits, params, output=[4]) == 1
    assert sample_one(logits, params, output=[4, 4]) == EOS


def test_min_tokens_with_ignore_eos_does_not_mask_eos() -> None:
    logits = [0.0, 1.0, 9.0, 8.0, 0.5]
    params = SamplingParams(temperature=0.0, min_tokens=3, max_tokens=8, ignore_eos=True, stop_token_ids=[3])
    assert sample_one(logits, params) == EOS                      # EOS is not a stop: not masked
    logits_stop_first = [0.0, 1.0, 8.0, 9.0, 0.5]
    assert sample_one(logits_stop_first, params) == EOS           # stop token 3 still is masked


def test_min_tokens_masks_all_eos_ids_of_the_request() -> None:
    logits = rows([0.0, 1.0, 9.0, 8.5, 0.5])
    request = make_request(SamplingParams(temperature=0.0, min_tokens=1, max_tokens=4), eos=(2, 3))
    assert Sampler(seed=0)(logits, [request]).token_ids == [[1]]


def test_min_tokens_masks_eos_when_sampling() -> None:
    logits = [0.0, 0.0, 6.0, 0.0, 0.0]             # EOS has ~97% of the mass
    params = SamplingParams(min_tokens=4, max_tokens=8)
    draws = draw_many(logits, params, 1000)
    assert EOS not in draws
    assert Counter(draw_many(logits, SamplingParams(max_tokens=8), 1000))[EOS] > 900


# ---- per-request seeds ----------------------------------------------------------------------

def test_same_seed_same_tokens_alone_or_in_any_batch() -> None:
    vocab = 200
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(vocab, generator=generator)
    steps = 40

    def fresh(seed: int) -> Request:
        return make_request(SamplingParams(temperature=1.0, seed=seed))

    alone = seeded_sequence(Sampler(seed=0), logits, fresh(42), [], torch.empty(0, vocab), 0, steps)
    assert len(set(alone)) > 10                    # a real random sequence, not a constant
    others = [make_request(SamplingParams(temperature=0.8)),                    # unseeded
              make_request(SamplingParams(temperature=1.0, seed=7)),            # another seed
              make_request(SamplingParams(temperature=0.0)),                    # greedy
              make_request(SamplingParams(temperature=1.0, top_p=0.9, seed=42))]  # same seed, other request
    other_logits = torch.randn(len(others), vocab, generator=generator)
    for position, sampler_seed in [(0, 1), (2, 2), (4, 99)]:
        batch = seeded_sequence(Sampler(seed=sampler_seed), logits, fresh(42), others, other_logits, position, steps)
        assert batch == alone, f"seeded request at row {position} drew different tokens"
    assert seeded_sequence(Sampler(seed=0), logits, fresh(43), [], torch.empty(0, vocab), 0, steps) != alone


def test_different_seeds_give_different_sequences() -> None:
    logits = rows([0.0] * 100)
    sequences = set()
    for seed in range(20):
        request = make_request(SamplingParams(seed=seed))
        sampler = Sampler(seed=0)
        sequences.add(tuple(sampler(logits, [request]).token_ids[0][0] for _ in range(10)))
    assert len(sequences) == 20


def test_unseeded_requests_follow_the_sampler_seed() -> None:
    logits = rows([0.0] * 100)

    def run(sampler_seed: int) -> list[int]:
        sampler = Sampler(seed=sampler_seed)
        return [sampler(logits, [make_request(SamplingParams())]).token_ids[0][0] for _ in range(20)]

    assert run(3) == run(3)
    assert run(3) != run(4)


# ---- the sampled distribution ---------------------------------------------------------------

LOGITS_6 = [1.0, 0.5, 0.0, -0.5, 2.0, 0.2]


def _expected_distribution(logits: Sequence[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    """Independent (plain Python) computation of the target distribution."""
    scaled = [x / temperature for x in logits]
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    keep = set(order[:top_k]) if top_k > 0 else set(order)
    weights = {i: math.exp(scaled[i]) for i in keep}
    total = sum(weights.values())
    kept: set[int] = set()
    cumulative = 0.0
    for i in order:
        if i not in keep:
            continue
        if cumulative >= top_p:
            break
        kept.add(i)
        cumulative += weights[i] / total
    mass = sum(weights[i] for i in kept)
    return [weights[i] / mass if i in kept else 0.0 for i in range(len(logits))]


@pytest.mark.parametrize(("temperature", "top_k", "top_p"),
                         [(1.0, 0, 1.0), (0.5, 0, 1.0), (2.0, 0, 1.0), (1.0, 3, 1.0), (1.0, 0, 0.8)])
def test_empirical_distribution_matches_softmax(temperature: float, top_k: int, top_p: float) -> None:
    n = 20_000
    expected = _expected_distribution(LOGITS_6, temperature, top_k, top_p)
    if top_k == 0 and top_p == 1.0:
        assert expected == pytest.approx(torch.softmax(torch.tensor(LOGITS_6) / temperature, 0).tolist(), abs=1e-6)
    counts = Counter(draw_many(LOGITS_6, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p), n))
    chi_square = 0.0
    for token, p in enumerate(expected):
        observed = counts[token] / n
        if p == 0.0:
            assert counts[token] == 0, f"token {token} has probability 0 but was drawn"
            continue
        assert observed == pytest.approx(p, abs=0.015), f"token {token}: {observed:.4f} vs {p:.4f}"
        chi_square += (counts[token] - n * p) ** 2 / (n * p)
    # 6 categories -> at most 5 degrees of freedom; 20.5 is the 99.9th percentile.
    assert chi_square < 20.5


def test_seeded_draws_follow_softmax_too() -> None:
    n = 5000
    logits = rows(LOGITS_6)
    sampler = Sampler(seed=0)
    counts = Counter(sampler(logits, [make_request(SamplingParams(seed=s))]).token_ids[0][0] for s in range(n))
    expected = torch.softmax(torch.tensor(LOGITS_6), 0).tolist()
    for token, p in enumerate(expected):
        assert counts[token] / n == pytest.approx(p, abs=0.025)


@pytest.mark.parametrize("uniform", [0.0, 1.0 - 2.0 ** -24, 0.5])
def test_draw_never_picks_a_zero_probability_token(uniform: float, monkeypatch) -> None:
    # Zeros first, last and in runs between the tokens that may be drawn; the uniform point at
    # both ends of its range and in between.
    probs = torch.tensor([[0.0, 0.0, 0.25, 0.0, 0.0, 0.75, 0.0],
                          [0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5],
                          [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0],
                          [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    real_rand = torch.rand
    monkeypatch.setattr(torch, "rand", lambda *shape, **kw: torch.full(shape, uniform, dtype=kw.get("dtype")))
    tokens = draw(probs, torch.Generator()).tolist()
    monkeypatch.setattr(torch, "rand", real_rand)
    assert all(probs[row, token] > 0 for row, token in enumerate(tokens)), tokens
    if uniform == 0.0:      # the point is the row's total: the last token that may be drawn
        assert tokens == [5, 6, 6, 0]
    if uniform > 0.99:      # the point is just above 0: the first
        assert tokens == [2, 0, 6, 0]


def test_draw_over_a_full_vocabulary_follows_the_distribution() -> None:
    """49,152 tokens (SmolLM2's vocabulary), most of the mass on a few, the rest spread thin:
    the cumulative sum in float32 must not shift mass between tokens."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(49152, generator=generator)
    logits[[7, 1000, 40000]] += torch.tensor([9.0, 8.0, 8.5])
    probs = torch.softmax(logits, dim=0)
    n, batch = 4000, 500      # the batches' cumulative sums: 500 x 49,152 floats at a time
    generator = torch.Generator().manual_seed(0)
    tokens = torch.cat([draw(probs.expand(batch, -1), generator) for _ in range(n // batch)])
    counts = torch.bincount(tokens, minlength=49152).double() / n

    def within_4_sigma(observed: float, p: float) -> bool:    # binomial standard deviations
        return abs(observed - p) <= 4 * math.sqrt(p * (1 - p) / n)

    for token in (7, 1000, 40000):     # 1.7%, 5.0% and 8.1% of the mass
        assert within_4_sigma(float(counts[token]), float(probs[token])), token
    rest = torch.ones(49152, dtype=torch.bool)
    rest[[7, 1000, 40000]] = False
    assert within_4_sigma(float(counts[rest].sum()), float(probs[rest].sum()))


# ---- logprobs -------------------------------------------------------------------------------

def test_logprobs_are_raw_log_softmax_and_include_the_sampled_token() -> None:
    generator = torch.Generator().manual_seed(9)
    logits = torch.randn(3, 40, generator=generator) * 2
    params = [SamplingParams(temperature=0.0, logprobs=5),
              SamplingParams(temperature=0.7, logprobs=3, seed=1, repetition_penalty=1.3),
              SamplingParams(temperature=0.0)]
    requests = [make_request(p, prompt=[1, 2, 3]) for p in params]
    out = Sampler(seed=0)(logits.clone(), requests)
    reference = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[2] is None
    for row, n in [(0, 5), (1, 3)]:
        entry = out.logprobs[row]
        assert entry is not None
        top = reference[row].topk(n).indices.tolist()
        assert set(top) <= set(entry)
        assert out.token_ids[row][0] in entry
        assert set(entry) == set(top) | {out.token_ids[row][0]}
        for token, value in entry.items():
            assert value.logprob == pytest.approx(float(reference[row, token]), abs=1e-5)
            assert value.rank == 1 + int((reference[row] > reference[row, token]).sum())


def test_logprobs_for_a_sampled_token_outside_the_top_n() -> None:
    # Raw argmax is token 0; the repetition penalty makes greedy pick token 1 (rank 2).
    logits = torch.tensor([[5.0, 4.0, 4.5, -1.0, 0.0]])
    request = make_request(SamplingParams(temperature=0.0, logprobs=1, repetition_penalty=10.0), prompt=[0, 2])
    out = Sampler(seed=0)(logits.clone(), [request])
    reference = torch.log_softmax(logits[0], dim=-1)
    assert out.token_ids == [[1]]
    assert out.logprobs[0] is not None
    assert set(out.logprobs[0]) == {0, 1}          # the top-1 entry and the sampled token
    assert out.logprobs[0][0].logprob == pytest.approx(float(reference[0]), abs=1e-6)
    assert out.logprobs[0][1].logprob == pytest.approx(float(reference[1]), abs=1e-6)   # raw, not penalised
    assert (out.logprobs[0][0].rank, out.logprobs[0][1].rank) == (1, 3)   # 5.0 > 4.5 > 4.0


def test_logprobs_zero_gives_only_the_sampled_token() -> None:
    logits = torch.tensor([[0.3, 2.0, 1.0, -0.5]])
    request = make_request(SamplingParams(temperature=1.0, logprobs=0, seed=3))
    out = Sampler(seed=0)(logits, [request])
    entry = out.logprobs[0]
    assert entry is not None and list(entry) == out.token_ids[0]
    assert entry[out.token_ids[0][0]].logprob == pytest.approx(float(torch.log_softmax(logits[0], 0)[out.token_ids[0][0]]), abs=1e-6)


def test_sampler_does_not_modify_the_logits() -> None:
    logits = torch.tensor([[3.0, -1.0, 2.0, 0.5, 9.0]])
    before = logits.clone()
    request = make_request(SamplingParams(temperature=0.0, repetition_penalty=2.0, presence_penalty=1.0,
                                          min_tokens=2, max_tokens=4), prompt=[0, 1], output=[4])
    Sampler(seed=0)(logits, [request])
    assert torch.equal(logits, before)
