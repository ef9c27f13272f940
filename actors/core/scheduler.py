"""Iteration-level scheduling under a token budget, and the life of every sequence.

There is no prefill phase and no decode phase: each sequence has `num_computed_tokens` and
`num_tokens`, and every step spends a token budget so the first catches up with the second.
Running sequences go first (one token each when decoding, a chunk when prefilling), then
waiting ones are admitted while budget, sequence slots and KV blocks last. While sequences
decode, the step's prompt tokens are capped so the step keeps to --itl-target-ms
(actors/core/step_times.py). When blocks run out, the sequence scheduled last is preempted:
its blocks are freed and it is recomputed later (the prefix cache usually gives most of them
back).

`schedule()` returns one SchedulerOutput: the step as plain data, which rank 0 also
broadcasts to the other ranks. `update()` takes the sampled tokens back in two halves:
`advance()` counts the step's tokens as computed, caches full blocks and gives each sampling
row a placeholder token; `settle()` puts the sampled tokens in their place, finishes sequences
at a stop token or a length limit, and admits the samples (n > 1) that waited for their
prompt. Under async scheduling the engine calls `advance()`, schedules and launches the next
step (its rows read the placeholders' tokens on the device), and `settle()`s afterwards.

Speculative decoding (actors/core/speculation.py): a decoding row may carry draft tokens
after its last one. The step computes them all; `settle()` then takes the drafts the target
agreed with and its own token after them, and counts the accepted drafts as computed. The KV
the rejected drafts wrote is past num_computed_tokens, so the next step overwrites it; blocks
only they reached stay with the sequence for its next tokens.
"""
from __future__ import annotations

