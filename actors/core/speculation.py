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
  proposes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from actors.config import SpeculativeConfig

# A row that accepted under this share of what it proposed over its recent proposals backs off.
MIN_ACCEPTANCE = 0.25
MAX_BACKOFF = 64  # steps


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
        return running <= self.max_batch

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
                "accepted_per_position": list(self.accepted_per_pos)}
