"""Benchmark results as numbers: the summary dict (written by --json), the printed table.

Key names follow vLLM's `bench serve` JSON (request_throughput, mean_ttft_ms, p99_itl_ms, ...)
so existing dashboards and scripts read ours too.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict

PERCENTILES = (50, 90, 99)
LATENCIES = {"ttft": "Time to first token", "tpot": "Time per output token",
             "itl": "Inter-token latency", "e2e": "End-to-end latency"}


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    values = sorted(values)
    rank = (len(values) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return values[low] + (values[high] - values[low]) * (rank - low)


def latency_samples(results) -> dict[str, list[float]]:
    """Seconds, over the successful requests (ITL: every gap of every request)."""
    ok = [r for r in results if r.error is None]
    return {"ttft": [r.ttft for r in ok], "tpot": [t for r in ok if (t := r.tpot()) is not None],
            "itl": [gap for r in ok for gap in r.itls()], "e2e": [r.e2e for r in ok]}


def summarize(results, duration: float, config: dict) -> dict:
    ok = [r for r in results if r.error is None]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    summary = {"config": config, "duration": duration, "completed": len(ok),
               "failed": len(results) - len(ok), "total_input_tokens": input_tokens,
               "total_output_tokens": output_tokens,
               "request_throughput": len(ok) / duration,
               "output_throughput": output_tokens / duration,
               "total_token_throughput": (input_tokens + output_tokens) / duration}
    for name, values in latency_samples(results).items():
        ms = [1000 * v for v in values]
        summary[f"mean_{name}_ms"] = sum(ms) / len(ms) if ms else math.nan
        for q in PERCENTILES:
            summary[f"p{q}_{name}_ms"] = percentile(ms, q)
    summary["errors"] = sorted({r.error for r in results if r.error})[:10]
    summary["requests"] = [request_row(r) for r in results]
    return summary


def request_row(result) -> dict:
    row = asdict(result)
    row["e2e"] = result.e2e
    return row


def format_table(summary: dict) -> str:
    lines = [" Serving benchmark ".center(64, "="),
             row("Successful requests", summary["completed"]),
             row("Failed requests", summary["failed"]),
             row("Benchmark duration (s)", summary["duration"]),
             row("Total input tokens", summary["total_input_tokens"]),
             row("Total output tokens", summary["total_output_tokens"]),
             row("Request throughput (req/s)", summary["request_throughput"]),
             row("Output token throughput (tok/s)", summary["output_throughput"]),
             row("Total token throughput (tok/s)", summary["total_token_throughput"]),
             "-" * 64,
             f"{'latency (ms)':<28}{'mean':>9}" + "".join(f"{f'p{q}':>9}" for q in PERCENTILES)]
    for name, title in LATENCIES.items():
        figures = [summary[f"mean_{name}_ms"]] + [summary[f"p{q}_{name}_ms"] for q in PERCENTILES]
        lines.append(f"{title:<28}" + "".join(f"{v:>9.2f}" for v in figures))
    lines.append("=" * 64)
    lines += [f"error: {e}" for e in summary["errors"]]
    return "\n".join(lines)


def row(label: str, value) -> str:
    text = f"{value:.2f}" if isinstance(value, float) else str(value)
    return f"{label:<48}{text:>16}"


def write_json(summary: dict, path: str) -> None:
    # NaN (no samples, e.g. ITL with one-token outputs) is not JSON: write null.
    with open(path, "w") as f:
        json.dump(nan_to_none(summary), f, indent=2, allow_nan=False)


def nan_to_none(value):
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: nan_to_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [nan_to_none(v) for v in value]
    return value
