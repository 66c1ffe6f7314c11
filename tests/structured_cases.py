"""Structured-output cases shared by the engine tests (tests/test_structured_outputs.py) and the
server tests: each is a constraint, a prompt that suits it, and how to check an output.

Bounded on purpose (maxLength, maxItems, enums, integer ranges, no free numbers), so that a
small model sampling at temperature 1.0 always completes them within ``MAX_TOKENS``. Bounds
count characters, not tokens: a sampled string may be CJK text the tokenizer spells in single
bytes (3 tokens a character; one server run hit 120 tokens on the order schema's three
12-character products), so ``MAX_TOKENS`` allows 4 tokens per bounded character. The
JSON cases also set ``disable_any_whitespace``: where a grammar allows any whitespace between
tokens (the default, as in vLLM), SmolLM2-135M at temperature 1.0 sometimes emits newlines
until max_tokens.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import jsonschema

MAX_TOKENS = 256   # person: 32 bounded characters, order: 36, at 4 tokens each, plus the JSON around them

PERSON_SCHEMA: dict[str, Any] = {     # nested objects
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "address"],
}

ORDER_SCHEMA: dict[str, Any] = {      # arrays of objects
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {"type": "object",
                      "properties": {"product": {"type": "string", "maxLength": 12},
                                     "quantity": {"type": "integer", "minimum": 1, "maximum": 9}},
                      "required": ["product", "quantity"]},
            "minItems": 1, "maxItems": 3,
        },
        "express": {"type": "boolean"},
    },
    "required": ["items", "express"],
}

TICKET_SCHEMA: dict[str, Any] = {     # enums, const, an array of enums
    "type": "object",
    "properties": {
        "status": {"enum": ["open", "closed", "pending"]},
        "priority": {"enum": [1, 2, 3]},
        "labels": {"type": "array", "items": {"enum": ["bug", "feature", "docs"]}, "maxItems": 3},
        "kind": {"const": "ticket"},
    },
    "required": ["status", "priority", "labels", "kind"],
}

PHONE_REGEX = r"\(\d{3}\) \d{3}-\d{4}"
COLOUR_REGEX = r"(red|green|blue|yellow) [a-z]{2,10}"
ANSWER_CHOICES = ["yes", "no", "maybe", "it depends"]
COMPACT = {"disable_any_whitespace": True}


@dataclass(frozen=True)
class Case:
    name: str
    structured_outputs: dict[str, Any]   # Triton's vLLM backend form (sent JSON-encoded to the server)
    question: str                        # the user turn of the chat prompt

    def check(self, text: str) -> None:
        """Raise AssertionError when ``text`` does not satisfy the constraint."""
        so = self.structured_outputs
        if "json" in so:
            try:
                value = json.loads(text)
            except ValueError as exc:
                raise AssertionError(f"{self.name}: not JSON: {text!r} ({exc})") from None
            try:
                jsonschema.validate(value, so["json"])
            except jsonschema.ValidationError as exc:
                raise AssertionError(f"{self.name}: {text!r} violates the schema: {exc.message}") from None
        elif "regex" in so:
            assert re.fullmatch(so["regex"], text), f"{self.name}: {text!r} does not match {so['regex']!r}"
        else:
            assert text in so["choice"], f"{self.name}: {text!r} is not one of {so['choice']}"


CASES = [
    Case("person", {"json": PERSON_SCHEMA, **COMPACT}, "Describe a person (name, age, address) as JSON."),
    Case("order", {"json": ORDER_SCHEMA, **COMPACT}, "Write a small shop order as JSON."),
    Case("ticket", {"json": TICKET_SCHEMA, **COMPACT}, "File a support ticket as JSON."),
    Case("phone", {"regex": PHONE_REGEX}, "Give me a US phone number."),
    Case("colour", {"regex": COLOUR_REGEX}, "Name a colour and a thing of that colour."),
    Case("answer", {"choice": ANSWER_CHOICES}, "Is the sky blue? Answer yes, no, maybe or it depends."),
]
