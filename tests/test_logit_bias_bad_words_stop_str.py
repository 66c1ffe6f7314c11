"""logit_bias, bad_words and include_stop_str_in_output through the engine (SmolLM2, float32,
greedy unless said): each changes the output where vLLM's meaning says it must; speculative
drafts change no output (the processors run on every verified position); n > 1 children
each follow their own history; structured outputs still hold.

The processors alone, on hand-made logits and draft rows: tests/test_logits_processors.py;
the detokenizer alone: tests/test_detokenizer.py; bad input: tests/test_validation.py.
"""

from __future__ import annotations

import queue
from pathlib import Path
from typing import Any

import pytest

from backend import Engine, EngineConfig, RequestOutput, SamplingParams
from backend.engine.loop import EngineLoop
from backend.engine.parallel_sampling import ParallelOutput, child_params
from tests.conftest import FIXED_BUDGET

SPEC = dict(speculative_method="ngram", num_speculative_tokens=3, speculative_max_batch_size=64)
FRANCE = "The capital of France is"               # greedy: " Paris.\n\nThe answer is: 2018-..."
NEW_YORK = "New York is a city in"                # greedy: " New York State, New York, ..."
FRUIT = "Repeat this list exactly: apples, pears, plums, figs, dates, limes. Again: apples, pears,"
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), **FIXED_BUDGET, num_kv_blocks=256))


@pytest.fixture(scope="module")
def spec_engine(model_dir: Path) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), **FIXED_BUDGET, num_kv_blocks=256, **SPEC))


def token(tokenizer: Any, text: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == 1, f"{text!r} is {ids}"
    return ids[0]


def greedy(engine: Engine, prompt: str, **params: Any) -> RequestOutput:
    output = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, **params))[0]
    engine.check_invariants()
    return output


def contains(tokens: list[int], sequence: list[int]) -> bool:
    return any(tokens[i:i + len(sequence)] == sequence for i in range(len(tokens) - len(sequence) + 1))


def first_difference(a: list[int], b: list[int]) -> int:
    return next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)


# ---- logit_bias ----------------------------------------------------------------------------------
def test_a_bias_of_plus_100_forces_its_token(engine: Engine, tokenizer) -> None:
    banana = token(tokenizer, " banana")
    assert banana not in greedy(engine, FRANCE).token_ids
    output = greedy(engine, FRANCE, logit_bias={str(banana): 100})    # keys as JSON sends them
    assert output.token_ids == [banana] * MAX_TOKENS


def test_a_bias_of_minus_100_on_the_greedy_token_changes_the_output(engine: Engine, tokenizer) -> None:
    paris = token(tokenizer, " Paris")
    plain = greedy(engine, FRANCE)
    assert plain.token_ids[0] == paris
    biased = greedy(engine, FRANCE, logit_bias={paris: -100})
    assert biased.token_ids[0] != paris and paris not in biased.token_ids
    # A bias beyond the range is clamped to it, as vLLM does: the same output as -100.
    assert greedy(engine, FRANCE, logit_bias={paris: -1e6}).token_ids == biased.token_ids


# ---- bad_words -----------------------------------------------------------------------------------
def test_a_single_token_bad_word_is_banned_everywhere(engine: Engine, tokenizer) -> None:
    plain = greedy(engine, FRANCE)
    banned = greedy(engine, FRANCE, bad_words=["Paris"])
    spellings = {token(tokenizer, "Paris"), token(tokenizer, " Paris")}
    assert plain.token_ids[0] in spellings
    assert banned.token_ids[0] not in spellings and not spellings & set(banned.token_ids)


def test_a_multi_token_bad_word_bans_its_last_token_after_the_rest(engine: Engine, tokenizer) -> None:
    new, york = token(tokenizer, " New"), token(tokenizer, " York")
    plain = greedy(engine, NEW_YORK)
    assert plain.token_ids[:2] == [new, york]
    banned = greedy(engine, NEW_YORK, bad_words=["New York"])
    # " New" alone is allowed; " York" right after it is not, so the output differs exactly there.
    assert banned.token_ids[0] == new and first_difference(plain.token_ids, banned.token_ids) == 1
    assert not contains(banned.token_ids, [new, york])
    assert not contains(banned.token_ids, tokenizer.encode("New York", add_special_tokens=False))
    assert "New York" not in banned.text


def test_bad_words_hold_under_a_structured_output(engine: Engine) -> None:
    prompt = "Classify intent of the sentence: Harry Potter is underrated. "
    choice = {"choice": ["Positive", "Negative"]}
    assert greedy(engine, prompt, structured_outputs=choice).text == "Positive"
    assert greedy(engine, prompt, structured_outputs=choice, bad_words=["Positive"]).text == "Negative"


# ---- include_stop_str_in_output ----------------------------------------------------------------
def stream(engine: Engine, prompt: str, **params: Any) -> list[RequestOutput]:
    engine.add_request("streamed", prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, **params))
    outputs: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].finished and "".join(o.new_text for o in outputs) == outputs[-1].text
    return outputs


