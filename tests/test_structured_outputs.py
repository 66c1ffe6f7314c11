"""Structured outputs (xgrammar): the request forms and their errors, the grammar constraint's
bitmask rows around speculative drafts, and the in-process engine: sampled outputs satisfy
their schema / regex / choice and end with "stop" (with and without n-gram drafts), greedy is
unchanged where the constraint already holds, a compiling grammar holds up nobody, and a
grammar that fails to compile ends its request as an invalid request.

The cases (schemas, regexes, choices) are in tests/structured_cases.py, shared with the
server tests.
"""

from __future__ import annotations

import json
import queue
import threading
from pathlib import Path

import pytest
import torch
import xgrammar as xgr

from backend.config import EngineConfig
from backend.core.kv_cache_manager import KVCacheManager
from backend.core.request import Request, RequestStatus
from backend.core.scheduler import Scheduler
from backend.engine.engine import Engine
from backend.engine.loop import EngineLoop
from backend.engine.validation import RequestValidator
from backend.errors import InvalidRequestError
from backend.outputs import FinishReason
from backend.sample.constraints import bitmask_to_bool, mask_logits_, new_bitmask
from backend.sample.grammar import GrammarService, tokenizer_info
from backend.sampling_params import SamplingParams
from backend.structured_outputs import MAX_GRAMMAR_CHARS, GrammarSpec
from server.stub.vllm_protocol import sampling_params as protocol_sampling_params
from tests.structured_cases import CASES, MAX_TOKENS, PERSON_SCHEMA, Case
from tests.conftest import FIXED_BUDGET

VOCAB = 49152
EOS = 2


def chat(tokenizer, question: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=False)


def run(engine: Engine, prompts: list, params: list[SamplingParams]) -> list:
    outputs = engine.generate(prompts, params)
    engine.check_invariants()
    stats = engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total, "blocks leaked"
    return outputs


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), **FIXED_BUDGET, num_kv_blocks=1024))


@pytest.fixture(scope="module")
def spec_engine(model_dir: Path) -> Engine:
    # At most 4 running: drafts are only scheduled for batches up to speculative_max_batch_size.
    return Engine(EngineConfig(model=str(model_dir), **FIXED_BUDGET, num_kv_blocks=512, speculative_method="ngram",
                               max_num_seqs=4))


@pytest.fixture(scope="module")
def info(tokenizer) -> xgr.TokenizerInfo:
    return tokenizer_info(tokenizer, VOCAB, [EOS])


@pytest.fixture(scope="module")
def service(info: xgr.TokenizerInfo) -> GrammarService:
    return GrammarService(info)


# ---- request forms ----------------------------------------------------------------------------
def test_every_form_of_a_constraint_is_the_same_spec() -> None:
    schema_text = json.dumps(PERSON_SCHEMA)
    forms = [
        {"structured_outputs": {"json": PERSON_SCHEMA}},
        {"structured_outputs": {"json": schema_text}},
        {"structured_outputs": json.dumps({"json": PERSON_SCHEMA})},      # double-encoded, as the vLLM backend takes it
        # What vLLM's clients send: dataclasses.asdict(StructuredOutputsParams(json=...)).
        {"structured_outputs": json.dumps({"json": schema_text, "regex": None, "choice": None, "grammar": None,
                                           "json_object": None, "disable_any_whitespace": False,
                                           "disable_additional_properties": False, "whitespace_pattern": None,
                                           "structural_tag": None, "_backend": None, "_backend_was_auto": False})},
        {"guided_decoding_guide_type": "json_schema", "guided_decoding_guide": schema_text},
    ]
    specs = [SamplingParams(**form).grammar_spec for form in forms]
    assert all(spec == specs[0] for spec in specs)
    assert specs[0] == GrammarSpec("json", schema_text)
    assert specs[-1].field == "guided_decoding_guide"
    compact = SamplingParams(structured_outputs={"json_object": True, "disable_any_whitespace": True}).grammar_spec
    assert compact == GrammarSpec("json", '{"type": "object"}', any_whitespace=False)
    assert SamplingParams(guided_decoding_guide_type="json").grammar_spec == GrammarSpec("json", "{}")
    assert SamplingParams(guided_decoding_guide_type="ebnf_grammar",
                          guided_decoding_guide='root ::= "a"').grammar_spec.kind == "grammar"
    assert SamplingParams(structured_outputs={"choice": ['say "hi"', "a\\b"]}).grammar_spec == \
        GrammarSpec("grammar", 'root ::= "say \\"hi\\"" | "a\\\\b"')


