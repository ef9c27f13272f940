"""The live sequences' block tables, kept across steps, and each step's input tensors.

Every rank keeps one row per live sequence in a CPU tensor of block ids (as vLLM's InputBatch
keeps its persistent batch). The scheduler sends only what changed since the last step: the
blocks a sequence gained, its whole table when it starts or resumes, and the sequences that
left (SchedulerOutput.block_tables / .freed). A step's tensors (input ids, positions, the slot
each new token's K/V goes to, the decode rows' block tables and context lengths, the prefill
chunks') are then a few gathers from those rows, not a Python loop over every token and every
row's whole table.

Unused entries hold `pad_block`: the spare block of a pool that CUDA graphs or compiled
decode pad onto (else block 0). Attention never reads them (the context lengths mask them).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from actors.core.sequence import PLACEHOLDER
from actors.core.step import SchedulerOutput
from kernels import flash_attention, triton_attention
from kernels.attention import AttentionMetadata, RecurrentRows
from kernels.host_copies import to_device


@dataclass
class PaddedDecode:
    """A decode step's inputs for a graph of `size` rows: row r < batch is the step's row r, the
    rest are padding rows that write to and read from the pad block."""
    size: int
    input_ids: torch.Tensor  # [size]
    positions: torch.Tensor  # [size]
    slots: torch.Tensor  # [size]
    context_lens: torch.Tensor  # [size] int32
    block_tables: torch.Tensor  # [size, width]


@dataclass
class PendingTokens:
    """Input ids the previous step is still sampling on the device (async scheduling): token
    rows `rows` of this step take `tokens[picks]`; with `picks` None, rows 0..rows-1 take
    tokens 0..rows-1 (a decode step after a decode step: no index tensors to upload)."""
    tokens: torch.Tensor
    rows: torch.Tensor | int
    picks: torch.Tensor | None = None

    def apply(self, input_ids: torch.Tensor) -> None:
        if self.picks is None:
            input_ids[:self.rows] = self.tokens[:self.rows]
        else:
            input_ids[self.rows] = self.tokens[self.picks]


def pending_tokens(output: SchedulerOutput, sampled: tuple | None) -> PendingTokens | None:
    """Where this step's placeholders are (a placeholder is always its row's last token) and
    which of the previous step's sampled tokens (RunnerOutput.sampled) fills each."""
    rows, seq_ids, offset = [], [], 0
    for r in output.rows:
        offset += len(r.token_ids)
        if r.token_ids[-1] == PLACEHOLDER:
            rows.append(offset - 1)
            seq_ids.append(r.seq_id)
    if not rows:
        return None
    if sampled is None:
        raise RuntimeError("a step has placeholder tokens but no previous step sampled them")
    tokens, sampled_ids = sampled
    n = len(rows)
    if rows[-1] == n - 1 and sampled_ids[:n] == seq_ids:  # the same sequences first, in order
        return PendingTokens(tokens, n)
    where = {seq_id: k for k, seq_id in enumerate(sampled_ids)}
    return PendingTokens(tokens, to_device(ints(rows), tokens.device),
                         to_device(ints([where[i] for i in seq_ids]), tokens.device))


def ints(values: list[int]) -> torch.Tensor:
    """A list of ints as an int64 tensor, through numpy: torch.tensor() converts element by
    element (~40 us for 128 ints on the 2-core Zen 3, against ~9)."""
    return torch.from_numpy(np.array(values, dtype=np.int64))


def recurrent_rows(output: SchedulerOutput, rows: list[int], lens: list[int], device: torch.device) -> RecurrentRows:
    """The step's sequences' state rows: the decode rows' as a tensor, the chunks' with their token
    rows, and the rows to reset (sequences computed from position 0)."""
    nd = output.num_decodes
    chunks, first = [], nd
    for row, count in zip(rows[nd:], lens[nd:]):
        chunks.append((first, count, row))
        first += count
    fresh = [row for row, r in zip(rows, output.rows) if r.start == 0]
    return RecurrentRows(nd, to_device(ints(rows[:nd]), device), chunks,
                         to_device(ints(fresh), device) if fresh else None)


