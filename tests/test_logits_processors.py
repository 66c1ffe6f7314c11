"""Each logits processor alone, on hand-made logits; the packed token bitmask against a plain
list of allowed ids; the sampler's metadata; block-hash extra keys.

The sampler tests (tests/test_sampler.py) cover the processors inside the whole pipeline;
these pin down what each one does by itself, including to draft rows.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from backend.core.kv_cache_manager import KVCacheManager
from backend.core.kv_cache_utils import block_extra_keys, hash_block, request_block_hashes
from backend.core.request import Request
from backend.sample.constraints import AllowedTokenIds, TokenConstraint, bitmask_from_ids, bitmask_to_bool
from backend.sample.bad_words import BadWords
from backend.sample.logits_processors import (AllowedTokensProcessor, BadWordsProcessor, LogitBiasProcessor,
                                              MinTokensProcessor, PenaltiesProcessor, blocks_drafts,
                                              default_processors)
from backend.sample.metadata import SamplingBatch, SamplingMetadata
from backend.sample.sampler import Sampler
from backend.sampling_params import SamplingParams
from tests.conftest import FIXED_BUDGET

EOS = 2
CPU = torch.device("cpu")
_arrivals = itertools.count()


def make_request(prompt: Sequence[int] = (0,), output: Sequence[int] = (), **params) -> Request:
    seq = next(_arrivals)
    request = Request(request_id=f"r{seq}", prompt_token_ids=list(prompt), sampling_params=SamplingParams(**params),
                      arrival_seq=seq, arrival_time=0.0, max_tokens=64, eos_token_ids=frozenset([EOS]))
    for token in output:
        request.append_token(token)
    return request


def run(processor, logits: torch.Tensor, requests: list[Request], drafts: list[list[int]] | None = None):
    batch = SamplingBatch(requests, drafts or [[] for _ in requests])
    state = processor.prepare(batch, logits.shape[-1], CPU)
    out = logits.clone()
    if state is not None:
        processor.apply(out, state)
    return state, out


# ---- penalties ---------------------------------------------------------------------------------
def test_penalties_change_only_their_requests_rows() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [2.0, -1.0, 0.5, 3.0]])
    plain = make_request(prompt=[0, 1])
    penalised = make_request(prompt=[0, 1], output=[3, 3], repetition_penalty=2.0, frequency_penalty=0.5,
                             presence_penalty=0.25)
    _, out = run(PenaltiesProcessor(), logits, [plain, penalised])
    assert torch.equal(out[0], logits[0])
    # Seen (prompt + output): 0, 1, 3. Positive / 2, negative * 2; then token 3 (output twice)
    # loses 2 * 0.5 (frequency) + 0.25 (presence).
    assert out[1].tolist() == [1.0, -2.0, 0.5, 1.5 - 1.0 - 0.25]


def test_penalties_skip_a_step_without_penalised_requests() -> None:
    state, _ = run(PenaltiesProcessor(), torch.zeros(2, 4), [make_request(), make_request(temperature=0.5)])
    assert state is None


# ---- min_tokens: stop-id suppression --------------------------------------------------------------
def test_min_tokens_bans_eos_and_stop_ids_until_reached() -> None:
    logits = torch.zeros(3, 6)
    early = make_request(output=[4], min_tokens=3, stop_token_ids=[5])
    done = make_request(output=[4, 4, 4], min_tokens=3, stop_token_ids=[5])
    ignoring_eos = make_request(min_tokens=2, ignore_eos=True, stop_token_ids=[1])
    _, out = run(MinTokensProcessor(), logits, [early, done, ignoring_eos])
    assert torch.isinf(out[0]).nonzero().flatten().tolist() == [EOS, 5]
    assert not torch.isinf(out[1]).any()
    assert torch.isinf(out[2]).nonzero().flatten().tolist() == [1]


def test_processors_that_read_earlier_tokens_block_drafts() -> None:
    assert blocks_drafts(make_request(min_tokens=2))
    assert blocks_drafts(make_request(presence_penalty=1.0))
    assert not blocks_drafts(make_request(allowed_token_ids=[1, 2]))
    assert not blocks_drafts(make_request(output=[4, 4], min_tokens=2))
    # A bias is the same on every row; bad words are checked per row against the drafts before it.
    assert not blocks_drafts(make_request(logit_bias={1: 5.0}))
    assert not blocks_drafts(with_bad_words(make_request(), [(3,), (4, 5)]))


# ---- logit_bias ----------------------------------------------------------------------------------
def test_logit_bias_is_added_to_every_row_of_its_request_drafts_included() -> None:
    logits = torch.randn(1 + 3, 6)
    plain = make_request()
    biased = make_request(logit_bias={"2": 3.5, 5: -1.25})
    _, out = run(LogitBiasProcessor(), logits, [plain, biased], [[], [1, 1]])
    assert torch.equal(out[0], logits[0])
    expected = logits[1:].clone()
    expected[:, 2] += 3.5
    expected[:, 5] -= 1.25
    assert torch.equal(out[1:], expected)
    assert run(LogitBiasProcessor(), logits[:1], [plain])[0] is None


def test_logit_bias_runs_before_the_repetition_penalty_as_in_vllm() -> None:
    # Token 1 (seen in the prompt) at 1.0, biased by +3: (1 + 3) / 2 = 2 beats token 0's 1.5;
    # penalised first, it would be 1 / 2 + 3 = 3.5 (the same argmax, so check the value).
    logits = torch.tensor([[1.5, 1.0, -5.0]])
    request = make_request(prompt=[1], logit_bias={1: 3.0}, repetition_penalty=2.0)
    meta = SamplingMetadata.build(SamplingBatch([request], [[]]), default_processors(), 3, CPU)
    out = logits.clone()
    for processor, state in meta.processor_states:
        processor.apply(out, state)
    assert out[0, 1].item() == pytest.approx(2.0)


# ---- bad_words -----------------------------------------------------------------------------------
def with_bad_words(request: Request, sequences: list[tuple[int, ...]]) -> Request:
    request.bad_words = BadWords(tuple(sequences))
    return request


def banned_columns(row: torch.Tensor) -> list[int]:
    return torch.isinf(row).nonzero().flatten().tolist()


def test_bad_words_ban_the_last_token_where_the_rest_ends_the_output() -> None:
    sequences = [(7,), (3, 4), (1, 2, 5)]
    logits = torch.zeros(4, 8)
    fresh = with_bad_words(make_request(prompt=[1, 2]), sequences)       # the prompt does not count
    after_3 = with_bad_words(make_request(output=[6, 3]), sequences)
    after_1_2 = with_bad_words(make_request(output=[1, 2]), sequences)
    after_2 = with_bad_words(make_request(output=[6, 2]), sequences)
    _, out = run(BadWordsProcessor(), logits, [fresh, after_3, after_1_2, after_2])
    assert [banned_columns(row) for row in out] == [[7], [4, 7], [5, 7], [7]]


def test_bad_words_check_each_draft_row_against_the_drafts_before_it() -> None:
    request = with_bad_words(make_request(output=[0]), [(3, 4), (4, 4, 5)])
    logits = torch.zeros(4, 6)
    _, out = run(BadWordsProcessor(), logits, [request], [[3, 4, 4]])
    # Row 0 follows [0]; row 1 follows [0, 3]: 4 banned; row 2 follows [0, 3, 4]; row 3 follows
    # [0, 3, 4, 4]: 5 banned.
    assert [banned_columns(row) for row in out] == [[], [4], [], [5]]


def test_a_draft_that_completes_a_bad_word_is_never_accepted() -> None:
    logits = torch.zeros(3, 8)
    logits[0, 1] = logits[1, 2] = logits[2, 4] = 10.0     # the unconstrained argmax of each row
    logits[:, 3] = 5.0
    assert Sampler(seed=0)(logits, [make_request(output=[5])], [[1, 2]]).token_ids == [[1, 2, 4]]
    request = with_bad_words(make_request(output=[5]), [(1, 2)])
    # Draft 1 is accepted; draft 2 would complete the bad word after it: row 1 bans it.
    assert Sampler(seed=0)(logits, [request], [[1, 2]]).token_ids == [[1, 3]]
    assert request.bad_words.num_valid_drafts([5], [1, 2, 2]) == 1


# ---- token masks ---------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(vocab=st.integers(1, 200), data=st.data())
def test_bitmask_round_trips_any_id_set(vocab: int, data) -> None:
    allowed = data.draw(st.sets(st.integers(0, vocab - 1), min_size=1))
    mask = bitmask_to_bool(bitmask_from_ids(sorted(allowed), vocab), vocab)[0]
    assert set(mask.nonzero().flatten().tolist()) == allowed


def test_bitmask_narrower_than_the_logits_disallows_the_extra_columns() -> None:
    mask = bitmask_to_bool(bitmask_from_ids([0, 31], 32), 40)[0]
    assert mask.nonzero().flatten().tolist() == [0, 31]


class _CountingConstraint(TokenConstraint):
    """Allows exactly token (number of tokens seen so far) % vocab: row j of a draft run must
    see the drafts before it, and the state must be unchanged afterwards."""

    def __init__(self, vocab: int) -> None:
        self.vocab, self.seen = vocab, 0

    def fill_bitmask(self, bitmask: torch.Tensor, drafts: list[int]) -> None:
        for j in range(len(drafts) + 1):
            bitmask[j] = bitmask_from_ids([(self.seen + j) % self.vocab], self.vocab)[0]

    def advance(self, token_id: int) -> None:
        self.seen += 1


def test_allowed_tokens_mask_every_row_of_a_constrained_request_drafts_included() -> None:
    vocab = 40
    free = make_request()
    fixed = make_request(allowed_token_ids=[3, 33])
    fixed.constraint = AllowedTokenIds([3, 33], vocab)
    counting = make_request(output=[7])
    counting.constraint = _CountingConstraint(vocab)
    counting.constraint.seen = 1
    logits = torch.randn(1 + 1 + 3, vocab)
    _, out = run(AllowedTokensProcessor(), logits, [free, fixed, counting], [[], [], [9, 9]])
    assert torch.equal(out[0], logits[0])
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [3, 33]
    for j, row in enumerate((2, 3, 4)):
        assert torch.isfinite(out[row]).nonzero().flatten().tolist() == [1 + j]
    assert counting.constraint.seen == 1


def test_a_draft_the_constraint_rejects_is_never_accepted() -> None:
    vocab = 8
    request = make_request(output=[5])
    request.constraint = _CountingConstraint(vocab)      # allows 0, then 1, then 2
    logits = torch.zeros(3, vocab)
    logits[:, 6] = 10.0                                   # the unconstrained argmax everywhere
    out = Sampler(seed=0)(logits, [request], [[0, 6]])
    assert out.token_ids == [[0, 1]]                      # draft 0 allowed and accepted; 6 rejected


# ---- the sampler's metadata --------------------------------------------------------------------
def test_metadata_splits_greedy_random_and_seeded_rows() -> None:
    greedy = make_request(temperature=0.0)
    random = make_request(temperature=0.7, top_k=5)
    seeded = make_request(temperature=1.0, seed=3, top_p=0.5)
    batch = SamplingBatch([greedy, random, seeded], [[], [11, 12], []])
    meta = SamplingMetadata.build(batch, [PenaltiesProcessor()], vocab_size=100, device=CPU)
    assert [list(r) for r in batch.rows] == [[0], [1, 2, 3], [4]]
    assert meta.random_rows.tolist() == [1, 2, 3]
    assert meta.random_filter.temperature.flatten().tolist() == pytest.approx([0.7] * 3)
    assert meta.random_filter.top_k.flatten().tolist() == [5, 5, 5]
    assert meta.random_filter.top_p is None and meta.random_filter.min_p is None
    assert [s.index for s in meta.seeded] == [2] and meta.seeded[0].filter.top_p.item() == pytest.approx(0.5)
    assert not meta.all_greedy and meta.processor_states == []


# ---- block-hash extra keys ---------------------------------------------------------------------
def test_extra_keys_separate_cached_prefixes() -> None:
    tokens = list(range(32))
    base = make_request(prompt=tokens)
    salted = make_request(prompt=tokens, cache_salt="tenant-a")
    other_salt = make_request(prompt=tokens, cache_salt="tenant-b")
    adapter = make_request(prompt=tokens)
    adapter.lora_id = 1
    hashes = {name: request_block_hashes(r, 16) for name, r in
              [("base", base), ("salted", salted), ("other", other_salt), ("adapter", adapter)]}
    assert hashes["base"] == [hash_block(None, tokens[:16]), hash_block(hash_block(None, tokens[:16]), tokens[16:])]
    assert len({h[1] for h in hashes.values()}) == 4       # the salt reaches later blocks by chaining
    assert block_extra_keys(salted, 1) == ()                # ... and is hashed into the first block only
    assert block_extra_keys(adapter, 1) == (("lora", 1),)


def test_a_prefix_cached_under_one_salt_is_not_served_to_another() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True)
    first = make_request(prompt=list(range(9)), cache_salt="a")
    hits, _ = kv.get_computed_blocks(first)
    assert kv.allocate_slots(first, first.num_tokens, hits)
    first.num_computed_tokens = first.num_tokens
    assert kv.get_computed_blocks(make_request(prompt=list(range(9)), cache_salt="b"))[1] == 0
    assert kv.get_computed_blocks(make_request(prompt=list(range(9))))[1] == 0
    assert kv.get_computed_blocks(make_request(prompt=list(range(9)), cache_salt="a"))[1] == 8


# ---- through the engine ------------------------------------------------------------------------
@pytest.mark.parametrize("speculative", [False, True])
def test_allowed_token_ids_hold_in_the_engine(model_dir, speculative: bool) -> None:
    from backend import Engine, EngineConfig

    config = EngineConfig(model=str(model_dir), **FIXED_BUDGET, num_kv_blocks=64, max_num_seqs=4,
                          speculative_method="ngram" if speculative else "none")
    engine = Engine(config)
    allowed = [28, 253, 314, 1217, 2]       # a few ids of the model's vocabulary, EOS among them
    params = [SamplingParams(max_tokens=24, temperature=t, seed=s, allowed_token_ids=allowed, ignore_eos=True)
              for t, s in ((0.0, None), (1.0, 7), (1.0, None))]
    outputs = engine.generate(["Repeat after me: a b a b a b a b", "Hello", "Once upon a time"], params)
    for output in outputs:
        assert len(output.token_ids) == 24 and set(output.token_ids) <= set(allowed)
    engine.check_invariants()