def test_the_vllm_backend_sampling_parameters_carry_a_double_encoded_constraint() -> None:
    inner = json.dumps({"choice": ["Positive", "Negative"]})
    params = protocol_sampling_params(json.dumps({"max_tokens": 8, "structured_outputs": inner}))
    assert params.grammar_spec.kind == "grammar"
    alias = protocol_sampling_params(json.dumps({"guided_decoding_guide_type": "regex",
                                                 "guided_decoding_guide": "[0-9]+"}))
    assert alias.grammar_spec == GrammarSpec("regex", "[0-9]+")


BAD = [
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"json": None, "regex": None}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": "{not json"}, "structured_outputs", "malformed JSON"),
    ({"structured_outputs": json.dumps(["a"])}, "structured_outputs", "JSON object"),
    ({"structured_outputs": 7}, "structured_outputs", "JSON object"),
    ({"structured_outputs": {"json": "[1, 2]"}}, "structured_outputs", "schema object"),
    ({"structured_outputs": {"json": "{oops"}}, "structured_outputs", "malformed JSON"),
    ({"structured_outputs": {"json": {"type": "frobnicate"}}}, "structured_outputs", "frobnicate"),
    ({"structured_outputs": {"json": {"type": "integer", "minimum": 5, "maximum": 1}}}, "structured_outputs",
     "minimum greater than maximum"),
    # Keywords xgrammar would silently not enforce.
    ({"structured_outputs": {"json": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}},
     "structured_outputs", "'uniqueItems' is not supported"),
    ({"structured_outputs": {"json": {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}}},
     "structured_outputs", "'not' is not supported"),
    ({"structured_outputs": {"json": {"allOf": [{"type": "integer"}, {"minimum": 3}]}}}, "structured_outputs",
     "'allOf' is not supported"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs", "parenthesis"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs", "non-empty string"),
    ({"structured_outputs": {"grammar": 'root ::= "a" |'}}, "structured_outputs", "invalid grammar"),
    ({"structured_outputs": {"grammar": 'start ::= "a"'}}, "structured_outputs", "root"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "non-empty list"),
    ({"structured_outputs": {"choice": "yes"}}, "structured_outputs", "non-empty list"),
    ({"structured_outputs": {"choice": ["ok", 3]}}, "structured_outputs", "non-empty list"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs", "true or null"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": "[ ]?"}}, "structured_outputs",
     "whitespace_pattern"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs", "not supported"),
    ({"structured_outputs": {"regex": "a", "disable_any_whitespace": "yes"}}, "structured_outputs", "boolean"),
    ({"structured_outputs": {"regex": "a", "backend": "outlines"}}, "structured_outputs", "backend"),
    ({"structured_outputs": {"regex": "a", "colour": 1}}, "structured_outputs", "unknown key"),
    ({"structured_outputs": {"regex": "a" * (MAX_GRAMMAR_CHARS + 1)}}, "structured_outputs", "limit"),
    ({"structured_outputs": {"regex": "a"}, "allowed_token_ids": [1, 2]}, "structured_outputs", "allowed_token_ids"),
    ({"structured_outputs": {"regex": "a"}, "guided_decoding_guide_type": "regex", "guided_decoding_guide": "b"},
     "structured_outputs", "cannot be combined"),
    ({"guided_decoding_guide_type": "xml", "guided_decoding_guide": "<a/>"}, "guided_decoding_guide_type",
     "must be one of"),
    ({"guided_decoding_guide_type": "regex"}, "guided_decoding_guide", "required"),
    ({"guided_decoding_guide": "[0-9]+"}, "guided_decoding_guide", "needs guided_decoding_guide_type"),
    ({"guided_decoding_guide_type": "json", "guided_decoding_guide": "{}"}, "guided_decoding_guide", "json_schema"),
    ({"guided_decoding_guide_type": "regex", "guided_decoding_guide": "a{2,1}"}, "guided_decoding_guide",
     "invalid regex"),
    ({"guided_decoding_guide_type": "json_schema", "guided_decoding_guide": '{"type": "frob"}'},
     "guided_decoding_guide", "frob"),
    ({"guided_decoding_guide_type": "ebnf_grammar", "guided_decoding_guide": "root ::= missing"},
     "guided_decoding_guide", "missing"),
]


