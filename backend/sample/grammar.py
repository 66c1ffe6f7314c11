"""Structured outputs with xgrammar: parse checks, compilation off the engine thread, and the
grammar as a token constraint.

- ``check_grammar`` parses a ``GrammarSpec`` without the tokenizer (xgrammar's
  ``Grammar.from_*``: under a millisecond for ordinary schemas), so a bad schema, regex or
  grammar is refused at submission, on the submitting thread.
- ``GrammarService`` owns one xgrammar ``GrammarCompiler`` and a thread pool. Compiling
  against the vocabulary takes milliseconds to seconds (a schema with many distinct
  ``pattern`` strings); xgrammar releases the GIL meanwhile, so the engine thread keeps
  stepping. Compiled grammars are cached by their text, bounded in bytes.
- ``PendingGrammar`` is a request's constraint while it compiles; the scheduler leaves the
  request in the waiting queue, holding no blocks, until ``done()``.
- ``GrammarConstraint`` wraps one request's ``GrammarMatcher``: one bitmask row per logits
  row (draft rows included), advanced by every emitted token, complete once the grammar
  accepted the end-of-sequence token.
"""

from __future__ import annotations

import functools
import json
import os
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch
import xgrammar as xgr

from backend.errors import InvalidRequestError
from backend.sample.constraints import TokenConstraint
from backend.structured_outputs import GrammarSpec

# Compiled grammars kept for reuse, by their size (our cache of finished compiles, and
# xgrammar's own cache of compiled rules). A JSON schema compiles to 1-3 MiB against a 49k
# vocabulary.
GRAMMAR_CACHE_BYTES = 64 << 20

# xgrammar's messages start with a timestamp and its C++ source location, and assertion
# failures with the failed condition: neither means anything to a client.
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def xgrammar_message(error: BaseException) -> str:
    return _XGRAMMAR_PREFIX.sub("", str(error)).strip()


# ---- parse checks (any thread) -----------------------------------------------------------------
_PARSERS: dict[str, Callable[[GrammarSpec], Any]] = {
    "json": lambda spec: xgr.Grammar.from_json_schema(spec.text, any_whitespace=spec.any_whitespace),
    "regex": lambda spec: xgr.Grammar.from_regex(spec.text),
    "grammar": lambda spec: xgr.Grammar.from_ebnf(spec.text),
}
_WHAT = {"json": "JSON schema", "regex": "regex", "grammar": "grammar"}


# JSON Schema keywords that xgrammar 0.2.8 parses but does not enforce (measured: it generates
# documents that violate them). A schema using one is refused rather than answered with
# output the schema rejects. (An allOf of several schemas is refused for the same reason.)
UNENFORCED_KEYWORDS = ("uniqueItems", "contains", "not", "if", "then", "else", "dependentRequired",
                       "dependentSchemas")
_SUBSCHEMA = ("items", "additionalProperties", "propertyNames", "unevaluatedProperties", "unevaluatedItems",
              "anyOf", "oneOf", "allOf", "prefixItems")           # a schema or a list of schemas
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")   # name -> schema


def unenforced_keyword(schema: Any) -> str | None:
    """The first keyword of ``schema`` or of a subschema that xgrammar would ignore."""
    if not isinstance(schema, dict):
        return None
    for keyword in UNENFORCED_KEYWORDS:
        if keyword in schema:
            return keyword
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return "allOf"
    children: list[Any] = []
    for key in _SUBSCHEMA:
        value = schema.get(key)
        children += value if isinstance(value, list) else [value]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            children += schema[key].values()
    return next((found for child in children if (found := unenforced_keyword(child)) is not None), None)


@functools.lru_cache(maxsize=1024)
def _parse(spec: GrammarSpec) -> None:
    # Cached on success only (an exception is not cached): the serving layer checks a request
    # on Triton's thread and the engine checks it again; the second check is a lookup.
    _PARSERS[spec.kind](spec)
    if spec.kind == "json" and (keyword := unenforced_keyword(json.loads(spec.text))) is not None:
        raise ValueError(f"keyword {keyword!r} is not supported (xgrammar would not enforce it)")


def check_grammar(spec: GrammarSpec) -> None:
    """Raise InvalidRequestError naming the request field when ``spec`` does not parse."""
    try:
        _parse(spec)
    except RecursionError:
        raise InvalidRequestError(spec.field, f"{_WHAT[spec.kind]} is nested too deeply") from None
    except (RuntimeError, ValueError) as exc:
        raise InvalidRequestError(spec.field, f"invalid {_WHAT[spec.kind]}: {xgrammar_message(exc)}") from None


