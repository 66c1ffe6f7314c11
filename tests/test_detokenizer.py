"""Incremental detokenization and stop handling, with the real SmolLM2 tokenizer and model.

Unit level: IncrementalDetokenizer fed one token at a time must stream deltas that add up
to exactly ``tokenizer.decode(ids, skip_special_tokens=True)``, never leak half a UTF-8
character or any part of a stop string. Engine level: stop strings, stop token ids, EOS
and max_tokens end greedy generations exactly where a first, unconstrained run says.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from backend import Engine, EngineConfig, RequestOutput, SamplingParams
from backend.engine.detokenizer import IncrementalDetokenizer, ids_decoder, rust_tokenizer
from tests.conftest import FIXED_BUDGET

MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "smollm2-135m-instruct"
EOS = 2
STORY_PROMPT = "Once upon a time"
STORY_TOKENS = 24

TEXTS = [
    "Café naïve — déjà vu, Ünïcödé ñ",
    "日本語のテキスト 中文字符",
    "🎉👍🏽 emoji 😀😃 and 🧑‍🚀",
    " leading space and  double  spaces",
    "line one\nline two\n\n\tindented\r\nend\n",
    "mixed: 価格は€5です 🎉\n  — ok",
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    if not (MODEL_DIR / "tokenizer.json").is_file():
        pytest.fail(f"{MODEL_DIR} is missing: run `make model`")
    return AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(EngineConfig(model=str(MODEL_DIR), **FIXED_BUDGET, num_kv_blocks=64, block_size=16))


@dataclass
class Streamed:
    final: RequestOutput
    outputs: list[RequestOutput]

    @property
    def deltas(self) -> list[str]:
        return [o.new_text for o in self.outputs]


def stream(engine: Engine, request_id: str, prompt: str | list[int], params: SamplingParams) -> Streamed:
    """Run one request alone through add_request / step, keeping every output it produced."""
    engine.add_request(request_id, prompt, params)
    outputs: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        outputs.extend(o for o in engine.step() if o.request_id == request_id)
    engine.check_invariants()
    stats = engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total
    assert outputs and outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    return Streamed(outputs[-1], outputs)


@pytest.fixture(params=["python", "decode_stream"])
def rust(request: pytest.FixtureRequest, tokenizer: Any) -> Any:
    """The detokenizer's two paths: its Python decodes alone (the reference), or the Rust
    tokenizers' DecodeStream (what the engine runs for SmolLM2's tokenizer)."""
    if request.param == "python":
        return None
    rust = rust_tokenizer(tokenizer)
    assert rust is not None
    return rust


def new_detokenizer(tokenizer: Any, rust: Any, prompt_ids: Sequence[int], stop: list[str],
                    include_stop: bool = False) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tokenizer, list(prompt_ids), stop, include_stop, rust=rust)


def feed(tokenizer: Any, rust: Any, ids: Sequence[int], stop: list[str] | None = None,
         prompt_ids: Sequence[int] = (), include_stop: bool = False,
         ) -> tuple[list[str], str | None, IncrementalDetokenizer, int]:
    """Feed ids one by one as the engine does; returns deltas, the stop hit, the detokenizer
    and how many ids were consumed (generation ends at a stop string)."""
    detok = new_detokenizer(tokenizer, rust, prompt_ids, stop or [], include_stop)
    deltas: list[str] = []
    for n, token in enumerate(ids, start=1):
        delta, hit = detok.add_token(token)
        deltas.append(delta)
        if hit is not None:
            return deltas, hit, detok, n
    deltas.append(detok.finish())
    return deltas, None, detok, len(ids)


# ---- streaming == full decode ---------------------------------------------------------------

@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("prompt", ["", "Hello", "chat"])
def test_deltas_concatenate_to_full_decode(tokenizer: Any, rust: Any, text: str, prompt: str) -> None:
    if prompt == "chat":
        chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                             add_generation_prompt=True)
        prompt_ids = tokenizer(chat).input_ids
    else:
        prompt_ids = tokenizer(prompt).input_ids if prompt else []
    ids = tokenizer(text).input_ids
    deltas, hit, detok, _ = feed(tokenizer, rust, ids, prompt_ids=prompt_ids)
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    assert expected == text                      # the tokenizer round-trips these texts
    assert hit is None
    assert "".join(deltas) == expected
    assert detok.text == expected
    for delta in deltas:
        assert "\ufffd" not in delta, f"replacement character streamed: {deltas!r}"


def test_multibyte_characters_really_span_several_tokens(tokenizer: Any, rust: Any) -> None:
    # Precondition of the tests above: single tokens decode to U+FFFD for these characters.
    for text in ("🎉👍🏽", "日本語のテキスト"):
        ids = tokenizer(text).input_ids
        assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
        deltas, _, _, _ = feed(tokenizer, rust, ids)
        assert "" in deltas[:-1]                  # some tokens had to be held back


def test_ascii_tokens_are_released_immediately(tokenizer: Any, rust: Any) -> None:
    ids = tokenizer(" leading space\n\nnew line, ok").input_ids
    deltas, _, _, _ = feed(tokenizer, rust, ids)
    assert deltas[:-1] == [tokenizer.decode([i]) for i in ids]
    assert deltas[-1] == ""                       # finish() had nothing left to release


def test_special_tokens_in_the_stream_are_skipped(tokenizer: Any, rust: Any) -> None:
    ids = tokenizer("Hi").input_ids + [EOS] + tokenizer(" there 🎉").input_ids + [1]
    deltas, _, _, _ = feed(tokenizer, rust, ids)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == "Hi there 🎉"


# ---- the decode the detokenizer calls --------------------------------------------------------

@pytest.mark.parametrize("text", ["Say: 𝕏𝕏 ok", "価格は€5です 🎉 done", "🧑‍🚀 and 日本語"])
def test_a_prompt_that_ends_inside_a_character_is_no_context(tokenizer: Any, rust: Any, text: str) -> None:
    """Ids cut inside a character and sent back as the prompt (a continuation): the new tokens'
    text is exactly their own decode, the prompt's half character left out of it, on both paths."""
    ids = tokenizer(text).input_ids
    cuts = [n for n in range(1, len(ids)) if tokenizer.decode(ids[:n]).endswith("\ufffd")]
    assert cuts   # the precondition: these texts have characters that span tokens
    for cut in cuts:
        prompt, generated = ids[:cut], ids[cut:]
        deltas, hit, _, _ = feed(tokenizer, rust, generated, ["Say", "価格"], prompt_ids=prompt)
        assert hit is None, (cut, deltas)
        assert "".join(deltas) == tokenizer.decode(generated, skip_special_tokens=True), cut


