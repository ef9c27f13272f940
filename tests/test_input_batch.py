"""The persistent input batch (actors/worker/input_batch.py): every rank keeps the live
sequences' block tables across steps from the changes the scheduler sends, and a step's
tensors built from them equal what the rows' whole tables give."""
from __future__ import annotations

import random

import pytest
import torch

from actors.config import EngineConfig
from actors.core.block_manager import BlockManager
from actors.core.scheduler import Scheduler
from actors.core.sequence import PLACEHOLDER, Sequence
from actors.core.step import SchedulerOutput, StepRow
from actors.sampling_params import SamplingParams
from actors.worker.input_batch import InputBatch, pending_tokens


def reference(rows: list[tuple[list[int], int, list[int]]], bs: int):
    """(slot mapping, positions) from each row's (tokens, start, whole block table)."""
    slots, positions = [], []
    for tokens, start, table in rows:
        for p in range(start, start + len(tokens)):
            positions.append(p)
            slots.append(table[p // bs] * bs + p % bs)
    return slots, positions


def test_rows_are_reused_and_tables_grow_from_the_changes():
    batch = InputBatch(max_rows=2, max_blocks=4, block_size=4)
    batch.update(SchedulerOutput([], 0, [], [(7, 0, [5, 6]), (8, 0, [1])]))
    batch.update(SchedulerOutput([], 0, [], [(7, 2, [9])]))  # seq 7 gained a block
    assert batch.tables[batch.rows[7]].tolist() == [5, 6, 9, 0]
    batch.update(SchedulerOutput([], 0, [], [(9, 0, [3])], freed=[8]))  # 8 left: 9 takes its row
    assert sorted(batch.rows) == [7, 9] and batch.tables[batch.rows[9]].tolist() == [3, 0, 0, 0]
    # preempted and resumed in one step: dropped, then its whole (new) table
    batch.update(SchedulerOutput([], 0, [], [(7, 0, [2])], freed=[7]))
    assert batch.tables[batch.rows[7]].tolist() == [2, 0, 0, 0]
    batch.reset()
    assert batch.rows == {} and len(batch.free) == 2 and not batch.tables.any()


def test_mixed_step_tensors_equal_the_whole_tables():
    bs, rng = 4, random.Random(0)
    batch = InputBatch(max_rows=8, max_blocks=10, block_size=bs, pad_block=99)
    whole = {}
    for seq_id in range(5):
        whole[seq_id] = rng.sample(range(40), 10)
        batch.update(SchedulerOutput([], 0, [], [(seq_id, 0, whole[seq_id])]))
    # 2 decodes, then chunks: one starting its sequence, one after a cached prefix, a short one
    spec = [(0, 1, 13), (1, 1, 38), (2, 7, 0), (3, 9, 20), (4, 3, 17)]
    rows = [StepRow(sid, [rng.randrange(100) for _ in range(n)], start) for sid, n, start in spec]
    step = SchedulerOutput(rows, 2, [])
    ids, positions, meta = batch.prepare(step, torch.device("cpu"))
    want_slots, want_pos = reference([(r.token_ids, r.start, whole[r.seq_id]) for r in rows], bs)
    assert ids.tolist() == [t for r in rows for t in r.token_ids]
    assert positions.tolist() == want_pos and meta.slot_mapping.tolist() == want_slots
    assert meta.decode_context_lens.tolist() == [14, 39] and meta.decode_block_tables.shape == (2, 10)
    assert meta.decode_block_tables[0, :4].tolist() == whole[0][:4]
    assert meta.prefill_chunks == [(2, 7, 0), (9, 9, 20), (18, 3, 17)]
    assert meta.prefill_block_tables.shape == (3, 8)  # ceil(29 / 4) blocks cover the longest
    assert meta.prefill_block_tables[1].tolist() == whole[3][:8]


def test_the_scheduler_sends_each_block_once_and_frees_rows(checkpoint_factory):
    """Running a schedule against an input batch the way the ranks do keeps every row's table
    equal to its sequence's, through growth, finishing and preemption."""
    bs = 4
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=8, block_size=bs)
    blocks = BlockManager(12, bs)
    sched = Scheduler(config, blocks, max_model_len=64, eos_ids=frozenset())
    batch = InputBatch(max_rows=4, max_blocks=16, block_size=bs)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    seqs = [Sequence(f"r{i}", 0, list(range(3 + 2 * i)), 3 + 2 * i, params) for i in range(4)]
    for s in seqs:
        sched.add(s)
    sent = 0
    for _ in range(40):
        out = sched.schedule()
        if not out.rows:
            break
        sent += sum(len(b) for _, _, b in out.block_tables)
        batch.update(out)
        for s in sched.running:
            if s.num_sent_blocks:
                assert batch.tables[batch.rows[s.seq_id], :len(s.block_table)].tolist() == s.block_table
        sched.update(out, [7 if s.samples else None for s in out.seqs])
    assert all(s.finished for s in seqs) and sched.num_preemptions > 0
    out = sched.schedule()  # nothing left to run: the last rows leave with the next step that has one
    assert sched.freed and not out.rows
    batch.update(SchedulerOutput([], 0, [], freed=sched.freed))
    assert batch.rows == {}
    # each block was sent once per admission, not every step
    assert sent <= sum(blocks.blocks_needed(s.num_tokens) for s in seqs) * (1 + sched.num_preemptions)


@pytest.mark.parametrize("pad", [0, 11])
def test_padded_decode_fills_graph_rows_from_the_batch(pad):
    batch = InputBatch(max_rows=4, max_blocks=3, block_size=4, pad_block=pad)
    step = SchedulerOutput([StepRow(1, [7], 5)], 1, [0], [(1, 0, [3, 9])])
    batch.update(step)
    p = batch.padded_decode(step, 2, width=3)
    assert p.block_tables.tolist() == [[3, 9, pad], [pad, pad, pad]]
    assert p.slots.tolist() == [9 * 4 + 1, pad * 4] and p.context_lens.tolist() == [6, 1]


def test_padded_decode_gives_a_verify_chunk_one_row_per_token():
    """A decode row, then a row with its last token and two drafts: each draft's position
    becomes a decode row of its own, on its sequence's table, attending up to itself."""
    batch = InputBatch(max_rows=4, max_blocks=3, block_size=4, pad_block=11)
    step = SchedulerOutput([StepRow(1, [7], 5), StepRow(2, [4, 5, 6], 2)], 1, [0, 1, 2, 3],
                           [(1, 0, [3, 9]), (2, 0, [6, 8])])
    batch.update(step)
    p = batch.padded_decode(step, 6, width=2)
    assert p.input_ids.tolist() == [7, 4, 5, 6, 0, 0]
    assert p.positions.tolist() == [5, 2, 3, 4, 0, 0]
    assert p.context_lens.tolist() == [6, 3, 4, 5, 1, 1]
    assert p.block_tables.tolist() == [[3, 9], [6, 8], [6, 8], [6, 8], [11, 11], [11, 11]]
    assert p.slots.tolist() == [9 * 4 + 1, 6 * 4 + 2, 6 * 4 + 3, 8 * 4, 11 * 4, 11 * 4]


@pytest.mark.parametrize("order", ["same", "shifted", "mixed"])
def test_placeholders_take_the_previous_steps_tokens(order):
    """Async scheduling: a row's placeholder input id becomes the token the previous step
    sampled for its sequence, whether the rows come in the previous step's order (a slice, no
    index upload), with a sequence gone, or after prompt chunks that have no placeholder."""
    sampled = (torch.tensor([101, 102, 103, 104]), [10, 11, 12, 13])
    decodes = {"same": [10, 11, 12], "shifted": [11, 13], "mixed": [13, 10]}[order]
    rows = [StepRow(i, [PLACEHOLDER], 5) for i in decodes]
    if order == "mixed":
        rows += [StepRow(20, [7, 8, 9], 0), StepRow(12, [3, PLACEHOLDER], 4)]  # a prompt chunk, a two-token row
    ids = torch.tensor([t for r in rows for t in r.token_ids])
    pending = pending_tokens(SchedulerOutput(rows, len(decodes), []), sampled)
    assert (pending.picks is None) == (order == "same")
    pending.apply(ids)
    want = {"same": [101, 102, 103], "shifted": [102, 104], "mixed": [104, 101, 7, 8, 9, 3, 103]}[order]
    assert ids.tolist() == want
    assert pending_tokens(SchedulerOutput([StepRow(20, [7, 8], 0)], 0, []), None) is None
    with pytest.raises(RuntimeError, match="placeholder"):
        pending_tokens(SchedulerOutput(rows, len(decodes), []), None)