@pytest.mark.parametrize("values, field, words", BAD, ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD)])
def test_invalid_constraints_are_refused_naming_the_field(tokenizer, values, field, words) -> None:
    validator = RequestValidator(tokenizer, VOCAB, max_model_len=2048, block_size=16, num_kv_blocks=1024)
    with pytest.raises(InvalidRequestError) as caught:
        validator.validate("Hello", SamplingParams(**values))     # the submitting thread's whole check
    assert caught.value.field == field
    assert str(caught.value).startswith(f"{field}: ") and words in str(caught.value), str(caught.value)
    assert "/project/cpp" not in str(caught.value)   # xgrammar's source location is stripped


def test_keywords_are_told_from_property_names(tokenizer) -> None:
    validator = RequestValidator(tokenizer, VOCAB, max_model_len=2048, block_size=16, num_kv_blocks=1024)
    schema = {"type": "object", "properties": {"not": {"type": "string"}, "if": {"type": "integer"}},
              "allOf": [{"$ref": "#/$defs/base"}], "$defs": {"base": {"type": "object"}}}
    validator.validate("Hello", SamplingParams(structured_outputs={"json": schema}))


def test_the_engine_refuses_a_bad_grammar_at_submission(engine: Engine) -> None:
    with pytest.raises(InvalidRequestError, match="structured_outputs: invalid regex"):
        engine.add_request("bad-regex", "Hello", SamplingParams(structured_outputs={"regex": "(ab"}))
    assert "bad-regex" not in engine.requests


# ---- the constraint ---------------------------------------------------------------------------
def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _rows_after(compiled: xgr.CompiledGrammar, prefixes: list[list[int]]) -> torch.Tensor:
    """Reference rows: a fresh matcher walked to each prefix."""
    rows = new_bitmask(len(prefixes), VOCAB)
    for i, prefix in enumerate(prefixes):
        matcher = xgr.GrammarMatcher(compiled)
        assert all(matcher.accept_token(t) for t in prefix)
        matcher.fill_next_token_bitmask(rows, i)
    return rows


def test_draft_rows_follow_the_drafts_until_one_is_rejected(service: GrammarService, tokenizer) -> None:
    spec = GrammarSpec("regex", r"[0-9]{3}-[0-9]{4}")
    compiled = service.compiled(spec).result()
    constraint = service.constraint_for(spec).result()
    one, two, x, three = (_ids(tokenizer, c)[0] for c in "12x3")
    drafts = [one, two, x, three]                   # "x" breaks the grammar
    rows = new_bitmask(len(drafts) + 1, VOCAB)
    constraint.fill_bitmask(rows, drafts)
    expected = _rows_after(compiled, [[], [one], [one, two]])
    assert torch.equal(rows[:3], expected)
    assert torch.equal(rows[3], expected[2]) and torch.equal(rows[4], expected[2])   # copies: finite, never emitted
    assert constraint.num_valid_drafts(drafts) == 2
    # The matcher is where it was: the next fill (no drafts) is the first row again.
    again = new_bitmask(1, VOCAB)
    constraint.fill_bitmask(again, [])
    assert torch.equal(again[0], expected[0])
    # Verification kept "1" and emitted "5" instead of "2": the grammar follows the emitted tokens.
    five = _ids(tokenizer, "5")[0]
    constraint.advance(one)
    constraint.advance(five)
    after = new_bitmask(3, VOCAB)
    constraint.fill_bitmask(after, [two, x])
    assert torch.equal(after[:2], _rows_after(compiled, [[one, five], [one, five, two]]))
    assert torch.equal(after[2], after[1])
    with pytest.raises(RuntimeError, match="rejected"):
        constraint.advance(x)


