"""Triton's vLLM backend conventions, on both sides of a request, without Triton imports (the
model adapter calls these; tests call them directly).

Requests (vllm_backend ``src/utils/vllm_backend_utils.py`` and ``src/utils/request.py``):
- Sampling parameters come from the ``sampling_parameters`` tensor (a JSON object) and from
  Triton's request ``parameters`` (the HTTP generate body's ``parameters`` and top-level keys
  that name no input, gRPC request parameters). When a key is in both, the tensor wins.
  (The vLLM backend ignores request parameters whenever the tensor is present; clients that
  send both, as its own tests do, send the same values, so taking the union only adds what
  the tensor left out.)
- Numbers and booleans may be given as strings (``"max_tokens": "100"``), converted by the
  field's type. A string that is not a number of that type is left as it is, so that the
  field's own validation answers INVALID_ARG naming it. Booleans are parsed as words
  (``"false"`` is False: the vLLM backend's ``bool("false")`` is True, a plain bug).
- ``stream=true`` with ``exclude_input_in_output=false`` is refused with the vLLM backend's
  message (with INVALID_ARG, where it answers INTERNAL: the request is at fault, not the server).

Responses (``GenerateRequest.create_response``): the requested extra outputs go on every
response; ``finish_reason`` is the string ``"None"`` until the last one; ``logprobs`` is a JSON
list, per new position ``{"<token id>": {"logprob", "rank", "decoded_token"}}``, or ``"null"``
when ``logprobs`` was not asked for in the sampling parameters; ``cumulative_logprob`` is the
sum of the sampled tokens' logprobs so far.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import types
import typing
from typing import Any

from backend.errors import InvalidRequestError
from backend.outputs import Logprob
from backend.sampling_params import MAX_SAMPLING_JSON_BYTES, SamplingParams

STREAM_WITH_INPUT_MESSAGE = ("Error generating stream: When streaming, `exclude_input_in_output` = False "
                             "is not allowed.")
NOT_FINISHED = "None"    # finish_reason of a response that is not the last
NULL_LOGPROBS = "null"   # logprobs when the sampling parameters did not ask for them

# Request parameters Triton itself owns (scheduling, sequence batching, the HTTP binary
# protocol); they are not sampling parameters and are never an error.
TRITON_RESERVED_PARAMETERS = frozenset({"sequence_id", "sequence_start", "sequence_end", "timeout",
                                        "binary_data_output", "binary_data_size"})

_INTEGER_TEXT = re.compile(r"[+-]?\d+")


def _field_kinds() -> dict[str, type]:
    """SamplingParams field -> int, float or bool, for the fields that hold one of those."""
    kinds: dict[str, type] = {}
    hints = typing.get_type_hints(SamplingParams)
    for field in dataclasses.fields(SamplingParams):
        annotation = hints[field.name]
        args = set(typing.get_args(annotation)) if isinstance(annotation, types.UnionType) else {annotation}
        args.discard(type(None))
        if len(args) == 1 and (kind := args.pop()) in (int, float, bool):
            kinds[field.name] = kind
    return kinds


FIELD_KINDS = _field_kinds()


def coerce_value(kind: type, value: Any) -> Any:
    """``value`` as ``kind`` when it is that kind written as a string (or an integral float for
    an int); anything else unchanged, for validation to judge."""
    if kind is int:
        if isinstance(value, str) and _INTEGER_TEXT.fullmatch(value.strip()):
            return int(value.strip())
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            return int(value)
    elif kind is float:
        if isinstance(value, str):
            try:
                number = float(value.strip())
            except ValueError:
                return value
            return number if math.isfinite(number) else value
    elif kind is bool and isinstance(value, str):
        word = value.strip().lower()
        if word in ("true", "1", "yes"):
            return True
        if word in ("false", "0", "no"):
            return False
    return value


def coerce_values(values: dict[str, Any]) -> dict[str, Any]:
    return {key: coerce_value(FIELD_KINDS[key], value) if key in FIELD_KINDS else value
            for key, value in values.items()}


def parse_json_object(text: str | bytes, name: str) -> dict[str, Any]:
    if len(text) > MAX_SAMPLING_JSON_BYTES:
        raise InvalidRequestError(name, f"is {len(text)} bytes; the limit is {MAX_SAMPLING_JSON_BYTES}")
    try:
        values = json.loads(text)
    except RecursionError:
        raise InvalidRequestError(name, "JSON is nested too deeply") from None
    except ValueError as exc:   # JSONDecodeError, invalid UTF-8, an integer of > 4300 digits
        raise InvalidRequestError(name, f"malformed JSON: {exc}") from None
    if not isinstance(values, dict):
        raise InvalidRequestError(name, "must be a JSON object")
    return values


def sampling_values(tensor_json: str | bytes | None, request_parameters_json: str | None) -> dict[str, Any]:
    """The request's sampling parameters as one dict: request parameters, then the tensor's
    keys over them; numbers and booleans given as strings converted."""
    values: dict[str, Any] = {}
    for source, name in ((request_parameters_json, "parameters"), (tensor_json, "sampling_parameters")):
        if source is None or source == "":
            continue
        given = parse_json_object(source, name)
        if name == "parameters":
            given = {k: v for k, v in given.items() if k not in TRITON_RESERVED_PARAMETERS}
        # OpenAI's newer name for max_tokens wins over it within one source (LiteLLM sends
        # max_completion_tokens next to its own default max_tokens).
        if "max_completion_tokens" in given:
            given["max_tokens"] = given.pop("max_completion_tokens")
        values.update(given)
    return coerce_values(values)


def sampling_params(tensor_json: str | bytes | None, request_parameters_json: str | None = None) -> SamplingParams:
    return SamplingParams.from_dict(sampling_values(tensor_json, request_parameters_json))


def check_stream_flags(stream: bool, exclude_input_in_output: bool | None) -> None:
    """Streaming sends deltas only: asking to echo the prompt there is refused, as the vLLM
    backend refuses it (``exclude_input_in_output`` absent means true when streaming)."""
    if stream and exclude_input_in_output is False:
        raise InvalidRequestError("exclude_input_in_output", STREAM_WITH_INPUT_MESSAGE, verbatim=True)


# ---- responses ------------------------------------------------------------------------------------
def finish_reason_text(finish_reason: str | None) -> str:
    return NOT_FINISHED if finish_reason is None else str(finish_reason)


def logprobs_json(positions: list[dict[int, Logprob] | None] | None) -> str:
    """The vLLM backend's ``logprobs`` output for some positions (``None``: not asked for); also
    ``prompt_logprobs``, whose first position, which nothing predicts, is null (as vLLM's)."""
    if positions is None:
        return NULL_LOGPROBS
    return json.dumps([None if position is None else
                       {str(token): {"logprob": entry.logprob, "rank": entry.rank,
                                     "decoded_token": entry.decoded_token}
                        for token, entry in position.items()} for position in positions])