from actors.config import EngineConfig
from actors.core.block_manager import BlockManager
from actors.core.lora_slots import LoraSlots
from actors.core.sequence import PLACEHOLDER, Sequence, Status
from actors.core.speculation import Speculator, can_speculate
from actors.core.step import ScheduledSeq, SchedulerOutput, StepRow
from actors.core.step_times import PrefillPacer
from actors.core.structured import accept, grammar_prefix


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int,
                 eos_ids: frozenset[int], speculator: Speculator | None = None, itl_target_s: float = 0.0,
                 padded_rows=None):
        """itl_target_s: steps with decoding rows get the prompt tokens that keep them about this
        long (actors/core/step_times.py); 0: every step may take the full token budget.
        padded_rows: token rows -> the rows a step of that many computes (compiled steps pad)."""
        self.max_tokens = config.max_num_batched_tokens
        self.pacer = PrefillPacer(itl_target_s, self.max_tokens, padded_rows)
        self._prefill_left = self.max_tokens  # this step's prompt tokens still to give
        self.max_seqs = config.max_num_seqs
        self.priority = config.scheduling_policy == "priority"
        self.max_model_len = max_model_len
        self.eos_ids = eos_ids
        self.blocks = block_manager
        self.loras = LoraSlots(config.max_loras) if config.enable_lora else None
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.freed: list[int] = []  # seq ids whose rows the ranks drop at the next step
        self.hit_tokens = 0  # prefix-cache statistics, in tokens
        self.released_blocks = 0  # blocks given back before their sequence ended (sliding windows)
        self.query_tokens = 0
        self.speculator = speculator

    def add(self, seq: Sequence) -> None:
        """Queue a sequence (its `children`, the request's other samples, follow its prompt)."""
        self.waiting.append(seq)

    # ---- one step -------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.max_tokens
        decoding = sum(s.num_tokens - s.num_computed_tokens == 1 for s in self.running)
        self._prefill_left = self.pacer.prefill_budget(decoding)
        scheduled: list[ScheduledSeq] = []
        self._outgrown: list[Sequence] = []
        self._lora_loads: list[tuple] = []
        if self.priority:
            self.running.sort(key=Sequence.sort_key)
            self.waiting.sort(key=Sequence.sort_key)
        budget, preempted = self._schedule_running(scheduled, budget)
        if not preempted:
            self._admit_waiting(scheduled, budget)
        output = _output(scheduled)
        output.finished = self._outgrown
        output.lora_loads = self._lora_loads
        if output.rows:  # a step without rows reaches no rank: the freed rows wait for the next
            output.freed, self.freed = self.freed, []
        return output

    def _outgrows_pool(self, seq: Sequence) -> bool:
        """Its tokens need more blocks than the whole pool has: it can never run again, so it
        ends with "length" instead of being preempted for ever (and blocking the queue)."""
        if not self.blocks.outgrows_pool(seq):
            return False
        self.finish(seq, "length")
        self._outgrown.append(seq)
        return True

    def observe(self, seqs: list[ScheduledSeq], tokens: list, seconds: float, between: float | None = None) -> None:
        """A step ran: its rows, what each emitted, its wall time, and the host's time since the
        step before it (None: the engine was idle); the pacer and the speculator learn what steps
        cost."""
        self.pacer.observe(seqs, seconds, between)
        if self.speculator is not None:
            self.speculator.observe(seqs, tokens, seconds)

    def speculating(self) -> bool:
        """Whether decoding rows may propose drafts at the current batch size."""
        return self.speculator is not None and self.speculator.active(len(self.running))

    def _schedule_running(self, scheduled: list[ScheduledSeq], budget: int) -> tuple[int, bool]:
        preempted, i = False, 0
        proposals = self._propose() if self.speculating() else {}
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.pending and self._waits_for_token(seq):
                i += 1
                continue
            if self._outgrows_pool(seq):
                continue
            left = seq.num_tokens - seq.num_computed_tokens
            n = min(left, budget) if left == 1 else min(left, budget, self._prefill_left)
            if not n:  # a prompt chunk, and the step's prompt tokens are spent: the decodes go on
                i += 1
                continue
            draft = self._draft(seq, budget, proposals) if proposals and n == 1 and not seq.pending else []
            if draft:
                self.blocks.allocate(seq, seq.num_computed_tokens + 1 + len(draft))
                scheduled.append(_scheduled(seq, 1, draft))
                budget -= 1 + len(draft)
                i += 1
                continue
            while not self.blocks.can_allocate(seq, seq.num_computed_tokens + n, []):
                preempted = True
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status != Status.RUNNING:
                break
            self.blocks.allocate(seq, seq.num_computed_tokens + n)
            scheduled.append(_scheduled(seq, n))
            budget -= n
            if left > 1:
                self._prefill_left -= n
            i += 1
        return budget, preempted

    def _admit_waiting(self, scheduled: list[ScheduledSeq], budget: int) -> None:
        in_use = {s.lora.id for s in self.running if s.lora is not None}  # adapters that keep their slot
        while self.waiting and budget > 0 and len(self.running) < self.max_seqs:
            seq = self.waiting[0]
            if self._outgrows_pool(seq):
                continue
            hits = self.blocks.cached_prefix(seq)
            cached = len(hits) * self.blocks.block_size
            left = seq.num_tokens - cached
            n = min(left, budget) if left == 1 else min(left, budget, self._prefill_left)
            if not n:
                break
            if not self.blocks.can_allocate(seq, cached + n, hits):
                break
            if seq.lora is not None and not self._take_lora_slot(seq, in_use):
                break  # every adapter slot serves running sequences: wait for one to finish
            self.waiting.pop(0)
            self.blocks.allocate(seq, cached + n, hits)
            self.hit_tokens += cached
            self.query_tokens += seq.num_tokens
            seq.num_computed_tokens = seq.num_cached_tokens = cached
            seq.status = Status.RUNNING
            self.running.append(seq)
            scheduled.append(_scheduled(seq, n))
            budget -= n
            if left > 1:
                self._prefill_left -= n

    def _propose(self) -> dict[int, list[int]]:
        """Drafts for the decoding sequences that may speculate, within their limits (one call:
        a draft model proposes for every row in the same forwards)."""
        rows = []
        for seq in self.running:
            if seq.pending or seq.num_tokens - seq.num_computed_tokens != 1 or not can_speculate(seq):
                continue
            room = min(seq.params.max_tokens - seq.num_output_tokens - 1, self.max_model_len - seq.num_tokens - 1)
            rows.append((seq.seq_id, seq.token_ids, room))
        return self.speculator.propose(rows) if rows else {}

    def _draft(self, seq: Sequence, budget: int, proposals: dict[int, list[int]]) -> list[int]:
        """The sequence's drafts within what the step leaves (a draft never preempts: [] where
        its blocks are not free)."""
        draft = proposals.get(seq.seq_id, [])[:budget - 1]
        if draft and seq.matcher is not None:  # no drafts the grammar refuses
            draft = grammar_prefix(seq.matcher, draft)
        if draft and not self.blocks.can_allocate(seq, seq.num_computed_tokens + 1 + len(draft), []):
            return []
        return draft

    def _take_lora_slot(self, seq: Sequence, in_use: set[int]) -> bool:
        """Give seq its adapter's slot, loading the adapter there this step if it isn't resident."""
        got = self.loras.acquire(seq.lora, in_use)
        if got is None:
            return False
        seq.lora_slot, load = got
        if load:
            self._lora_loads.append((seq.lora_slot, seq.lora))
        in_use.add(seq.lora.id)
        return True

    def _waits_for_token(self, seq: Sequence) -> bool:
        """A sequence whose last token is still being sampled, and that cannot be scheduled
        before it is known: it ends there by length, or its tokens outgrow the pool."""
        p = seq.params
        return (seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len
                or self.blocks.outgrows_pool(seq))

    def update(self, output: SchedulerOutput, tokens: list[int | None]) -> None:
        """The step ran: `tokens` holds the token sampled for each of output.seqs (or None)."""
        self.advance(output)
        self.settle(output, tokens)

    def advance(self, output: SchedulerOutput) -> None:
        """The step's tokens are computed (or queued on the GPU): count them, cache the blocks
        they fill, and give each row that samples a placeholder for its token."""
        for s in output.seqs:
            seq = s.seq
            if seq.finished:  # aborted or failed, or (async scheduling) a stop string a step late
                continue
            seq.num_computed_tokens += s.num_tokens - len(s.draft)  # drafts count once accepted
            self.blocks.cache_full_blocks(seq)
            self.released_blocks += self.blocks.release_outside_window(seq)
            if seq.pooling is not None and seq.num_computed_tokens >= seq.num_prompt_tokens:
                self.finish(seq, "stop")  # its embedding is complete (its blocks stay cached)
                continue
            if s.prompt_logprobs and seq.num_computed_tokens >= seq.num_prompt_tokens:
                for sample in [seq] + seq.children:  # the samples share the prompt's log-probs
                    sample.prompt_logprobs_done = True
            if s.samples:
                seq.token_ids.append(PLACEHOLDER)

    def settle(self, output: SchedulerOutput, tokens: list[int | None]) -> None:
        """The sampled tokens replace their placeholders. The token of a sequence that finished
        after the step was scheduled becomes None: dropped."""
        for i, (s, token) in enumerate(zip(output.seqs, tokens)):
            seq = s.seq
            if seq.finished:
                tokens[i] = None
            elif s.samples and seq.pending:  # (None: a row that samples nothing this step)
                seq.token_ids.pop()
                if token is not None and s.draft:
                    tokens[i] = self._append_verified(seq, s, token)
                elif token is not None:
                    self._append(seq, token)

    def _append_verified(self, seq: Sequence, s: ScheduledSeq, emitted: list[int]) -> list[int]:
        """A row with drafts emitted its accepted drafts and one token of the target's: each
        accepted draft's KV is computed, so it counts as computed once the token after it is
        in. Returns what was kept (a stop ends the row early)."""
        self.speculator.record(seq.seq_id, len(s.draft), len(emitted) - 1)
        kept = []
        for token in emitted:
            if kept:
                seq.num_computed_tokens += 1
            self._append(seq, token)
            kept.append(token)
            if seq.finished:
                return kept
        self.blocks.cache_full_blocks(seq)
        self.released_blocks += self.blocks.release_outside_window(seq)
        return kept

    def _append(self, seq: Sequence, token: int) -> None:
        p = seq.params
        if p.max_tokens == 0:  # only the prompt's log-probs were wanted: drop the token
            self.finish(seq, "length")  # and the samples that waited for the prompt
            return
        self.waiting.extend(seq.children)  # the prompt is computed (and cached): their turn
        seq.children = []
        seq.token_ids.append(token)
        stop = token in p.stop_token_ids or (token in self.eos_ids and not p.ignore_eos)
        past_min = seq.num_output_tokens >= p.min_tokens
        if seq.matcher is not None and accept(seq.matcher, token):
            stop = past_min = True  # the grammar is complete: nothing may follow
        if stop and past_min:
            self.finish(seq, "stop", token)
        elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            self.finish(seq, "length")

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free_blocks(seq)
        if self.speculator is not None:  # (a draft model's cache of it goes too)
            self.speculator.forget(seq.seq_id)
        seq.status = Status.WAITING
        seq.num_computed_tokens = 0
        self.waiting.insert(0, seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str | None = None, stop_reason=None) -> None:
        """Release a finished or aborted (reason None) sequence wherever it is, and the
        samples still waiting for its prompt."""
        if seq.status == Status.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._free_blocks(seq)
        seq.status = Status.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        if self.speculator is not None:
            self.speculator.forget(seq.seq_id, seq.output_token_ids)
        for child in seq.children:
            if not child.finished:
                self.finish(child, reason)
        seq.children = []

    def _free_blocks(self, seq: Sequence) -> None:
        self.blocks.free_sequence(seq)
        if seq.num_sent_blocks:  # the ranks drop its row
            self.freed.append(seq.seq_id)
            seq.num_sent_blocks = 0

    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