class InputBatch:
    def __init__(self, max_rows: int, max_blocks: int, block_size: int, pad_block: int = 0,
                 recurrent: bool = False):
        """recurrent: the model has linear-attention layers, whose state row is the sequence's row here."""
        self.block_size, self.pad_block, self.recurrent = block_size, pad_block, recurrent
        self.tables = torch.full((max_rows, max_blocks), pad_block, dtype=torch.long)
        self.lengths = [0] * max_rows  # blocks in each row
        self.rows: dict[int, int] = {}  # seq id -> row
        self.free = list(range(max_rows - 1, -1, -1))

    def update(self, output: SchedulerOutput) -> None:
        """The step's changes: rows of sequences that left are reused, then tables grow."""
        for seq_id in output.freed:
            row = self.rows.pop(seq_id, None)
            if row is not None:
                self.tables[row, :self.lengths[row]] = self.pad_block
                self.lengths[row] = 0
                self.free.append(row)
        for seq_id, first, blocks in output.block_tables:
            row = self.rows.get(seq_id)
            if row is None:
                row = self.rows[seq_id] = self.free.pop()
            end = first + len(blocks)
            self.tables[row, first:end] = ints(blocks)
            self.lengths[row] = end

    def reset(self) -> None:
        """Forget every row (after start-up's synthetic steps)."""
        self.update(SchedulerOutput([], 0, [], freed=list(self.rows)))

    def prepare(self, output: SchedulerOutput, device: torch.device, flash_ops=None, triton: bool = False,
                pending: PendingTokens | None = None):
        """(input ids, positions, attention metadata) of the step's rows, on `device`, for the
        flash backend (`flash_ops`), the triton one, or the native / torch kernels; `pending`
        fills the input ids the previous step is still sampling."""
        rows, bs = output.rows, self.block_size
        lens = [len(r.token_ids) for r in rows]
        table_rows = ints([self.rows[r.seq_id] for r in rows])
        starts = ints([r.start for r in rows])
        ids = ints([t for r in rows for t in r.token_ids])
        if output.num_decodes == len(rows):  # one token a row: no expansion to tokens
            positions, token_rows = starts, table_rows
        else:
            counts = ints(lens)
            row_of = torch.repeat_interleave(torch.arange(len(rows)), counts)
            first = counts.cumsum(0) - counts  # each row's first token
            positions = starts[row_of] + torch.arange(len(ids)) - first[row_of]
            token_rows = table_rows[row_of]
        slots = self.tables[token_rows, positions // bs] * bs + positions % bs
        meta = AttentionMetadata(slot_mapping=to_device(slots, device), num_decode_tokens=output.num_decodes,
                                 block_size=bs)
        ends = starts + ints(lens)
        if flash_ops is not None or triton:
            tables = self.tables[table_rows, :-(-int(ends.max()) // bs)]
            if triton:
                meta.triton = triton_attention.build_metadata(lens, ends, tables, bs, device)
            else:
                meta.flash = flash_attention.build_metadata(lens, ends.tolist(), tables, output.num_decodes,
                                                            bs, device, flash_ops)
        else:
            self._split_metadata(meta, output, table_rows, starts, ends, device)
        if self.recurrent:
            meta.recurrent = recurrent_rows(output, table_rows.tolist(), lens, device)
        ids = to_device(ids, device)
        if pending is not None:
            pending.apply(ids)
        return ids, to_device(positions, device), meta

    def _split_metadata(self, meta: AttentionMetadata, output: SchedulerOutput, table_rows, starts, ends,
                        device: torch.device) -> None:
        """Decode rows: block tables and context lengths; prefill chunks: (first token row,
        tokens, first position) and block tables."""
        nd, bs = output.num_decodes, self.block_size
        if nd:
            ctx = ends[:nd].to(torch.int32)
            meta.decode_block_tables = to_device(self.tables[table_rows[:nd], :-(-int(ctx.max()) // bs)], device)
            meta.decode_context_lens = to_device(ctx, device)
        if nd < len(output.rows):
            prefills = output.rows[nd:]
            offset, chunks = nd, []
            for r in prefills:
                chunks.append((offset, len(r.token_ids), r.start))
                offset += len(r.token_ids)
            meta.prefill_chunks = chunks
            width = -(-int(ends[nd:].max()) // bs)
            meta.prefill_block_tables = to_device(self.tables[table_rows[nd:], :width], device)

    def padded_decode(self, output: SchedulerOutput, size: int, width: int) -> PaddedDecode:
        """The step's token rows as one-token decode rows, padded to `size` rows, tables to
        `width` blocks. A row of several tokens (a speculative verify chunk) becomes one row per
        token, each attending to the positions up to its own: the graph writes every row's K/V
        before any row attends, so that is the chunk's causal attention."""
        rows, bs = output.rows, self.block_size
        counts = [len(r.token_ids) for r in rows]
        n = sum(counts)
        tables = torch.full((size, width), self.pad_block, dtype=torch.long)
        positions = torch.zeros(size, dtype=torch.long)
        slots = torch.full((size,), self.pad_block * bs, dtype=torch.long)
        if n:
            table_rows, starts = ints([self.rows[r.seq_id] for r in rows]), ints([r.start for r in rows])
            if n != len(rows):  # expanded to tokens
                c = ints(counts)
                row_of = torch.repeat_interleave(torch.arange(len(rows)), c)
                starts = starts[row_of] + torch.arange(n) - (c.cumsum(0) - c)[row_of]
                table_rows = table_rows[row_of]
            tables[:n] = self.tables[table_rows, :width]
            positions[:n] = starts
            slots[:n] = tables[torch.arange(n), positions[:n] // bs] * bs + positions[:n] % bs
        ids = ints([t for r in rows for t in r.token_ids] + [0] * (size - n))
        return PaddedDecode(size, ids, positions, slots, (positions + 1).to(torch.int32), tables)
