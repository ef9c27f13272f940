"""One step across all ranks: rank 0 broadcasts the step, each pipeline stage runs its layers.

A step's batch is cut into micro-batches; stage s works on micro-batch i+1 while stage s+1
works on micro-batch i, so stages overlap. Hidden states go to the same tp rank of the next
stage; the last stage's tp rank 0 sends the logits back to rank 0, which samples, and the
pooled hidden states of embedding requests (whole there, after the final norm).
The per-step message is one broadcast over torch.distributed, not a Ray call per rank.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from actors.distributed.parallel import Parallel
from kernels.host_copies import to_device


@dataclass
class MicroBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: object  # kernels.attention.AttentionMetadata
    logit_rows: list[int]
    lora: object = None  # actors.models.lora.LoraBatch: its rows' adapters (None: none)
    pool_spans: list[tuple[int, int]] = field(default_factory=list)  # SchedulerOutput.pool_spans


STOP = "stop"
PING = "ping"  # (PING, payload): answer with an all-reduce; measures orchestration alone
REBALANCE = "rebalance"  # (REBALANCE, step): re-plan expert placement, then run the step


def broadcast_step(p: Parallel, message) -> object:
    """Rank 0 sends `message` (a SchedulerOutput, or STOP) to every rank; others receive it."""
    box = [message]
    dist.broadcast_object_list(box, src=0, group=p.control_group)
    return box[0]


Heads = tuple[torch.Tensor | None, torch.Tensor | None]  # (logits, pooled sums) of a batch


def last_stage_outputs(model, hidden: torch.Tensor, logit_rows: list[int],
                       pool_spans: list[tuple[int, int]]) -> Heads:
    """What the last stage makes of its final hidden states: the logits of `logit_rows`, and
    for each pool span the float32 sum of its rows' hidden states (None where none is asked)."""
    logits = model.compute_logits(take_rows(hidden, logit_rows)) if logit_rows else None
    return logits, span_sums(hidden, pool_spans) if pool_spans else None


def take_rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x[rows] for increasing row indices: x itself when they are all of its rows (a decode
    step: no copy), else through an index tensor uploaded without waiting for the GPU."""
    return x if len(rows) == len(x) else x[to_device(torch.tensor(rows), x.device)]


def span_sums(hidden: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    """[len(spans), hidden] float32: each (first, end) span's rows summed, in one index_add."""
    rows = torch.cat([torch.arange(first, end) for first, end in spans])
    lengths = torch.tensor([end - first for first, end in spans])
    span_of_row = torch.repeat_interleave(torch.arange(len(spans)), lengths)
    sums = torch.zeros(len(spans), hidden.shape[-1], dtype=torch.float32, device=hidden.device)
    return sums.index_add_(0, span_of_row.to(hidden.device), hidden[rows.to(hidden.device)].float())


@torch.inference_mode()
def run_stage(model, p: Parallel, micro: list[MicroBatch], hidden_size: int, vocab: int,
              dtype: torch.dtype) -> list[Heads]:
    """This rank's share of the step. Rank 0 gets every micro-batch's logits and pooled sums back."""
    sends, heads = [], []
    for mb in micro:
        x = mb.input_ids
        if not p.first_stage:
            x = torch.empty(len(mb.input_ids), hidden_size, dtype=dtype, device=p.device)
            dist.recv(x, src=p.peer(p.pp_rank - 1))
        if hasattr(model, "lora_state"):
            model.lora_state.batch = mb.lora
        h = model(x, mb.positions, mb.meta)
        if not p.last_stage:
            sends.append((dist.isend(h, dst=p.peer(p.pp_rank + 1)), h))
            continue
        out = last_stage_outputs(model, h, mb.logit_rows, mb.pool_spans)
        if p.rank == 0:
            heads.append(out)
        elif p.tp_rank == 0:
            sends += [(dist.isend(t, dst=0), t) for t in out if t is not None]
    if p.rank == 0 and not p.last_stage:
        last = (p.pp_size - 1) * p.tp_size
        for mb in micro:  # in the order the last stage sent them
            logits = _recv(len(mb.logit_rows), vocab, last, p.device)
            heads.append((logits, _recv(len(mb.pool_spans), hidden_size, last, p.device)))
    for work, _ in sends:
        work.wait()
    return heads


def _recv(rows: int, width: int, src: int, device) -> torch.Tensor | None:
    """A float32 [rows, width] tensor from rank `src`; None (nothing sent) for no rows."""
    if not rows:
        return None
    out = torch.empty(rows, width, dtype=torch.float32, device=device)
    dist.recv(out, src=src)
    return out


def worker_loop(p: Parallel, run_step, on_rebalance=None) -> None:
    """Ranks 1..n: run every step rank 0 broadcasts (`run_step(scheduler_output)`), until stop."""
    while True:
        message = broadcast_step(p, None)
        if message == STOP:
            return
        if isinstance(message, tuple) and message[0] == PING:
            dist.all_reduce(torch.zeros(1, device=p.device))
            continue
        if isinstance(message, tuple) and message[0] == REBALANCE:
            on_rebalance()
            message = message[1]
        run_step(message)


def ping(p: Parallel, payload) -> None:
    """Rank 0: one broadcast of `payload` to every rank and an all-reduce back, no forward."""
    broadcast_step(p, (PING, payload))
    dist.all_reduce(torch.zeros(1, device=p.device))
