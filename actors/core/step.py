"""The step contract: what the scheduler hands the workers for one engine step, as plain data.

`SchedulerOutput` is built by the scheduler on rank 0 (actors/core/scheduler.py), run by the
executor on every rank (actors/executor/), and read by each rank's model runner
(actors/worker/model_runner.py). Block tables travel as changes: every rank keeps the live
sequences' tables itself (actors/worker/input_batch.py), so a step carries only the blocks a
sequence gained, a sequence's whole table when it starts or resumes, and the sequences that
left. Pickling drops rank 0's own part (the sequences), so what crosses to the other ranks is
only what they compute with.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from actors.core.sequence import Sequence


@dataclass
class StepRow:
    """What every rank needs to compute one sequence's tokens this step."""
    seq_id: int  # the sequence's row in every rank's input batch
    token_ids: list[int]  # the tokens computed this step
    start: int  # the position of the first (the sequence's computed tokens before the step)
    lora_slot: int = -1  # the adapter slot its tokens use (-1: the base model alone)


@dataclass
class ScheduledSeq:
    """Rank 0's side of a row: the sequence and what this step does for it."""
    seq: Sequence
    num_tokens: int
    start: int
    samples: bool  # the step reaches the end of its known tokens, so a token is sampled
    prompt_logprobs: bool  # its chunk's logits give prompt log-probs
    logits: slice = field(default_factory=lambda: slice(0, 0))  # its rows among the step's logits
    pool_span: int = -1  # its entry in the step's pool_spans (-1: none)
    # Speculative decoding: tokens proposed after its last one, computed with it (included in
    # num_tokens); every position's logits are computed and verified (actors/core/speculation.py)
    draft: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    rows: list[StepRow]  # decodes (one-token rows) first, then prefill chunks: the kernels' order
    num_decodes: int
    logit_rows: list[int]  # token rows whose logits are computed, in order
    # (seq id, first index, block ids): blocks from that index on (0: the whole table), applied
    # by every rank before the step, after `freed` (sequences gone since the last step)
    block_tables: list[tuple[int, int, list[int]]] = field(default_factory=list)
    freed: list[int] = field(default_factory=list)
    seqs: list[ScheduledSeq] = field(default_factory=list)  # rank 0 only (not broadcast)
    finished: list[Sequence] = field(default_factory=list)  # rank 0: ended without a row (pool full)
    # (slot, LoraRef): adapters every rank reads into a slot before this step's forward
    lora_loads: list[tuple] = field(default_factory=list)
    # (first, end) token rows whose final hidden states are summed, one float32 vector each
    # (embedding requests: actors/pooling_params.py)
    pool_spans: list[tuple[int, int]] = field(default_factory=list)
    # A row asks for its prompt's log-probs: the step runs eagerly (prefill attention), so they do
    # not depend on whether the compiled decode step is in use yet (actors/worker/compiled_decode.py)
    prompt_logprobs: bool = False

    def __getstate__(self) -> dict:  # the other ranks need the rows, not rank 0's sequences
        return {**self.__dict__, "seqs": [], "finished": []}

    def split(self, parts: int) -> list[SchedulerOutput]:
        """Up to `parts` contiguous micro-batches (pipeline parallelism), each in kernel order
        (the block-table changes stay with the whole step)."""
        size = -(-len(self.rows) // max(1, parts))
        out, offset = [], 0
        for i in range(0, len(self.rows), size):
            rows = self.rows[i:i + size]
            n = sum(len(r.token_ids) for r in rows)
            logit_rows = [r - offset for r in self.logit_rows if offset <= r < offset + n]
            spans = [(a - offset, b - offset) for a, b in self.pool_spans if offset <= a < offset + n]
            out.append(SchedulerOutput(rows, sum(len(r.token_ids) == 1 for r in rows), logit_rows,
                                       pool_spans=spans, prompt_logprobs=self.prompt_logprobs))
            offset += n
        return out


@dataclass
class RunnerOutput:
    """What a step gives back (rank 0), per scheduled sequence in the SchedulerOutput's order."""
    # the sampled token (None: a chunk in the middle of its prompt); a row with drafts: the
    # tokens it emits, the accepted drafts then the target's own token
    tokens: list[int | list[int] | None]
    logprobs: list[dict | list[dict] | None]  # {chosen: lp, alternatives...} when asked (a list for a list)
    prompt_logprobs: list[list | None]  # per prompt position its chunk predicts
    pooled: list[list[float] | None] = field(default_factory=list)  # its pool span's sum, or None
    # Tokens not read yet while the step's GPU work runs (async scheduling): their host copy
    # (pinned, filled by the GPU), the event after which it is complete (None on CPU) and the
    # positions in `tokens` they fill. `resolve()` reads them.
    on_device: tuple | None = None
    # The sampled tokens on the device and the ids of the sequences they belong to: the next
    # step, scheduled before they are read, takes its placeholders' input ids from them.
    sampled: tuple | None = None

    def __post_init__(self):
        self.pooled = self.pooled or [None] * len(self.tokens)

    def resolve(self) -> RunnerOutput:
        """Read the tokens (the step's one device-to-host copy, started when it sampled): waits
        for this step's GPU work, not for a next step queued behind it."""
        if self.on_device is not None:
            host, done, rows = self.on_device
            self.on_device = None
            if done is not None:
                done.synchronize()
            for i, token in zip(rows, host.tolist()):
                self.tokens[i] = token
        return self
