"""One step across all ranks: rank 0 broadcasts the step, each pipeline stage runs its layers.

A step's batch is cut into micro-batches; stage s works on micro-batch i+1 while stage s+1
works on micro-batch i, so stages overlap. Hidden states go to the same tp rank of the next
stage; the last stage's tp rank 0 sends the logits back to rank 0, which samples.
The per-step message is one broadcast over torch.distributed, not a Ray call per rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from actors.distributed.parallel import Parallel


@dataclass
class MicroBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: object  # kernels.attention.AttentionMetadata
    logit_rows: list[int]
    lora: object = None  # actors.models.lora.LoraBatch: its rows' adapters (None: none)


STOP = "stop"
PING = "ping"  # (PING, payload): answer with an all-reduce; measures orchestration alone
REBALANCE = "rebalance"  # (REBALANCE, step): re-plan expert placement, then run the step


def broadcast_step(p: Parallel, message) -> object:
    """Rank 0 sends `message` (a SchedulerOutput, or STOP) to every rank; others receive it."""
    box = [message]
    dist.broadcast_object_list(box, src=0, group=p.control_group)
    return box[0]


@torch.inference_mode()
def run_stage(model, p: Parallel, micro: list[MicroBatch], hidden_size: int, vocab: int,
              dtype: torch.dtype) -> list[torch.Tensor | None]:
    """This rank's share of the step. Rank 0 gets the logits of every micro-batch back."""
    sends, logits = [], []
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
        out = model.compute_logits(h[mb.logit_rows]) if mb.logit_rows else None
        if p.rank == 0:
            logits.append(out)
        elif p.tp_rank == 0 and out is not None:
            sends.append((dist.isend(out, dst=0), out))
    if p.rank == 0 and not p.last_stage:
        last = (p.pp_size - 1) * p.tp_size
        for mb in micro:
            out = None
            if mb.logit_rows:
                out = torch.empty(len(mb.logit_rows), vocab, dtype=torch.float32, device=p.device)
                dist.recv(out, src=last)
            logits.append(out)
    for work, _ in sends:
        work.wait()
    return logits


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