def test_the_decode_stream_releases_what_the_python_path_releases(tokenizer: Any) -> None:
    """Random ids over the whole vocabulary (byte pieces that are half a character, special
    tokens, rare merges), after random prompts: the same delta at every token, the same text
    held back and released by finish, whatever the stop strings."""
    rust = rust_tokenizer(tokenizer)
    rng = random.Random(1)
    for case in range(60):
        prompt = [rng.randrange(len(tokenizer)) for _ in range(rng.choice([0, 1, 3, 8]))]
        ids = [rng.randrange(len(tokenizer)) if rng.random() < 0.7 else rng.randrange(256) for _ in range(40)]
        stop = ["e", "th"] if case % 3 == 0 else []
        reference = feed(tokenizer, None, ids, stop, prompt)
        streamed = feed(tokenizer, rust, ids, stop, prompt)
        assert streamed[0] == reference[0], (prompt, ids)
        assert (streamed[1], streamed[2].text, streamed[3]) == (reference[1], reference[2].text, reference[3])


def test_a_failing_decode_stream_hands_over_to_the_python_path(tokenizer: Any) -> None:
    """A stream that raises (here: no Rust tokenizer to step with) is dropped, and the Python
    path goes on from the same window: nothing is lost or repeated."""
    ids = tokenizer("Hi 🎉 there, 日本語!").input_ids
    deltas, _, detok, _ = feed(tokenizer, object(), ids)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    assert detok._stream is None


