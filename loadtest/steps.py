"""What the engine's step records say about a run: step times, prefill chunk sizes and how
well the scheduler's cost model predicted each step (``itl_target_ms`` > 0).

Each line of ``steps.jsonl`` (written by the server when ``step_trace_path`` is set; a load
test that starts its server sets it) has the step's rows ``[request, tokens, prefill?]``, its
measured time (``engine_ms``: Engine.step; ``ms``: the loop iteration around it) and the
predicted time (``predicted_ms``, null without a cost model).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from loadtest.analysis import Percentiles


@dataclass
class StepStats:
    steps: int
    steps_with_prefill: int
    step_ms: Percentiles
    prefill_chunk_tokens: Percentiles        # one sample per prefill row
    prefills_per_step: Percentiles           # over steps with a prefill
    prediction_error: Percentiles            # |predicted - measured| / measured, per step

    def to_dict(self) -> dict:
        return asdict(self)


def step_stats(steps: list[dict]) -> StepStats:
    measured = [s.get("engine_ms", s["ms"]) for s in steps]
    chunks = [tokens for s in steps for _, tokens, prefill in s["rows"] if prefill]
    per_step = [n for n in (sum(1 for _, _, prefill in s["rows"] if prefill) for s in steps) if n]
    errors = [abs(s["predicted_ms"] - m) / m for s, m in zip(steps, measured)
              if s.get("predicted_ms") is not None and m > 0]
    return StepStats(len(steps), len(per_step), Percentiles.of(measured), Percentiles.of(chunks),
                     Percentiles.of(per_step), Percentiles.of(errors))


def report_lines(stats: StepStats) -> list[str]:
    def pct(p: Percentiles, scale: float = 1.0, unit: str = "") -> str:
        if not p.count:
            return "–"
        return " / ".join(f"{v * scale:.3g}{unit}" for v in (p.p50, p.p90, p.p99, p.max))

    lines = ["## Engine steps (server's step records, `steps.jsonl`)", "",
             "| | p50 / p90 / p99 / max |", "|---|---|",
             f"| step time ({stats.steps} steps) | {pct(stats.step_ms, unit=' ms')} |",
             f"| prefill chunk tokens ({stats.prefill_chunk_tokens.count} chunks) | {pct(stats.prefill_chunk_tokens)} |",
             f"| prefills per step ({stats.steps_with_prefill} steps with one) | {pct(stats.prefills_per_step)} |"]
    if stats.prediction_error.count:
        lines.append(f"| step-time prediction error, \\|predicted − measured\\| / measured | "
                     f"{pct(stats.prediction_error, 100, '%')} |")
    return lines + [""]
