"""Structured outputs, request side: the forms a client may send, checked for shape and
normalized into one ``GrammarSpec``. No xgrammar here; whether the schema, regex or grammar
parses is checked at submission (``backend/sample/grammar.py`` ``check_grammar``).

Two ways to ask, as two Triton backends take them:
- ``structured_outputs`` (Triton's vLLM backend, vLLM's ``StructuredOutputsParams``): a JSON
  object, or that object encoded as a JSON string (the vLLM backend and its clients send it
  double-encoded). Exactly one constraint key is non-null: ``json`` (a schema, object or JSON
  text), ``regex``, ``choice`` (list of strings), ``grammar`` (EBNF, xgrammar's dialect) or
  ``json_object`` (true). Null-valued keys are ignored, as are the fields vLLM's own
  ``dataclasses.asdict`` adds; ``disable_any_whitespace`` is honoured,
  ``disable_additional_properties`` is what xgrammar does anyway (see ``GrammarSpec``), and
  ``whitespace_pattern`` / ``structural_tag`` are refused.
- ``guided_decoding_guide_type`` + ``guided_decoding_guide`` (the TensorRT-LLM backend):
  ``json`` (any JSON value, no guide), ``json_schema``, ``regex`` or ``ebnf_grammar``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from backend.errors import InvalidRequestError, is_encodable, show

# The schema, regex, grammar or choices of one request, as text: the same bound as the whole
# sampling_parameters JSON, so that the in-process API cannot send more than a server client.
MAX_GRAMMAR_CHARS = 16 * 1024

GrammarKind = Literal["json", "regex", "grammar"]

STRUCTURED_OUTPUTS = "structured_outputs"
GUIDE_TYPE = "guided_decoding_guide_type"
GUIDE = "guided_decoding_guide"

_CONSTRAINT_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
_OPTION_KEYS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")
# What vLLM's own clients send besides: ``dataclasses.asdict(StructuredOutputsParams(...))``
# includes its private backend fields, older versions a backend choice and ``disable_fallback``.
_IGNORED_KEYS = ("_backend", "_backend_was_auto", "disable_fallback")
_BACKENDS = (None, "auto", "xgrammar")

ANY_JSON_SCHEMA = "{}"                       # any JSON value
JSON_OBJECT_SCHEMA = '{"type": "object"}'    # vLLM's json_object: any JSON object
_GUIDE_TYPES = ("json", "json_schema", "regex", "ebnf_grammar")


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match, as xgrammar compiles it: a JSON schema (as JSON
    text), a regex, or an EBNF grammar (a ``choice`` list becomes one). Equal specs share one
    compiled grammar. Schemas are compiled in xgrammar's strict mode: an object never gets a
    property its schema does not list unless the schema allows extra ones
    (``additionalProperties``), which is what vLLM's ``disable_additional_properties`` asks for."""
    kind: GrammarKind
    text: str
    any_whitespace: bool = True      # JSON only: false = no optional whitespace (vLLM's disable_any_whitespace)
    field: str = field(default=STRUCTURED_OUTPUTS, compare=False)   # the request field, for errors


def parse_structured_outputs(value: Any) -> GrammarSpec:
    """``structured_outputs`` as sent: a dict, or a dict encoded as a JSON string."""
    name = STRUCTURED_OUTPUTS
    if isinstance(value, str):
        value = _loads(value, name, limit=MAX_GRAMMAR_CHARS + 1024)   # room for the keys around the text
    if not isinstance(value, dict):
        raise InvalidRequestError(name, "must be a JSON object (or a JSON string encoding one)")
    unknown = sorted(str(k) for k in value if k not in _CONSTRAINT_KEYS + _OPTION_KEYS + _IGNORED_KEYS + ("backend",))
    if unknown:
        raise InvalidRequestError(name, f"unknown key(s) {', '.join(unknown[:5])} (allowed: "
                                        f"{', '.join(_CONSTRAINT_KEYS + _OPTION_KEYS)})")
    given = [k for k in _CONSTRAINT_KEYS if value.get(k) is not None]
    if len(given) != 1:
        found = f"got {' and '.join(given)}" if given else "got none"
        raise InvalidRequestError(name, f"needs exactly one of json, regex, choice, grammar, json_object; {found}")
    if value.get("backend") not in _BACKENDS:
        raise InvalidRequestError(name, f"backend must be xgrammar, auto or null, got {show(value['backend'])}")
    if value.get("whitespace_pattern") is not None:
        raise InvalidRequestError(name, "whitespace_pattern is not supported (xgrammar has no whitespace "
                                        "patterns); use disable_any_whitespace")
    options = {}
    for key in ("disable_any_whitespace", "disable_additional_properties"):
        option = value.get(key)
        if option is not None and not isinstance(option, bool):
            raise InvalidRequestError(name, f"{key} must be a boolean, got {show(option)}")
        options[key] = bool(option)
    any_whitespace = not options["disable_any_whitespace"]

    key = given[0]
    constraint = value[key]
    if key == "json":
        return GrammarSpec("json", _schema_text(constraint, name, "json"), any_whitespace, name)
    if key == "json_object":
        if constraint is not True:
            raise InvalidRequestError(name, f"json_object must be true or null, got {show(constraint)}")
        return GrammarSpec("json", JSON_OBJECT_SCHEMA, any_whitespace, name)
    if key == "regex":
        return GrammarSpec("regex", _text(constraint, name, "regex"), field=name)
    if key == "grammar":
        return GrammarSpec("grammar", _text(constraint, name, "grammar"), field=name)
    if key == "choice":
        return GrammarSpec("grammar", choice_grammar(constraint, name), field=name)
    raise InvalidRequestError(name, f"{key} is not supported")   # structural_tag


