"""Iteration-level scheduling under a token budget.

There is no prefill phase and no decode phase: each sequence has `num_computed_tokens` and
`num_tokens`, and every step spends a token budget so the first catches up with the second.
Running sequences go first (one token each when decoding, a chunk when prefilling), then
waiting ones are admitted while budget, sequence slots and KV blocks last. When blocks run
out, the sequence scheduled last is preempted: its blocks are freed and it is recomputed
later (the prefix cache usually gives most of them back).
"""
from __future__ import annotations

from dataclasses import dataclass

from actors.block_manager import BlockManager
from actors.config import EngineConfig
from actors.sequence import Sequence, Status


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens computed for it this step, starting at seq.num_computed_tokens

    @property
    def samples(self) -> bool:
        """Does this step reach the end of its known tokens, so a new token is sampled?"""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.max_tokens = config.max_num_batched_tokens
        self.max_seqs = config.max_num_seqs
        self.priority = config.scheduling_policy == "priority"
        self.blocks = block_manager
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_tokens
        scheduled: list[ScheduledSeq] = []
        preempted = False
        if self.priority:
            self.running.sort(key=Sequence.sort_key)
            self.waiting.sort(key=Sequence.sort_key)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.blocks.can_allocate(seq, seq.num_computed_tokens + n, []):
                preempted = True
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status != Status.RUNNING:
                break
            self.blocks.allocate(seq, seq.num_computed_tokens + n)
            scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_seqs and not preempted:
            seq = self.waiting[0]
            hits = self.blocks.cached_prefix(seq)
            cached = len(hits) * self.blocks.block_size
            n = min(seq.num_tokens - cached, budget)
            if not self.blocks.can_allocate(seq, cached + n, hits):
                break
            self.waiting.pop(0)
            self.blocks.allocate(seq, cached + n, hits)
            self._count_cache_hits(seq, cached)
            seq.num_computed_tokens = seq.num_cached_tokens = cached
            seq.status = Status.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        return scheduled

    def _count_cache_hits(self, seq: Sequence, cached: int) -> None:
        self.blocks.hit_tokens += cached
        self.blocks.query_tokens += seq.num_tokens

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free_sequence(seq)
        seq.status = Status.WAITING
        seq.num_computed_tokens = 0
        self.waiting.insert(0, seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Release a finished or aborted sequence wherever it is."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free_sequence(seq)
        seq.status = Status.FINISHED