def test_an_accepted_eos_draft_ends_the_rows_and_completes_only_when_emitted(service: GrammarService,
                                                                              tokenizer) -> None:
    constraint = service.constraint_for(GrammarSpec("grammar", 'root ::= "ok"')).result()
    ok = _ids(tokenizer, "ok")
    assert len(ok) == 1
    rows = new_bitmask(4, VOCAB)
    constraint.fill_bitmask(rows, [ok[0], EOS, ok[0]])
    allowed = [bitmask_to_bool(rows[i:i + 1], VOCAB)[0].nonzero().flatten().tolist() for i in range(4)]
    assert ok[0] in allowed[0] and EOS not in allowed[0]
    assert allowed[1] == [EOS]                         # once complete, only EOS
    assert allowed[2] == allowed[3] == [EOS]           # after the accepted EOS: copies
    assert constraint.num_valid_drafts([ok[0], EOS, ok[0]]) == 2
    assert not constraint.is_complete()
    constraint.advance(ok[0])
    assert not constraint.is_complete()
    constraint.advance(EOS)
    assert constraint.is_complete()


def test_special_tokens_never_appear_inside_strings(service: GrammarService, tokenizer) -> None:
    constraint = service.constraint_for(GrammarSpec("json", json.dumps({"type": "string"}))).result()
    constraint.advance(_ids(tokenizer, '"')[0])
    rows = new_bitmask(1, VOCAB)
    constraint.fill_bitmask(rows, [])
    allowed = set(bitmask_to_bool(rows, VOCAB)[0].nonzero().flatten().tolist())
    specials = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    assert len(allowed) > 40000 and not allowed & specials


