"""`--plot FILE.png`: latency CDFs and output throughput over time, one PNG.

matplotlib is optional (`pip install 'shoal[plot]'`): imported only here, only when asked.
"""
from __future__ import annotations

from app.cli.bench.report import latency_samples

MISSING = ("--plot needs matplotlib, which is not installed: "
           "pip install 'shoal[plot]' (or pip install matplotlib)")


def require_matplotlib() -> None:
    """Fail before the run, not after minutes of load, when the plot can't be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit(f"shoal bench: error: {MISSING}") from None


def token_times(results) -> list[tuple[float, float]]:
    """(seconds after t0, tokens) per text chunk. A chunk may hold several tokens when the
    server coalesces; each request's token count is spread over its chunks by text length."""
    points = []
    for r in results:
        chars = sum(n for _, n in r.chunks)
        if r.error is None and chars:
            points += [(t, r.output_tokens * n / chars) for t, n in r.chunks]
    return points


def throughput_series(results, duration: float, bins: int = 20):
    # Wide enough bins that one request's burst of tokens doesn't read as a spike.
    width = max(duration / bins, 0.25)
    counts = [0.0] * (int(duration / width) + 1)
    for t, tokens in token_times(results):
        counts[min(int(t / width), len(counts) - 1)] += tokens
    return [width * (i + 0.5) for i in range(len(counts))], [c / width for c in counts]


def save_plot(results, duration: float, path: str, title: str = "shoal bench serve") -> None:
    import matplotlib
    matplotlib.use("Agg")  # no display here, and never open a window from a CLI
    import matplotlib.pyplot as plt

    fig, (cdf, rate) = plt.subplots(1, 2, figsize=(11, 4))
    for name, values in latency_samples(results).items():
        if values:
            ms = sorted(1000 * v for v in values)
            cdf.plot(ms, [(i + 1) / len(ms) for i in range(len(ms))], label=name.upper())
    cdf.set(xscale="log", xlabel="latency (ms)", ylabel="fraction of samples", title="latency CDF")
    cdf.legend()
    cdf.grid(alpha=0.3)
    times, tokens_per_s = throughput_series(results, duration)
    rate.plot(times, tokens_per_s, drawstyle="steps-mid")
    rate.set(xlabel="time (s)", ylabel="output tokens/s", title="throughput over time")
    rate.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