def test_a_stop_string_stays_in_the_text_only_when_asked(engine: Engine) -> None:
    text = greedy(engine, FRANCE).text
    stop = "e ans"                                  # spans " The" + " answer"
    index = text.index(stop)
    excluded = stream(engine, FRANCE, stop=[stop])[-1]
    included = stream(engine, FRANCE, stop=[stop], include_stop_str_in_output=True)[-1]
    assert excluded.text == text[:index]
    # The text ends with the stop string: the rest of the token that completed it is cut (vLLM).
    assert included.text == text[:index + len(stop)] and not text[:index + len(stop)].endswith("answer")
    assert included.token_ids == excluded.token_ids
    assert (included.finish_reason, included.stop_reason) == (excluded.finish_reason, excluded.stop_reason) \
        == ("stop", stop)


def test_a_stop_tokens_text_stays_only_when_asked(engine: Engine, tokenizer) -> None:
    plain = greedy(engine, FRANCE)
    k = plain.token_ids.index(token(tokenizer, " answer"))
    stop_id = plain.token_ids[k]
    excluded = greedy(engine, FRANCE, stop_token_ids=[stop_id])
    included = greedy(engine, FRANCE, stop_token_ids=[stop_id], include_stop_str_in_output=True)
    assert excluded.text == tokenizer.decode(plain.token_ids[:k])
    assert included.text == tokenizer.decode(plain.token_ids[:k + 1]) == excluded.text + " answer"
    assert included.stop_reason == excluded.stop_reason == stop_id


def test_with_the_stop_string_kept_nothing_is_held_back(engine: Engine) -> None:
    """A text that may grow into the stop string is held back while stop strings are cut, and
    streamed at once while they are kept (vLLM holds back nothing then)."""
    excluded = stream(engine, FRANCE, stop=["Paris!"])
    included = stream(engine, FRANCE, stop=["Paris!"], include_stop_str_in_output=True)
    assert [o.new_token_ids for o in excluded] == [o.new_token_ids for o in included]
    assert excluded[0].new_text == " "              # "Paris" may still become "Paris!"
    assert included[0].new_text == " Paris"
    assert included[-1].text == excluded[-1].text and included[-1].finish_reason == "length"


# ---- speculative drafts ------------------------------------------------------------------------
SPEC_CASES = {   # prompt, and the parameters given the tokenizer
    "bad_words": (NEW_YORK, lambda tokenizer: dict(bad_words=["New York"])),    # " New England, New England, ..."
    "logit_bias": (FRANCE, lambda tokenizer: dict(logit_bias={token(tokenizer, " banana"): 100})),
    "include_stop_str_in_output": (FRUIT, lambda tokenizer: dict(stop=["limes"], include_stop_str_in_output=True)),
}


@pytest.mark.parametrize("case", list(SPEC_CASES))
def test_drafts_change_no_output(engine: Engine, spec_engine: Engine, tokenizer, case: str) -> None:
    """Each case's output repeats itself, so drafts are proposed and accepted; every verified
    position is processed as a step of its own would be, so the tokens are the same."""
    prompt, make_params = SPEC_CASES[case]
    params = make_params(tokenizer)
    accepted = spec_engine.spec_counts["spec_accepted_tokens"]
    drafted = greedy(spec_engine, prompt, **params)
    assert spec_engine.spec_counts["spec_accepted_tokens"] > accepted, "no draft was accepted"
    plain = greedy(engine, prompt, **params)
    assert (drafted.token_ids, drafted.text, drafted.stop_reason) == (plain.token_ids, plain.text, plain.stop_reason)


# ---- n > 1 ---------------------------------------------------------------------------------------
def run_parallel(engine: Engine, prompt: str, params: SamplingParams) -> list[RequestOutput]:
    outputs: queue.Queue = queue.Queue()
    loop = EngineLoop(engine).start()
    try:
        loop.submit("parent", prompt, params, outputs.put)
        while not isinstance(item := outputs.get(timeout=120), BaseException) and not item.finished:
            pass
    finally:
        loop.stop()
    assert isinstance(item, ParallelOutput), item
    return item.outputs


def test_each_child_of_n_follows_its_own_history(engine: Engine, tokenizer) -> None:
    new, york, the = token(tokenizer, " New"), token(tokenizer, " York"), token(tokenizer, " the")
    sampled = dict(n=4, seed=5, temperature=1.0, max_tokens=16)
    plain = run_parallel(engine, NEW_YORK, SamplingParams(**sampled))
    assert any(contains(c.token_ids, [new, york]) for c in plain) and any(the in c.token_ids for c in plain)
    params = SamplingParams(**sampled, bad_words=["New York"], logit_bias={the: -100}, stop=["."],
                            include_stop_str_in_output=True)
    singles = engine.generate([NEW_YORK] * 4, [child_params(params, i) for i in range(4)])
    children = run_parallel(engine, NEW_YORK, params)
    for i, (child, single) in enumerate(zip(children, singles)):
        assert (child.token_ids, child.text) == (single.token_ids, single.text), f"child {i}"
        assert not contains(child.token_ids, [new, york]) and the not in child.token_ids
        if child.stop_reason == ".":
            assert child.text.endswith(".")
    assert len({tuple(c.token_ids) for c in children}) > 1