@pytest.mark.parametrize("seed", range(4))
def test_the_engine_mask_matches_the_reference_unpacking(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    rows, vocab = 5, 1000 + seed * 7                  # a vocabulary that does not fill the last word
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, -(-vocab // 32)), dtype=torch.int32, generator=generator)
    bitmask[0] = 0                                    # nothing allowed
    bitmask[1] = -1                                   # everything
    logits = torch.randn(rows, vocab, generator=generator)
    expected = logits.masked_fill(~bitmask_to_bool(bitmask, vocab), float("-inf"))
    masked = logits.clone()
    mask_logits_(masked, bitmask)
    assert torch.equal(masked, expected)
    wider = torch.randn(rows, bitmask.shape[1] * 32 + 40, generator=generator)   # logits beyond the bitmask
    expected = wider.masked_fill(~bitmask_to_bool(bitmask, wider.shape[1]), float("-inf"))
    mask_logits_(wider, bitmask)
    assert torch.equal(wider, expected)


def test_equal_specs_compile_once(service: GrammarService) -> None:
    before = service.num_compiles
    spec = GrammarSpec("regex", "compile-once-[a-z]+")
    first = service.compiled(spec)
    second = service.compiled(GrammarSpec("regex", "compile-once-[a-z]+", field="guided_decoding_guide"))
    assert first is second and service.num_compiles == before + 1
    first.result()


def test_the_cache_keeps_the_recently_used_grammars_within_its_bytes(info: xgr.TokenizerInfo) -> None:
    small = GrammarService(info, cache_bytes=1)
    first, second = GrammarSpec("regex", "first[0-9]"), GrammarSpec("regex", "second[0-9]")
    small.compiled(first).result()
    small.compiled(second).result()            # over the budget: the least recently used goes
    assert small.num_compiles == 2
    small.compiled(second).result()
    assert small.num_compiles == 2             # the newest stays, even alone over the budget
    small.compiled(first).result()
    assert small.num_compiles == 3


# ---- scheduling while a grammar compiles --------------------------------------------------------
class _Pending:
    def __init__(self) -> None:
        self.ready = False

    def done(self) -> bool:
        return self.ready

    def result(self):
        return None


def test_a_compiling_request_keeps_its_place_and_holds_nothing() -> None:
    config = EngineConfig(block_size=4, num_kv_blocks=64, max_num_seqs=2)
    scheduler = Scheduler(config, KVCacheManager(64, 4, True))
    requests = [Request(request_id=f"r{i}", prompt_token_ids=[i + 1] * 3, sampling_params=SamplingParams(),
                        arrival_seq=i, arrival_time=0.0, max_tokens=4, eos_token_ids=frozenset())
                for i in range(4)]
    pending = _Pending()
    requests[0].pending_constraint = pending
    for request in requests:
        scheduler.add_request(request)
    out = scheduler.schedule()
    assert list(out.num_scheduled_tokens) == ["r1", "r2"]          # policy order for the others
    assert [r.request_id for r in scheduler.waiting] == ["r0", "r3"]
    assert scheduler.kv_cache.blocks_of("r0") == []
    pending.ready = True
    for request in requests[1:3]:
        scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED)
    out = scheduler.schedule()
    assert list(out.num_scheduled_tokens) == ["r0", "r3"]          # back in its place, first
    assert requests[0].pending_constraint is None


def test_a_compiling_grammar_does_not_hold_up_other_requests(engine: Engine, tokenizer) -> None:
    release = threading.Event()
    service = engine.grammars
    real_compile = service._compile

    def slow_compile(spec: GrammarSpec) -> xgr.CompiledGrammar:
        release.wait(60)
        return real_compile(spec)

    service._compile = slow_compile
    try:
        slow = SamplingParams(max_tokens=MAX_TOKENS, structured_outputs={"regex": r"\(\d{3}\) \d{3}-\d{4} "})
        engine.add_request("slow", chat(tokenizer, "Give me a US phone number."), slow)
        others = run(engine, ["The sky is", "Once upon a time"], [SamplingParams(max_tokens=8, temperature=0.0)] * 2)
        assert all(o.finish_reason is not None for o in others)
        assert [r.request_id for r in engine.scheduler.waiting] == ["slow"]
        engine.check_invariants()                                   # the waiting request holds no block
    finally:
        release.set()
        service._compile = real_compile
    finals = {}
    while "slow" not in finals:
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    assert finals["slow"].finish_reason == "stop"
    engine.check_invariants()


def test_the_serving_loop_sleeps_while_every_request_waits_for_its_grammar(engine: Engine) -> None:
    release = threading.Event()
    service = engine.grammars
    real_compile, real_step = service._compile, engine.step
    calls = {"steps": 0}

    def slow_compile(spec: GrammarSpec) -> xgr.CompiledGrammar:
        release.wait(60)
        return real_compile(spec)

    def counted_step():
        calls["steps"] += 1
        return real_step()

    service._compile, engine.step = slow_compile, counted_step
    loop = EngineLoop(engine).start()
    try:
        received: queue.Queue = queue.Queue()
        loop.submit("waits", "Hello", SamplingParams(max_tokens=8, structured_outputs={"regex": "waits-[0-9]"}),
                    received.put)
        threading.Event().wait(0.3)
        assert calls["steps"] < 300            # 2 ms naps, not a spin (which makes thousands)
        release.set()
        while not (item := received.get(timeout=60)).finished:
            pass
        assert item.finish_reason == "stop" and item.text.startswith("waits-")
    finally:
        release.set()
        loop.stop()
        service._compile = real_compile
        del engine.step                          # the class's method again
    engine.check_invariants()


def test_a_grammar_that_fails_to_compile_ends_its_request_as_invalid(engine: Engine, tokenizer) -> None:
    service = engine.grammars
    real_compile = service._compile

    def failing_compile(spec: GrammarSpec) -> xgr.CompiledGrammar:
        raise RuntimeError("[12:00:00] /project/cpp/compiler.cc:1: out of patience")

    service._compile = failing_compile
    try:
        [output] = run(engine, ["Hello"], [SamplingParams(structured_outputs={"regex": "never-compiles-[0-9]"})])
        assert output.finish_reason == FinishReason.ERROR
        assert isinstance(output.error, InvalidRequestError)
        assert output.error.field == "structured_outputs"
        assert str(output.error) == "structured_outputs: regex failed to compile: out of patience"
        # Through the serving loop, the callback gets the InvalidRequestError itself (INVALID_ARG).
        loop = EngineLoop(engine).start()
        try:
            received: queue.Queue = queue.Queue()
            loop.submit("fails", "Hello", SamplingParams(structured_outputs={"regex": "never-compiles-[a-z]"}),
                        received.put)
            item = received.get(timeout=60)
            assert isinstance(item, InvalidRequestError) and item.field == "structured_outputs"
        finally:
            loop.stop()
    finally:
        service._compile = real_compile
    engine.check_invariants()


# ---- generation -----------------------------------------------------------------------------
def _sample(engine: Engine, tokenizer, cases: list[Case], n: int) -> None:
    prompts, params, expected = [], [], []
    for case in cases:
        for _ in range(n):
            prompts.append(chat(tokenizer, case.question))
            params.append(SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0,
                                         structured_outputs=case.structured_outputs))
            expected.append(case)
    for case, output in zip(expected, run(engine, prompts, params)):
        assert output.finish_reason == "stop", f"{case.name}: {output.finish_reason} after {output.text!r}"
        assert output.stop_reason == EOS
        case.check(output.text)


