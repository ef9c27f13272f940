"""Speculative decoding's host side: which draft tokens a decoding sequence proposes, and when.

n-gram (prompt lookup, vLLM's "ngram"): the sequence's last n tokens (n from
prompt_lookup_max down to prompt_lookup_min) are looked up earlier in its own tokens, and the
k tokens that followed the latest match (with k tokens after it) are the proposal. No second
model: it pays where the output copies the input (edits, quotes, tool-call arguments that
repeat the request).

The scheduler asks `Speculator.propose` for each decoding row; the target model then computes
the row's last token and the drafts in one forward, and the sampler keeps the longest prefix
the target agrees with plus one token of its own (actors/worker/sampler.py). Proposing is
skipped where it would not pay:
- per sequence: after proposals it mostly rejected, it waits (2, 4, ... 64 steps) before it
  proposes again, so a request whose output does not copy costs next to nothing;
- per step: with more than `disable_by_batch_size` sequences running, verifying k more tokens
  a row costs more than the accepted ones save (a busy batch is compute-bound), so no row
  proposes;
- by measured cost: the speculator times the steps it sees. Plain decode steps give the time
  of a step of r rows (decayed, per r); each step with drafts is set against the time plain
  steps would have taken to emit its tokens (tokens / r plain steps of r rows). When the
  drafted steps have cost more than that over the last few (a batch whose drafts are mostly
  rejected, or verifying eagerly against a compiled plain step), no row proposes for 32
  steps, then 64, ... 1024 while it keeps not paying; the first window that pays resets it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from actors.config import SpeculativeConfig

# A row that accepted under this share of what it proposed over its recent proposals backs off.
MIN_ACCEPTANCE = 0.25
MAX_BACKOFF = 64  # steps
# The cost check: drafted steps compared before a verdict, and the pause after one that fails.
COMPARED_STEPS = 8
FIRST_PAUSE, MAX_PAUSE = 32, 1024  # steps


def can_speculate(seq) -> bool:
    """Whether a sequence's next tokens may be verified several at once: nothing in its
    sampling depends on the tokens before each position but the model (a grammar's mask, the
    penalties over its output and the min_tokens ban do), and it generates."""
    p = seq.params
    return (seq.matcher is None and seq.pooling is None and seq.num_output_tokens >= p.min_tokens
            and not p.penalizes_output)


def ngram_proposal(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed an earlier occurrence of the longest suffix of `tokens`
    between min_n and max_n tokens long ([] where none recurs): the latest occurrence with k
    tokens after it, else the earliest."""
    size = len(tokens)
    if size <= min_n or k < 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        # Windows that start before the suffix itself and have a token after them.
        windows = np.lib.stride_tricks.sliding_window_view(arr[:size - 1], n)
        hits = np.flatnonzero((windows == arr[size - n:]).all(axis=1))
        if hits.size:  # the latest match with k tokens after it, else the earliest (the most)
            full = hits[hits + n + k <= size]
            start = int(full[-1] if full.size else hits[0]) + n
            return arr[start:start + k].tolist()
    return []


@dataclass
class _Record:
    """One sequence's recent proposals (decayed counts) and its back-off."""
    proposed: float = 0.0
    accepted: float = 0.0
    wait: int = 0  # steps left before it proposes again
    backoff: int = 0  # the last wait


