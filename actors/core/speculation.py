"""Speculative decoding's host side: which draft tokens a decoding sequence proposes, and when.

Two proposers:
- n-gram (prompt lookup, vLLM's "ngram"): the sequence's last n tokens (n from
  prompt_lookup_max down to prompt_lookup_min) are looked up earlier in its own tokens, and
  the k tokens that followed the latest match (with k tokens after it) are the proposal. No
  second model: it pays where the output copies the input (edits, quotes, tool-call arguments
  that repeat the request). Where a sequence's own tokens have no match of 2+ tokens, the
  outputs of requests finished lately are looked up too (SGLang's n-gram cache does the same):
  answers of one shape (tool calls, JSON, a reasoning model's tags) share their structure,
  which a request's own prompt does not spell. Verification keeps outputs exact either way.
- a draft model (vLLM's "draft_model"): a small checkpoint with the target's tokenizer writes
  the next k tokens greedily, for every proposing row at once (actors/worker/draft_model.py).
  A greedy proposal is a function of the context alone, like a lookup's, so the same
  verification keeps the target's distribution.

The scheduler asks `Speculator.propose` for the decoding rows at the start of a step; the
target model then computes each row's last token and its drafts in one forward, and the
sampler keeps the longest prefix the target agrees with plus one token of its own
(actors/worker/sampler.py). Proposing is skipped where it would not pay:
- per sequence: after proposals it mostly rejected, it waits (2, 4, ... 64 steps) before it
  proposes again, so a request whose output does not copy costs next to nothing. A waiting
  n-gram row still proposes where its suffix recurs longer than prompt_lookup_min and at
  least 3 tokens long: an answer that starts in its own words and then copies (a rewritten
  paragraph, a function after its explanation) would otherwise spend the copy waiting;
- per step: with more than `disable_by_batch_size` sequences running, verifying k more tokens
  a row costs more than the accepted ones save (a busy batch is compute-bound), so no row
  proposes;
- by measured cost: the speculator times the steps it sees. Plain decode steps give the time
  of a step of r rows (decayed, per r; the first step at a size r and one in PLAIN_EVERY are
  left plain to keep this current); each step with drafts, proposing included, is set against
  the time plain steps would have taken to emit its tokens (tokens / r plain steps of r rows).
  When the drafted steps have cost more than that over the last few (a batch whose drafts are
  mostly rejected, or verifying eagerly against a compiled plain step), no row proposes for 32
  steps, then 64, ... 1024 while it keeps not paying; the first window that pays resets it.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from actors.config import SpeculativeConfig
from actors.core.step_times import DecodeTimes

# Of a finished output, the first tokens join the recent outputs looked up (an answer's shape
# is at its start; ~1 ms of host time a request).
LEARNED_TOKENS = 512
# A row that accepted under this share of what it proposed over its recent proposals backs off.
MIN_ACCEPTANCE = 0.25
MAX_BACKOFF = 64  # steps
# The cost check: drafted steps compared before a verdict, and the pause after one that fails.
COMPARED_STEPS = 8
FIRST_PAUSE, MAX_PAUSE = 32, 1024  # steps
# One plain step after this many drafted ones keeps the plain time it is measured against
# current (a draft model proposes for every row, so without these none would be timed).
PLAIN_EVERY = 32


def can_speculate(seq) -> bool:
    """Whether a sequence's next tokens may be verified several at once: it generates. (What
    else its sampling depends on, its grammar's state, penalties over its output and the
    min_tokens ban, counts each position's drafts before it: actors/worker/sampler.py.)"""
    return seq.pooling is None


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


class RecentOutputs:
    """n-grams of recently finished outputs (2 to max_n tokens long) -> the up to k tokens that
    followed the latest of them (the latest with k after it, else the longest seen); the oldest
    n-grams go past `capacity`."""

    def __init__(self, k: int, max_n: int, capacity: int = 1 << 16):
        self.k, self.max_n, self.capacity = k, max_n, capacity
        self.table: OrderedDict[tuple[int, ...], list[int]] = OrderedDict()

    def learn(self, output: list[int]) -> None:
        table, k = self.table, self.k
        output = output[:LEARNED_TOKENS]
        for n in range(2, self.max_n + 1):
            for end in range(n, len(output)):
                key, after = tuple(output[end - n:end]), output[end:end + k]
                held = table.get(key)
                if held is None or len(after) >= len(held):
                    table[key] = after
                    table.move_to_end(key)
        while len(table) > self.capacity:
            table.popitem(last=False)

    def lookup(self, tokens: list[int], k: int, min_n: int) -> list[int]:
        for n in range(min(self.max_n, len(tokens)), max(min_n, 2) - 1, -1):
            after = self.table.get(tuple(tokens[-n:]))
            if after:
                return after[:k]
        return []


