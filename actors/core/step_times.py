"""What steps cost, learned from the steps that ran, and the prefill share it leaves.

Every decoding stream waits one step for its next token, so a step that also carries a long
prefill chunk stalls them all: at concurrency 64 on 2 CPU cores a 2,048-token chunk made a
~600 ms step between tokens where plain decode steps took ~50 ms. `PrefillPacer` sizes the
prefill tokens of a step that has decoding rows so the step takes about `target` seconds
(Sarathi-Serve's stall-free batching with a time budget instead of a fixed token count):
decodes go first, then as many prompt tokens as the time left buys. The time left also pays
for the host's measured work between two steps (each stream's output), which a stream waits
through too. Where the decodes alone take longer than the target, prompts still get half the
decodes' time, so a long prompt is never starved. A step without decoding rows, or one before
any prompt token was timed, keeps the full --max-num-batched-tokens.

A step that runs compiled pads its token rows to a bucket (actors/worker/compiled_decode.py:
32 decodes and 16 prompt tokens run as 64 rows), and a padding row costs what a prompt token
would: the budget grows to fill the bucket (`padded_rows`). Without that, a burst of new
requests beside a few decoding streams entered one 16-token chunk a step, each step computing
up to 31 rows of padding, and the slow start made staggered ends (docs/benchmarks.md).

A mixed step costs more than its plain decode step plus its prompt tokens at their own rate:
a plain decode step runs compiled where a mixed one runs eagerly (or, compiled, pads its rows
and reads each prompt token's context as a decode row), and a small prompt chunk uses the cores
less well. So a mixed step is modelled as decodes + overhead + tokens x rate:
the rate is learned from steps of prompts only (or the first mixed step, before any), the
overhead from mixed steps, as what their time leaves over the other two. Taking a single
rate from both kinds of step, a prompts-only chunk pulled it down and the next mixed steps
ran ~40% over the target (a 111 ms step against 75 ms, docs/benchmarks.md).
"""
from __future__ import annotations

# A new measurement's weight in the decayed averages.
DECAY = 0.25
# Prompt tokens a step with decoding rows always gets, whatever the estimate (one KV block).
MIN_PREFILL_TOKENS = 16


class DecodeTimes:
    """A plain decode step's decayed seconds by row count."""

    def __init__(self):
        self.seconds: dict[int, float] = {}

    def __contains__(self, rows: int) -> bool:
        return rows in self.seconds

    def record(self, rows: int, seconds: float) -> None:
        before = self.seconds.get(rows)
        self.seconds[rows] = seconds if before is None else (1 - DECAY) * before + DECAY * seconds

    def estimate(self, rows: int) -> float | None:
        """Seconds at `rows` rows: measured, else the nearest larger batch's (an upper bound),
        else the nearest smaller one's scaled up by rows; None: none seen."""
        if rows in self.seconds:
            return self.seconds[rows]
        larger = [r for r in self.seconds if r > rows]
        if larger:
            return self.seconds[min(larger)]
        smaller = [r for r in self.seconds if r < rows]
        return self.seconds[max(smaller)] * rows / max(smaller) if smaller else None


def is_plain_decode(seqs) -> bool:
    """Every row of the step is a one-token decode without drafts."""
    return bool(seqs) and all(s.num_tokens == 1 and not s.draft for s in seqs)


class PrefillPacer:
    def __init__(self, target_s: float, max_tokens: int, padded_rows=None):
        """target_s: the step time to keep steps with decoding rows near (0: no pacing);
        padded_rows: token rows -> the rows a step of that many computes (None: as many)."""
        self.target = target_s
        self.max_tokens = max_tokens
        self.padded_rows = padded_rows
        self.decodes = DecodeTimes()
        self.token_seconds: float | None = None  # a prompt token's decayed cost
        self.mixed_overhead = 0.0  # a mixed step's decayed time beyond its decodes and prompt tokens
        self.between = 0.0  # the host's decayed time between two busy steps (outputs, streams)

    def observe(self, seqs, seconds: float, between: float | None = None) -> None:
        """A step that ran: its ScheduledSeqs, its wall time, and the host's time since the step
        before it ended (None: the engine waited for work)."""
        if not self.target or not seqs:
            return
        if between is not None:
            self.between = (1 - DECAY) * self.between + DECAY * between
        if is_plain_decode(seqs):
            self.decodes.record(len(seqs), seconds)
            return
        decoding = [s for s in seqs if s.num_tokens - len(s.draft) == 1]
        prompt_tokens = sum(s.num_tokens for s in seqs) - sum(s.num_tokens for s in decoding)
        if prompt_tokens < MIN_PREFILL_TOKENS:  # too few to tell their cost from the decodes'
            return
        if not decoding:  # prompts only: the rate of a prompt token
            cost = seconds / prompt_tokens
            before = self.token_seconds
            self.token_seconds = cost if before is None else (1 - DECAY) * before + DECAY * cost
            return
        left = max(seconds - (self.decodes.estimate(len(decoding)) or 0.0), 0.0)
        if self.token_seconds is None:  # no rate yet: this step's prompt tokens carry it all
            self.token_seconds = left / prompt_tokens
            return
        overhead = left - prompt_tokens * self.token_seconds
        self.mixed_overhead = (1 - DECAY) * self.mixed_overhead + DECAY * overhead

    def prefill_budget(self, decoding: int) -> int:
        """Prompt tokens for a step with `decoding` one-token rows."""
        if not self.target or not decoding or not self.token_seconds:
            return self.max_tokens
        decode_seconds = self.decodes.estimate(decoding) or 0.0
        room = max(self.target - self.between - decode_seconds - self.mixed_overhead, decode_seconds / 2)
        budget = max(MIN_PREFILL_TOKENS, min(self.max_tokens, int(room / self.token_seconds)))
        if self.padded_rows is not None:  # the padding the step computes anyway
            budget = min(self.max_tokens, max(budget, self.padded_rows(decoding + budget) - decoding))
        return budget