def test_the_direct_decode_is_the_tokenizers_decode(tokenizer: Any) -> None:
    """ids_decoder calls the Rust tokenizer itself for SmolLM2's tokenizer (loaded as the engine
    and as AutoTokenizer load it), and gives what tokenizer.decode gives: random ids, special
    tokens among them, single bytes of multi-byte characters, the empty list."""
    from backend.engine.tokenizer import load_tokenizer

    rng = random.Random(0)
    special = sorted(tokenizer.all_special_ids)
    for candidate in (tokenizer, load_tokenizer(str(MODEL_DIR))):
        decode = ids_decoder(candidate)
        batches = [[], special, [EOS, 1, EOS], candidate("🎉 日本 ñ").input_ids]
        batches += [[rng.randrange(len(candidate)) for _ in range(rng.randrange(1, 9))] for _ in range(3000)]
        batches += [[*b, rng.choice(special)] for b in batches[-200:]]
        for ids in batches:
            assert decode(ids) == candidate.decode(ids, skip_special_tokens=True), ids
        expected = candidate.decode([42, EOS, 43], skip_special_tokens=True)
        candidate.decode = None        # the direct path never calls transformers' decode
        try:
            assert decode([42, EOS, 43]) == expected
        finally:
            del candidate.decode


def test_a_decode_transformers_changes_is_called_as_it_is(tokenizer: Any) -> None:
    """Where transformers' decode is more than the Rust one (space clean-up on, or a tokenizer
    class with its own _decode), the detokenizer goes through tokenizer.decode."""
    from backend.engine.tokenizer import load_tokenizer
    from transformers import TokenizersBackend

    class MarkedDecode(TokenizersBackend):
        def _decode(self, token_ids, skip_special_tokens=False, **kwargs):
            return "<" + super()._decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs) + ">"

    marked = MarkedDecode.from_pretrained(str(MODEL_DIR))
    assert ids_decoder(marked)([42, 43]) == "<" + tokenizer.decode([42, 43]) + ">"
    cleaned = load_tokenizer(str(MODEL_DIR))
    cleaned.clean_up_tokenization_spaces = True
    calls: list[list[int]] = []
    real = cleaned.decode
    cleaned.decode = lambda ids, **kwargs: calls.append(list(ids)) or real(ids, **kwargs)
    assert ids_decoder(cleaned)([42, 43]) == tokenizer.decode([42, 43], skip_special_tokens=True)
    assert calls == [[42, 43]]


def test_finish_releases_an_incomplete_character(tokenizer: Any, rust: Any) -> None:
    ids = tokenizer("ok 🎉").input_ids
    truncated = ids[:-1]                          # the emoji's last byte never comes
    deltas, _, _, _ = feed(tokenizer, rust, truncated)
    assert "".join(deltas) == tokenizer.decode(truncated, skip_special_tokens=True)
    assert "\ufffd" not in "".join(deltas[:-1])   # only finish() may release the broken tail


# ---- stop strings ---------------------------------------------------------------------------

FOX = "The quick brown fox jumps over the lazy dog."


def assert_no_stop_prefix_leaked(deltas: list[str], final_text: str) -> None:
    """Every prefix of the stream is a prefix of the final text, which ends before the stop."""
    streamed = ""
    for delta in deltas:
        streamed += delta
        assert final_text.startswith(streamed), f"streamed {streamed!r} beyond {final_text!r}"
    assert streamed == final_text