# ---- the vocabulary ------------------------------------------------------------------------------
def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary: ``vocab_size`` is the model's (the logits' width).
    Special tokens are blanked: ``from_huggingface`` keeps added special tokens such as
    ``<|im_start|>`` as literal text that a JSON string may contain, while an empty entry is
    never allowed. The stop tokens (EOS) end the grammar."""
    detected = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    vocab = [""] * vocab_size
    for token, token_id in tokenizer.get_vocab().items():
        if token_id < vocab_size:
            vocab[token_id] = token
    for token_id, added in tokenizer.added_tokens_decoder.items():
        if added.special and token_id < vocab_size:
            vocab[token_id] = ""
    return xgr.TokenizerInfo(vocab, detected.vocab_type, vocab_size=vocab_size,
                             stop_token_ids=stop_token_ids or None, add_prefix_space=detected.add_prefix_space)


# ---- compilation (off the engine thread) ---------------------------------------------------------
class GrammarService:
    """Compiles grammar specs on a thread pool; one compile per distinct spec while it is
    cached, so a request whose grammar another request already compiled never waits."""

    def __init__(self, info: xgr.TokenizerInfo, max_workers: int | None = None,
                 cache_bytes: int = GRAMMAR_CACHE_BYTES) -> None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        # Half the cores at most: the model's threads keep the rest. One thread per compile
        # (parallelism across requests, not inside one).
        workers = max_workers or max(1, min(8, cpus // 2))
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True, cache_limit_bytes=cache_bytes)
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grammar-compile")
        self._cache_bytes = cache_bytes
        self._lock = threading.Lock()
        self._cache: OrderedDict[GrammarSpec, Future[xgr.CompiledGrammar]] = OrderedDict()
        self._sizes: dict[GrammarSpec, int] = {}
        self.num_compiles = 0

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> "GrammarService":
        return cls(tokenizer_info(tokenizer, vocab_size, stop_token_ids))

    def constraint_for(self, spec: GrammarSpec) -> "PendingGrammar":
        return PendingGrammar(spec, self.compiled(spec))

    def compiled(self, spec: GrammarSpec) -> Future[xgr.CompiledGrammar]:
        with self._lock:
            future = self._cache.get(spec)
            if future is not None:
                self._cache.move_to_end(spec)
                return future
            future = self._executor.submit(self._compile, spec)
            self._cache[spec] = future
            self.num_compiles += 1
        future.add_done_callback(functools.partial(self._compiled_done, spec))
        return future

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        if spec.kind == "json":
            return self._compiler.compile_json_schema(spec.text, any_whitespace=spec.any_whitespace)
        if spec.kind == "regex":
            return self._compiler.compile_regex(spec.text)
        return self._compiler.compile_grammar(spec.text)

    def _compiled_done(self, spec: GrammarSpec, future: Future[xgr.CompiledGrammar]) -> None:
        with self._lock:
            if self._cache.get(spec) is not future:
                return
            if future.cancelled() or future.exception() is not None:
                del self._cache[spec]     # nothing to keep; a retry compiles again
                return
            self._sizes[spec] = future.result().memory_size_bytes
            # Evict the least recently used finished grammars beyond the budget (never the
            # newest: a grammar larger than the whole budget is still used once).
            total = sum(self._sizes.values())
            for old in list(self._cache):
                if total <= self._cache_bytes or old == spec:
                    break
                if old in self._sizes:
                    total -= self._sizes.pop(old)
                    del self._cache[old]


class PendingGrammar:
    """A request's grammar constraint while its grammar compiles (``core.request.PendingConstraint``)."""

    def __init__(self, spec: GrammarSpec, compiled: Future[xgr.CompiledGrammar]) -> None:
        self.spec = spec
        self._compiled = compiled

    def done(self) -> bool:
        return self._compiled.done()

    def result(self) -> "GrammarConstraint":
        """The request's own matcher. Raises InvalidRequestError when the grammar did not compile."""
        try:
            compiled = self._compiled.result()
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError; anything else is the grammar's too
            raise InvalidRequestError(self.spec.field, f"{_WHAT[self.spec.kind]} failed to compile: "
                                                       f"{xgrammar_message(exc)}") from exc
        return GrammarConstraint(xgr.GrammarMatcher(compiled))


# ---- the constraint (engine thread) --------------------------------------------------------------
class GrammarConstraint(TokenConstraint):
    """One request's position in its grammar. Only the engine thread touches it."""
    decides_end = True

    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self._matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, drafts: list[int]) -> None:
        """Row 0: the next token. Row j + 1: the token after ``drafts[:j + 1]``, as long as the
        grammar accepts those drafts; past the first draft it rejects (or past an accepted
        EOS), the rows repeat the last one computed. Those rows never emit a token (the
        rejected draft is masked in its own row, so verification stops there); the copy keeps
        them finite. The matcher is rolled back to where it was."""
        matcher = self._matcher
        matcher.fill_next_token_bitmask(bitmask, 0)
        filled = accepted = 0
        for token in drafts:
            if not matcher.accept_token(token):
                break
            accepted += 1
            if matcher.is_terminated():      # an accepted EOS: nothing may follow it
                break
            matcher.fill_next_token_bitmask(bitmask, accepted)
            filled = accepted
        bitmask[filled + 1:] = bitmask[filled]
        if accepted:
            matcher.rollback(accepted)

    def num_valid_drafts(self, drafts: list[int]) -> int:
        """How many leading drafts the grammar accepts (the rest cannot be accepted: no use
        computing them)."""
        matcher = self._matcher
        accepted = 0
        for token in drafts:
            if matcher.is_terminated() or not matcher.accept_token(token):
                break
            accepted += 1
        if accepted:
            matcher.rollback(accepted)
        return accepted

    def advance(self, token_id: int) -> None:
        if not self._matcher.accept_token(token_id):
            # The mask allowed only tokens the grammar accepts: rows and tokens are misaligned.
            raise RuntimeError(f"the grammar rejected emitted token {token_id}")

    def is_complete(self) -> bool:
        return self._matcher.is_terminated()