class NgramProposer:
    """Prompt lookup, row by row (see the top)."""

    def __init__(self, config: SpeculativeConfig):
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        self.recent = RecentOutputs(config.num_speculative_tokens, self.max_n)

    def propose(self, rows: list[tuple[int, list[int], int]]) -> dict[int, list[int]]:
        """rows: (seq id, its tokens, at most k drafts) -> seq id: drafts (rows without any left out)."""
        return self._lookup(rows, self.min_n)

    def confident(self, rows: list[tuple[int, list[int], int]]) -> dict[int, list[int]]:
        """As `propose`, from matches longer than prompt_lookup_min and of 3+ tokens (for rows
        that are backing off: in open-ended text 2-token repeats are common and mostly wrong)."""
        longer = max(self.min_n + 1, 3)
        return self._lookup(rows, longer) if longer <= self.max_n else {}

    def _lookup(self, rows, min_n: int) -> dict[int, list[int]]:
        """Its own tokens' matches of 2+ tokens first, then recent outputs', then a 1-token one."""
        out, strong = {}, max(min_n, 2)
        for seq_id, tokens, k in rows:
            draft = ngram_proposal(tokens, k, strong, self.max_n) or self.recent.lookup(tokens, k, strong)
            if not draft and min_n < strong:
                draft = ngram_proposal(tokens, k, min_n, min_n)
            if draft:
                out[seq_id] = draft
        return out

    def learn(self, output: list[int]) -> None:
        """A request finished: its output joins the recent outputs looked up."""
        self.recent.learn(output)

    def forget(self, seq_id: int) -> None:
        pass


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
    plain: DecodeTimes = field(default_factory=DecodeTimes)
    drafted_seconds: float = 0.0
    plain_equivalent: float = 0.0
    compared: int = 0
    paused: int = 0  # steps left without proposals
    pause: int = 0  # the last pause's length
    num_pauses: int = 0
    proposing_seconds: float = 0.0  # spent in the proposer since the last observed step
    drafted_since_plain: int = 0  # drafted steps since the last timed plain one
    compared_steps: int = COMPARED_STEPS  # drafted steps set against plain ones per verdict
    # NgramProposer, or the engine's DraftModel: propose(rows) and forget(seq id)
    proposer: object = None

    def __post_init__(self):
        self.accepted_per_pos = [0] * self.config.num_speculative_tokens
        if self.proposer is None:
            self.proposer = NgramProposer(self.config)

    @classmethod
    def create(cls, config: SpeculativeConfig | None, device_type: str, draft=None) -> Speculator | None:
        """draft: the draft model's proposer (method draft_model)."""
        if config is None:
            return None
        # On a GPU a batch stays memory-bound far longer than on a CPU's few cores.
        default = 32 if device_type == "cuda" else 4
        return cls(config, config.disable_by_batch_size or default, proposer=draft)

    def active(self, running: int) -> bool:
        """Whether rows may propose in a step with `running` sequences: not while paused, or
        over the batch size, or when a plain step is due to be timed: at this batch size first
        (a batch's tail shrinks through sizes never timed, and a larger batch's plain step made
        its eager verify steps look cheap against the compiled plain ones), then every
        PLAIN_EVERY drafted steps."""
        due = running not in self.plain or self.drafted_since_plain >= PLAIN_EVERY
        return not self.paused and running <= self.max_batch and not due

    def observe(self, seqs, tokens: list, seconds: float) -> None:
        """A step that ran: its ScheduledSeqs, what each emitted (a list for a verified row),
        its wall time. Only steps of one-token decodes and verified rows are compared; a
        drafted step's time includes proposing (a draft model's forwards)."""
        self.paused = max(0, self.paused - 1)
        seconds, self.proposing_seconds = seconds + self.proposing_seconds, 0.0
        rows = len(seqs)
        if not rows or any(s.num_tokens - len(s.draft) != 1 for s in seqs):
            return
        if not any(s.draft for s in seqs):
            self.plain.record(rows, seconds)
            self.drafted_since_plain = 0
            return
        self.drafted_since_plain += 1
        plain = self.plain.estimate(rows)
        if plain is None:
            return
        emitted = sum(len(t) if isinstance(t, list) else t is not None for t in tokens)
        self.drafted_seconds += seconds
        self.plain_equivalent += emitted / rows * plain
        self.compared += 1
        if self.compared < self.compared_steps:
            return
        if self.drafted_seconds > self.plain_equivalent:
            self.pause = min(MAX_PAUSE, max(FIRST_PAUSE, 2 * self.pause))
            self.paused = self.pause
            self.num_pauses += 1
        else:
            self.pause = 0
        self.drafted_seconds = self.plain_equivalent = 0.0
        self.compared = 0

    def propose(self, rows: list[tuple[int, list[int], int]]) -> dict[int, list[int]]:
        """Draft tokens for decoding sequences' next step. rows: (seq id, its tokens, room for
        at most this many drafts); a sequence backing off skips its turn, unless a longer n-gram
        match vouches for it. Returns seq id -> drafts, for the sequences that got some."""
        asked, waiting, k = [], [], self.config.num_speculative_tokens
        for seq_id, tokens, room in rows:
            record = self.records.get(seq_id)
            if record is not None and record.wait:
                record.wait -= 1
                if room > 0:
                    waiting.append((seq_id, tokens, min(k, room)))
            elif room > 0:
                asked.append((seq_id, tokens, min(k, room)))
        if not isinstance(self.proposer, NgramProposer):  # (a draft model has no match length)
            waiting = []
        if not asked and not waiting:
            return {}
        start = time.monotonic()
        drafts = self.proposer.confident(waiting) if waiting else {}
        if asked:
            drafts.update(self.proposer.propose(asked))
        self.proposing_seconds += time.monotonic() - start
        return drafts

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
        elif accepted:  # (a waiting row's confident proposal that paid ends its wait)
            r.backoff = r.wait = 0

    def forget(self, seq_id: int, output: list[int] | None = None) -> None:
        """The sequence left the running batch: preempted, or finished with `output`."""
        self.records.pop(seq_id, None)
        self.proposer.forget(seq_id)
        if output and isinstance(self.proposer, NgramProposer):
            self.proposer.learn(output)

    def stats(self) -> dict:
        rate = self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
        return {"drafts": self.num_drafts, "draft_tokens": self.num_draft_tokens,
                "accepted_tokens": self.num_accepted_tokens, "acceptance_rate": rate,
                # tokens a verified row emits: its accepted drafts and the target's own one
                "mean_acceptance_length": 1 + self.num_accepted_tokens / self.num_drafts
                if self.num_drafts else 0.0,
                "accepted_per_position": list(self.accepted_per_pos),
                "cost_pauses": self.num_pauses}