@pytest.mark.parametrize(("stop", "expected_text", "expected_tokens"), [
    ("brown fox", "The quick ", 4),          # spans " brown" + " fox"
    ("fox jumps over", "The quick brown ", 6),   # spans three tokens
    ("k b", "The quic", 3),                  # ends one character into a token
    ("row", "The quick b", 3),               # inside a single token
    ("The", "", 1),                          # the very first token
    ("dog.", "The quick brown fox jumps over the lazy ", 10),   # the last two tokens
])
def test_stop_string_ends_generation_and_is_not_emitted(tokenizer: Any, rust: Any, stop: str, expected_text: str,
                                                        expected_tokens: int) -> None:
    ids = tokenizer(FOX).input_ids
    deltas, hit, detok, consumed = feed(tokenizer, rust, ids, [stop])
    assert hit == stop
    assert consumed == expected_tokens
    assert detok.text == expected_text
    assert stop not in "".join(deltas)
    assert_no_stop_prefix_leaked(deltas, expected_text)


def test_stop_string_spanning_multibyte_tokens(tokenizer: Any, rust: Any) -> None:
    text = "Price: 日本語のテキスト and more"
    ids = tokenizer(text).input_ids
    deltas, hit, detok, _ = feed(tokenizer, rust, ids, ["本語の"])
    assert hit == "本語の"
    assert detok.text == "Price: 日"
    assert_no_stop_prefix_leaked(deltas, "Price: 日")
    assert all("\ufffd" not in d for d in deltas)


def test_partial_stop_that_is_not_a_stop_is_released(tokenizer: Any, rust: Any) -> None:
    ids = tokenizer(FOX).input_ids
    detok = new_detokenizer(tokenizer, rust, [], ["lazy cat"])
    streamed = ""
    held_back_seen = False
    for token in ids:
        delta, hit = detok.add_token(token)
        assert hit is None
        streamed += delta
        if streamed.endswith("the ") and detok.text.endswith("lazy"):
            held_back_seen = True                 # "lazy" could still become "lazy cat"
        if detok.text.endswith("dog"):
            # " dog" rules the stop out: everything is released before finish().
            assert streamed == detok.text
    assert held_back_seen
    assert streamed == FOX
    assert detok.finish() == ""


def test_partial_stop_at_the_end_is_released_by_finish(tokenizer: Any, rust: Any) -> None:
    text = "over the lazy dog"
    ids = tokenizer(text).input_ids
    detok = new_detokenizer(tokenizer, rust, [], [" dog!"])
    streamed = "".join(detok.add_token(t)[0] for t in ids)
    assert streamed == "over the lazy"            # " dog" is held back: it may become " dog!"
    assert detok.finish() == " dog"


@pytest.mark.parametrize("stops", [["brown", "quick brown"], ["quick brown", "brown"],
                                   ["ick", "qu"], ["over", "fox", "jumps"], ["e", "Th"]])
def test_earliest_stop_string_wins(tokenizer: Any, rust: Any, stops: list[str]) -> None:
    ids = tokenizer(FOX).input_ids
    deltas, hit, detok, _ = feed(tokenizer, rust, ids, stops)
    matches = [(FOX.find(s), s) for s in stops]
    # The stop that completes first in the stream ends it; among those completing in the same
    # token, the one starting earliest in the text. Compute it independently by prefix length.
    completed_at = {s: next(n for n in range(1, len(ids) + 1)
                            if s in tokenizer.decode(ids[:n])) for s in stops}
    first_step = min(completed_at.values())
    expected_index, expected_stop = min((i, s) for i, s in matches if completed_at[s] == first_step)
    assert hit == expected_stop
    assert detok.text == FOX[:expected_index]
    assert_no_stop_prefix_leaked(deltas, FOX[:expected_index])


def test_earliest_match_wins_within_one_token_regardless_of_list_order(tokenizer: Any, rust: Any) -> None:
    ids = tokenizer(FOX).input_ids
    for stops in (["ick", "qu"], ["qu", "ick"]):
        _, hit, detok, consumed = feed(tokenizer, rust, ids, stops)
        assert (hit, detok.text, consumed) == ("qu", "The ", 2)