@dataclass
class Speculator:
    config: SpeculativeConfig
    max_batch: int
    records: dict[int, _Record] = field(default_factory=dict)  # seq id -> record
    # Totals, for metrics: proposals (rows that carried drafts), draft tokens, accepted ones
    # and accepted ones by position (vLLM's spec_decode_num_accepted_tokens_per_pos).
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    # The cost check (see the top): rows -> a plain decode step's decayed seconds; the drafted
    # steps' seconds and plain steps' seconds for the same tokens since the last verdict.
    plain_seconds: dict[int, float] = field(default_factory=dict)
    drafted_seconds: float = 0.0
    plain_equivalent: float = 0.0
    compared: int = 0
    paused: int = 0  # steps left without proposals
    pause: int = 0  # the last pause's length
    num_pauses: int = 0

    def __post_init__(self):
        self.accepted_per_pos = [0] * self.config.num_speculative_tokens

    @classmethod
    def create(cls, config: SpeculativeConfig | None, device_type: str) -> Speculator | None:
        if config is None:
            return None
        # On a GPU a batch stays memory-bound far longer than on a CPU's few cores.
        default = 32 if device_type == "cuda" else 4
        return cls(config, config.disable_by_batch_size or default)

    def active(self, running: int) -> bool:
        """Whether rows may propose in a step with `running` sequences."""
        return not self.paused and running <= self.max_batch

    def observe(self, seqs, tokens: list, seconds: float) -> None:
        """A step that ran: its ScheduledSeqs, what each emitted (a list for a verified row),
        its wall time. Only steps of one-token decodes and verified rows are compared."""
        self.paused = max(0, self.paused - 1)
        rows = len(seqs)
        if not rows or any(s.num_tokens - len(s.draft) != 1 for s in seqs):
            return
        if not any(s.draft for s in seqs):
            before = self.plain_seconds.get(rows)
            self.plain_seconds[rows] = seconds if before is None else 0.75 * before + 0.25 * seconds
            return
        plain = self._plain_step(rows)
        if plain is None:
            return
        emitted = sum(len(t) if isinstance(t, list) else t is not None for t in tokens)
        self.drafted_seconds += seconds
        self.plain_equivalent += emitted / rows * plain
        self.compared += 1
        if self.compared < COMPARED_STEPS:
            return
        if self.drafted_seconds > self.plain_equivalent:
            self.pause = min(MAX_PAUSE, max(FIRST_PAUSE, 2 * self.pause))
            self.paused = self.pause
            self.num_pauses += 1
        else:
            self.pause = 0
        self.drafted_seconds = self.plain_equivalent = 0.0
        self.compared = 0

    def _plain_step(self, rows: int) -> float | None:
        """A plain decode step's seconds at `rows` rows: measured, else the nearest larger batch's
        (an upper bound), else the nearest smaller one's scaled up by rows; None: none seen."""
        if rows in self.plain_seconds:
            return self.plain_seconds[rows]
        larger = [r for r in self.plain_seconds if r > rows]
        if larger:
            return self.plain_seconds[min(larger)]
        smaller = [r for r in self.plain_seconds if r < rows]
        return self.plain_seconds[max(smaller)] * rows / max(smaller) if smaller else None

    def propose(self, seq_id: int, tokens: list[int], room: int) -> list[int]:
        """Draft tokens for the sequence's next step, at most `room` ([]: none this step)."""
        record = self.records.get(seq_id)
        if record is not None and record.wait:
            record.wait -= 1
            return []
        c = self.config
        return ngram_proposal(tokens, min(c.num_speculative_tokens, room), c.prompt_lookup_min,
                              c.prompt_lookup_max)

    def record(self, seq_id: int, proposed: int, accepted: int) -> None:
        """A verified proposal: `accepted` of its `proposed` drafts were kept."""
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        for pos in range(accepted):
            self.accepted_per_pos[pos] += 1
        r = self.records.setdefault(seq_id, _Record())
        r.proposed = r.proposed * 0.5 + proposed
        r.accepted = r.accepted * 0.5 + accepted
        if r.accepted < MIN_ACCEPTANCE * r.proposed:
            r.backoff = min(MAX_BACKOFF, max(2, 2 * r.backoff))
            r.wait = r.backoff
        elif accepted:
            r.backoff = 0

    def forget(self, seq_id: int) -> None:
        self.records.pop(seq_id, None)

    def stats(self) -> dict:
        rate = self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
        return {"drafts": self.num_drafts, "draft_tokens": self.num_draft_tokens,
                "accepted_tokens": self.num_accepted_tokens, "acceptance_rate": rate,
                # tokens a verified row emits: its accepted drafts and the target's own one
                "mean_acceptance_length": 1 + self.num_accepted_tokens / self.num_drafts
                if self.num_drafts else 0.0,
                "accepted_per_position": list(self.accepted_per_pos),
                "cost_pauses": self.num_pauses}