def parse_guided_decoding(guide_type: Any, guide: Any) -> GrammarSpec | None:
    """The TensorRT-LLM backend's pair; None when neither is given."""
    if guide_type is None:
        if guide is not None:
            raise InvalidRequestError(GUIDE, f"needs {GUIDE_TYPE}")
        return None
    if guide_type not in _GUIDE_TYPES:
        raise InvalidRequestError(GUIDE_TYPE, f"must be one of {', '.join(_GUIDE_TYPES)}, got {show(guide_type)}")
    if guide_type == "json":
        if guide is not None:
            raise InvalidRequestError(GUIDE, "must be null for guide type json (any JSON); "
                                             "send a schema with json_schema")
        return GrammarSpec("json", ANY_JSON_SCHEMA, field=GUIDE)
    if guide is None:
        raise InvalidRequestError(GUIDE, f"is required for guide type {guide_type}")
    if guide_type == "json_schema":
        return GrammarSpec("json", _schema_text(guide, GUIDE, None), field=GUIDE)
    return GrammarSpec("regex" if guide_type == "regex" else "grammar", _text(guide, GUIDE, None), field=GUIDE)


def choice_grammar(choices: Any, name: str) -> str:
    """An EBNF grammar matching exactly one of ``choices``. A JSON string literal is also an
    xgrammar EBNF literal (same escapes), so ``json.dumps`` quotes each choice."""
    if (not isinstance(choices, list) or not choices
            or not all(isinstance(c, str) and is_encodable(c) for c in choices)):
        raise InvalidRequestError(name, f"choice must be a non-empty list of strings, got {show(choices)}")
    text = "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(choices))
    _check_size(text, name, "choice")
    return text


def _schema_text(schema: Any, name: str, key: str | None) -> str:
    """A schema given as an object or as JSON text, as canonical JSON text (one compiled
    grammar per distinct schema, whichever way it was sent). Key order is kept: it is the
    order the properties are generated in."""
    what = f"{key} " if key else ""
    if isinstance(schema, str):
        schema = _loads(schema, name, limit=MAX_GRAMMAR_CHARS, what=f"{what}schema")
    if not isinstance(schema, dict):
        raise InvalidRequestError(name, f"{what}must be a JSON schema object, got {show(schema)}")
    try:
        text = json.dumps(schema)
    except (TypeError, ValueError, RecursionError) as exc:   # in-process callers may pass anything
        raise InvalidRequestError(name, f"{what}schema is not JSON: {exc}") from None
    _check_size(text, name, key or "schema")
    return text


def _text(value: Any, name: str, key: str | None) -> str:
    what = f"{key} " if key else ""
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(name, f"{what}must be a non-empty string, got {show(value)}")
    if not is_encodable(value):
        raise InvalidRequestError(name, f"{what}must be valid Unicode (no lone surrogates)")
    _check_size(value, name, key or "guide")
    return value


def _loads(text: str, name: str, *, limit: int, what: str = "") -> Any:
    if len(text) > limit:
        raise InvalidRequestError(name, f"{what or 'text'} is {len(text)} characters; the limit is {limit}")
    try:
        return json.loads(text)
    except RecursionError:
        raise InvalidRequestError(name, f"{what or 'JSON'} is nested too deeply") from None
    except ValueError as exc:
        raise InvalidRequestError(name, f"{what + ' is ' if what else ''}malformed JSON: {exc}") from None


def _check_size(text: str, name: str, what: str) -> None:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise InvalidRequestError(name, f"{what} is {len(text)} characters; the limit is {MAX_GRAMMAR_CHARS}")