@pytest.mark.parametrize(("stop", "expected_text", "expected_tokens"), [
    ("brown fox", "The quick brown fox", 4),
    ("k b", "The quick b", 3),               # the rest of " brown" is cut, as in vLLM
    ("row", "The quick brow", 3),
    ("dog.", FOX, 10),
])
def test_include_stop_keeps_the_stop_string_and_holds_nothing_back(tokenizer: Any, rust: Any, stop: str, expected_text: str,
                                                                   expected_tokens: int) -> None:
    ids = tokenizer(FOX).input_ids
    detok = new_detokenizer(tokenizer, rust, [], [stop, "quick brown cat"], include_stop=True)
    streamed, hit, consumed = "", None, 0
    while hit is None:
        delta, hit = detok.add_token(ids[consumed])
        consumed += 1
        streamed += delta
        if hit is None:   # every character so far is out, partial stop strings included
            assert streamed == tokenizer.decode(ids[:consumed])
    assert (hit, consumed, detok.text, streamed) == (stop, expected_tokens, expected_text, expected_text)


def test_a_stop_string_completed_before_min_tokens_is_not_found_later(tokenizer: Any, rust: Any) -> None:
    """Only stop strings that end in the new text count (vLLM's window): "quick", completed
    while stops were not checked, must not cut text that was already released."""
    ids = tokenizer(FOX).input_ids
    for include_stop in (False, True):
        detok = new_detokenizer(tokenizer, rust, [], ["quick", "a much longer stop string"], include_stop)
        streamed = "".join(detok.add_token(t, check_stop=False)[0] for t in ids[:2])
        for token in ids[2:]:
            delta, hit = detok.add_token(token)
            assert hit is None
            streamed += delta
        assert streamed + detok.finish() == FOX == detok.text


def test_the_engine_loads_the_tokenizer_autotokenizer_loads(tokenizer: Any) -> None:
    """load_tokenizer skips AutoTokenizer for a plain tokenizer.json (server start-up time);
    the tokenizer it gets must be AutoTokenizer's in every respect the engine uses."""
    from transformers.models.auto.tokenization_auto import MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS

    from backend.engine.tokenizer import PLAIN_TOKENIZER_MODEL_TYPES, load_tokenizer, loads_tokenizer_directly

    assert not PLAIN_TOKENIZER_MODEL_TYPES & set(MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS)
    assert loads_tokenizer_directly(str(MODEL_DIR))
    direct = load_tokenizer(str(MODEL_DIR))
    assert type(direct) is type(tokenizer)
    assert direct.get_vocab() == tokenizer.get_vocab()
    assert (direct.all_special_ids, direct.eos_token_id, direct.bos_token_id) == (
        tokenizer.all_special_ids, tokenizer.eos_token_id, tokenizer.bos_token_id)
    for text in TEXTS + [FOX]:
        ids = tokenizer(text).input_ids
        assert direct(text).input_ids == ids
        assert direct.decode(ids, skip_special_tokens=True) == tokenizer.decode(ids, skip_special_tokens=True)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXTS[0]}]
    assert (direct.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))


def test_other_tokenizers_go_through_autotokenizer(tmp_path: Path) -> None:
    from backend.engine.tokenizer import loads_tokenizer_directly

    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        (tmp_path / name).write_bytes((MODEL_DIR / name).read_bytes())
    assert loads_tokenizer_directly(str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "qwen2"}))
    assert not loads_tokenizer_directly(str(tmp_path))      # transformers remaps qwen2's class
    (tmp_path / "config.json").write_text(json.dumps(config))
    tokenizer_config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "auto_map": {}}))
    assert not loads_tokenizer_directly(str(tmp_path))      # custom code
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "tokenizer_class": "LlamaTokenizer"}))
    assert not loads_tokenizer_directly(str(tmp_path))


# ---- engine level ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def story(engine: Engine) -> Streamed:
    """First run: greedy, no stop; the reference for the runs below."""
    return stream(engine, "story-ref", STORY_PROMPT, SamplingParams(temperature=0.0, max_tokens=STORY_TOKENS))


@dataclass
class StopChoice:
    stop: str
    index: int            # where the stop string starts in the reference text
    last_token: int       # index of the token that completes it