def test_sampled_outputs_satisfy_their_constraint(engine: Engine, tokenizer) -> None:
    _sample(engine, tokenizer, CASES, n=8)


def test_sampled_outputs_satisfy_their_constraint_with_ngram_drafts(spec_engine: Engine, tokenizer) -> None:
    before = spec_engine.stats()
    _sample(spec_engine, tokenizer, CASES, n=3)
    after = spec_engine.stats()
    assert after.spec_draft_tokens > before.spec_draft_tokens
    assert after.spec_accepted_tokens > before.spec_accepted_tokens


def test_greedy_is_unchanged_where_the_constraint_already_holds(engine: Engine, tokenizer) -> None:
    prompts = [chat(tokenizer, "Is the sky blue? Answer in one word."), chat(tokenizer, "What is 12 + 30?")]
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    plain = run(engine, prompts, [greedy] * 2)
    # The unconstrained greedy text is one of the choices, or matches the regex: every greedy
    # token is allowed, so the constraint changes nothing.
    constrained = run(engine, prompts, [
        SamplingParams(max_tokens=24, temperature=0.0, structured_outputs={"choice": [plain[0].text, "Purple."]}),
        SamplingParams(max_tokens=24, temperature=0.0, structured_outputs={"regex": r"[^<>]{0,400}"}),
    ])
    for before, after in zip(plain, constrained):
        assert after.token_ids == before.token_ids
        assert after.finish_reason == before.finish_reason


def test_greedy_with_a_constraint_is_the_same_with_and_without_drafts(engine: Engine, spec_engine: Engine,
                                                                      tokenizer) -> None:
    """Drafts copied from the prompt run into the grammar (the list below differs from the one
    in the prompt): the tokens are those of plain greedy decoding under the same grammar."""
    prompt = chat(tokenizer, "Repeat exactly: apples, pears, plums, figs, dates, limes, apples, pears, plums, figs")
    params = SamplingParams(max_tokens=40, temperature=0.0,
                            structured_outputs={"regex": r"apples, pears, (plums|kiwis), figs, (dates|kiwis), "
                                                         r"[a-z]+(, [a-z]+){0,4}"})
    reference = run(engine, [prompt], [params])[0]
    before = spec_engine.stats()
    speculative = run(spec_engine, [prompt], [params])[0]
    assert speculative.token_ids == reference.token_ids and speculative.finish_reason == reference.finish_reason
    assert spec_engine.stats().spec_accepted_tokens > before.spec_accepted_tokens


def test_the_grammar_decides_the_end_over_ignore_eos_and_min_tokens(engine: Engine, tokenizer) -> None:
    prompt = chat(tokenizer, "Is the sky blue? Answer yes or no.")
    choice = {"choice": ["yes", "no"]}
    outputs = run(engine, [prompt, prompt], [
        SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, structured_outputs=choice),
        SamplingParams(max_tokens=32, temperature=0.0, min_tokens=20, structured_outputs=choice),
    ])
    for output in outputs:
        assert output.finish_reason == "stop" and output.text in ("yes", "no")
        assert output.token_ids[-1] == EOS and output.num_output_tokens < 20