def _scheduled(seq: Sequence, n: int, draft: list[int] = ()) -> ScheduledSeq:
    start = seq.num_computed_tokens
    return ScheduledSeq(seq, n + len(draft), start, samples=start + n == seq.num_tokens and seq.pooling is None,
                        prompt_logprobs=seq.needs_prompt_logprobs, draft=list(draft))


def _output(scheduled: list[ScheduledSeq]) -> SchedulerOutput:
    """The step in kernel order (decodes first), with each row's share of the logits, the
    hidden states pooled for embedding requests, and the blocks the ranks do not have yet."""
    scheduled.sort(key=lambda s: s.num_tokens != 1)  # stable: keeps the schedule's order within
    rows, logit_rows, pool_spans, tables, offset = [], [], [], [], 0
    for s in scheduled:
        seq, end = s.seq, s.start + s.num_tokens - len(s.draft)
        rows.append(StepRow(seq.seq_id, seq.token_ids[s.start:end] + s.draft, s.start, seq.lora_slot))
        if len(seq.block_table) > seq.num_sent_blocks:
            tables.append((seq.seq_id, seq.num_sent_blocks, seq.block_table[seq.num_sent_blocks:]))
            seq.num_sent_blocks = len(seq.block_table)
        first = len(logit_rows)
        if s.prompt_logprobs or s.draft:  # every position: its prompt log-probs, or verification
            logit_rows.extend(range(offset, offset + s.num_tokens))
        elif s.samples:
            logit_rows.append(offset + s.num_tokens - 1)
        s.logits = slice(first, len(logit_rows))
        span = seq.pooling.rows(s.start, s.num_tokens, seq.num_prompt_tokens) if seq.pooling else None
        if span is not None:
            s.pool_span = len(pool_spans)
            pool_spans.append((offset + span[0], offset + span[1]))
        offset += s.num_tokens
    return SchedulerOutput(rows, sum(s.num_tokens == 1 for s in scheduled), logit_rows, tables,
                           seqs=scheduled, pool_spans=pool_spans,
                           prompt_logprobs=any(s.prompt_logprobs for s in scheduled))