@pytest.fixture(scope="module")
def stop_choice(story: Streamed, tokenizer: Any) -> StopChoice:
    """A substring of the reference text spanning a token boundary in its middle."""
    ids, text = story.final.token_ids, story.final.text
    pieces = [tokenizer.decode([t]) for t in ids]
    middle = len(ids) // 2
    for k in sorted(range(2, len(ids) - 2), key=lambda k: abs(k - middle)):
        if len(pieces[k - 1]) < 2 or len(pieces[k]) < 2:
            continue
        boundary = len(tokenizer.decode(ids[:k]))
        candidate = text[boundary - 2: boundary + 2]
        if text.find(candidate) == boundary - 2 and candidate.strip():
            return StopChoice(candidate, boundary - 2, k)
    raise AssertionError(f"no usable token boundary in {text!r}")


def test_reference_run_is_length_limited(story: Streamed, tokenizer: Any) -> None:
    final = story.final
    assert final.finish_reason == "length" and final.stop_reason is None
    assert len(final.token_ids) == STORY_TOKENS
    assert final.text == tokenizer.decode(final.token_ids, skip_special_tokens=True)
    assert "".join(story.deltas) == final.text
    assert [t for o in story.outputs for t in o.new_token_ids] == final.token_ids


def test_engine_stop_string_from_greedy_output(engine: Engine, story: Streamed, stop_choice: StopChoice) -> None:
    run = stream(engine, "story-stop", STORY_PROMPT,
                 SamplingParams(temperature=0.0, max_tokens=STORY_TOKENS, stop=[stop_choice.stop]))
    final = run.final
    assert final.finish_reason == "stop"
    assert final.stop_reason == stop_choice.stop
    assert final.text == story.final.text[:stop_choice.index]
    assert stop_choice.stop not in final.text
    assert "".join(run.deltas) == final.text
    assert_no_stop_prefix_leaked(run.deltas, final.text)
    # Generation ended on the token that completed the stop string, not later.
    assert final.token_ids == story.final.token_ids[:stop_choice.last_token + 1]


def test_engine_output_text_never_runs_ahead_of_the_stream(engine: Engine, stop_choice: StopChoice) -> None:
    """RequestOutput.text is "everything released so far": at every step it must equal the
    concatenated new_text deltas, so it can never show a held-back piece of a stop string."""
    run = stream(engine, "story-stop-text", STORY_PROMPT,
                 SamplingParams(temperature=0.0, max_tokens=STORY_TOKENS, stop=[stop_choice.stop]))
    streamed = ""
    for output in run.outputs:
        streamed += output.new_text
        assert output.text == streamed, (f"output.text {output.text!r} != streamed {streamed!r} "
                                         f"(stop {stop_choice.stop!r})")


def test_engine_multiple_stop_strings_earliest_wins(engine: Engine, story: Streamed,
                                                    stop_choice: StopChoice) -> None:
    text = story.final.text
    later = text[len(text) - 6:].strip()
    assert text.find(later) > stop_choice.index
    run = stream(engine, "story-multi", STORY_PROMPT,
                 SamplingParams(temperature=0.0, max_tokens=STORY_TOKENS, stop=[later, stop_choice.stop]))
    assert run.final.stop_reason == stop_choice.stop
    assert run.final.text == text[:stop_choice.index]
    assert "".join(run.deltas) == run.final.text


def test_engine_releases_held_back_text_when_length_ends_the_run(engine: Engine, story: Streamed) -> None:
    """The reference text ends with what looks like the start of a stop string; when max_tokens
    ends the run, that held-back tail must still reach the client."""
    text = story.final.text
    tail = text[-3:]
    run = stream(engine, "story-partial-stop", STORY_PROMPT,
                 SamplingParams(temperature=0.0, max_tokens=STORY_TOKENS, stop=[tail + "\u00a7never"]))
    assert run.final.finish_reason == "length" and run.final.stop_reason is None
    assert run.final.text == text
    assert "".join(run.deltas[:-1]) == text[:-3]     # the tail was held back until the end
    assert run.deltas[-1].endswith(tail)
    assert "".join(run.deltas) == text


