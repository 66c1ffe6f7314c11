"""The raw per-request record (one JSON line each): the source of every LLM metric."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Iterable

# How a request ended, from the client's point of view.
OK = "ok"                     # the server ended the stream with its final response
CANCELLED = "cancelled"       # the client cancelled it on purpose (cancel scenario)
FAILED = "failed"             # an error response, a broken stream or a timeout
INTERRUPTED = "interrupted"   # still running when the drain timeout ran out; not a failure


@dataclass
class RequestRecord:
    request_id: str
    scenario: str
    name: str                            # report row: scenario, or "priority:premium" / "priority:bulk"
    user: int
    scheduled_at: float                  # epoch seconds; latencies are measured from here
    sent_at: float                       # > scheduled_at when an open-loop arrival found every user busy
    expected_prompt_tokens: int
    max_tokens: int
    priority: int = 0
    cancel_after: int | None = None
    # [time, tokens] of every non-empty response, in arrival order
    responses: list[list[float]] = field(default_factory=list)
    end_at: float | None = None          # final response, error, cancel or interruption
    outcome: str = FAILED
    finish_reason: str | None = None     # the server's: "length", "stop", ...
    final_response: bool = False         # the stream delivered triton_final_response
    prompt_tokens: int | None = None     # the server's num_input_tokens
    cached_tokens: int | None = None     # the server's num_cached_tokens
    error: str | None = None
    retries: int = 0                     # refusals before the first token, sent again (RetryPolicy)

    @property
    def output_tokens(self) -> int:
        return int(sum(n for _, n in self.responses))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: dict) -> "RequestRecord":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


class RecordWriter:
    """Appends and flushes line by line, so a crashed run still leaves its records."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] = open(path, "a", encoding="utf-8")

    def write(self, record: RequestRecord) -> None:
        self._file.write(record.to_json() + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_records(path: Path) -> list[RequestRecord]:
    return [RequestRecord.from_dict(json.loads(line)) for line in _lines(path)]


def _lines(path: Path) -> Iterable[str]:
    if not path.exists():
        return []
    return [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