def test_engine_stop_token_ids(engine: Engine, story: Streamed, tokenizer: Any) -> None:
    ids = story.final.token_ids
    k = next(i for i in range(3, len(ids)) if ids.index(ids[i]) == i)   # first occurrence
    run = stream(engine, "story-stop-id", STORY_PROMPT,
                 SamplingParams(temperature=0.0, max_tokens=STORY_TOKENS, stop_token_ids=[ids[k]]))
    final = run.final
    assert final.finish_reason == "stop"
    assert final.stop_reason == ids[k]
    assert final.token_ids == ids[:k + 1]
    assert final.text == tokenizer.decode(ids[:k], skip_special_tokens=True)   # stop token not in text
    assert "".join(run.deltas) == final.text


@pytest.fixture(scope="module")
def chat_prompt(tokenizer: Any) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2? Answer with one number."}],
                                         tokenize=False, add_generation_prompt=True)


@pytest.fixture(scope="module")
def eos_run(engine: Engine, chat_prompt: str) -> Streamed:
    return stream(engine, "chat-eos", chat_prompt, SamplingParams(temperature=0.0, max_tokens=32))


def test_engine_eos_stops_generation(eos_run: Streamed, tokenizer: Any) -> None:
    final = eos_run.final
    assert final.finish_reason == "stop"
    assert final.stop_reason == EOS
    assert final.token_ids[-1] == EOS and EOS not in final.token_ids[:-1]
    assert len(final.token_ids) < 32
    assert final.text == tokenizer.decode(final.token_ids, skip_special_tokens=True)
    assert final.text.strip() and "<|im_end|>" not in final.text
    assert "".join(eos_run.deltas) == final.text


def test_engine_releases_held_back_text_at_eos(engine: Engine, chat_prompt: str, eos_run: Streamed) -> None:
    text = eos_run.final.text
    tail = text[-2:]
    run = stream(engine, "chat-eos-partial-stop", chat_prompt,
                 SamplingParams(temperature=0.0, max_tokens=32, stop=[tail + "\u00a7"]))
    assert run.final.finish_reason == "stop" and run.final.stop_reason == EOS
    assert run.final.text == text
    assert "".join(run.deltas[:-1]) == text[:-2]
    assert "".join(run.deltas) == text


def test_engine_ignore_eos_runs_to_exactly_max_tokens(engine: Engine, chat_prompt: str, eos_run: Streamed,
                                                      tokenizer: Any) -> None:
    n = len(eos_run.final.token_ids)
    run = stream(engine, "chat-ignore-eos", chat_prompt,
                 SamplingParams(temperature=0.0, max_tokens=n + 3, ignore_eos=True))
    final = run.final
    assert final.finish_reason == "length"
    assert final.stop_reason is None
    assert len(final.token_ids) == n + 3
    assert final.token_ids[:n] == eos_run.final.token_ids          # EOS generated, then ignored
    assert final.text == tokenizer.decode(final.token_ids, skip_special_tokens=True)
    assert "".join(run.deltas) == final.text


def test_engine_min_tokens_masks_eos(engine: Engine, chat_prompt: str, eos_run: Streamed) -> None:
    n = len(eos_run.final.token_ids)
    run = stream(engine, "chat-min-tokens", chat_prompt,
                 SamplingParams(temperature=0.0, max_tokens=n + 3, min_tokens=n + 1))
    assert EOS not in run.final.token_ids[:n + 1]
    assert run.final.token_ids[:n - 1] == eos_run.final.token_ids[:n - 1]
    assert len(run.final.token_ids) >= n + 1


def test_engine_eos_as_stop_token_id_with_ignore_eos(engine: Engine, chat_prompt: str, eos_run: Streamed) -> None:
    run = stream(engine, "chat-eos-stop-id", chat_prompt,
                 SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, stop_token_ids=[EOS]))
    assert run.final.finish_reason == "stop"
    assert run.final.stop_reason == EOS
    assert run.final.token_ids == eos_run.final.token_ids
