"""One rank's expert bookkeeping for a MoE model: routed-load recording, re-planning, stats.

Re-plan protocol: rank 0 counts steps; every --eplb-step-interval steps it sends the step as
(REBALANCE, micro-batches) over the usual per-step broadcast. Every rank then, before that
step's forward: plans each of its MoE layers from the recorded window (the stage's tp rank 0
plans and broadcasts, so the stage cannot disagree), reads the experts that move into its
slots from the safetensors files, and switches. Nothing runs between two steps, so in-flight
requests (whose KV cache does not depend on the placement) carry on unchanged.
"""
from __future__ import annotations

import contextlib
import logging
import time

import torch

from actors.models.eplb import ExpertLoad, balancedness, plan_placement, rank_loads
from actors.worker.loader import load_selected

log = logging.getLogger("shoal.experts")


class ExpertBalancer:
    def __init__(self, model, window: int, step_interval: int, path):
        self.model, self.path, self.p = model, path, model.p
        self.blocks = model.moe_blocks()  # (global layer, SparseMoeBlock) of this stage
        self.window = window
        self.load = ExpertLoad(len(self.blocks), model.args.moe.num_experts, window)
        for i, (_, block) in enumerate(self.blocks):
            block.load, block.load_index = self.load, i
        self.interval = step_interval if self.p.ep_size > 1 else 0
        self.steps = self.rebalances = 0

    def hold_graph_rows(self, rows: int, device) -> None:
        """Static buffers for the choices of up to `rows` rows made inside CUDA graphs, one per
        MoE layer, made before any capture: every graph, whatever its size or the order the
        buckets are captured in, writes into the same one."""
        for _, block in self.blocks:
            block.graph_ids = torch.zeros(rows, block.top_k, dtype=torch.long, device=device)

    @contextlib.contextmanager
    def paused(self):
        """The recorded window as it was before the block: a capture's forwards route padding."""
        counts = None if self.load.counts is None else self.load.counts.clone()
        row = self.load.row
        try:
            yield
        finally:
            self.load.counts, self.load.row = counts, row

    def record_graph_rows(self, rows: int) -> None:
        """After a CUDA graph's replay: the routed load of its first `rows` (real) rows."""
        for i, (_, block) in enumerate(self.blocks):
            if block.graph_ids is not None:
                self.load.record(i, block.graph_ids[:rows])

    def due(self) -> bool:
        """Rank 0, once per step: re-plan before this step?"""
        self.steps += 1
        return bool(self.interval) and self.steps % self.interval == 0

    def rebalance(self) -> None:
        """Every rank, at the same step: plan from the window, fetch the moved experts, switch."""
        if not self.blocks:
            return
        start = time.perf_counter()
        totals = self.load.totals()
        plans = {layer: plan_placement(totals[i], self.p.ep_size, block.slots_per_rank, block.placement)
                 for i, (layer, block) in enumerate(self.blocks)}
        plans = self.p.broadcast_in_stage(plans)
        changed = {layer: _changed_slots(block.local_slots(), block.local_slots(plans[layer]))
                   for layer, block in self.blocks}
        read = load_selected(self.model, self.path, self.model.expert_reload_rule(plans, changed))
        for layer, block in self.blocks:
            block.set_placement(plans[layer])
        self.rebalances += 1
        log.info("rank %d: expert placement re-planned, %d expert tensors read in %.2f s",
                 self.p.rank, read, time.perf_counter() - start)

    def stats(self) -> dict:
        """Routed tokens per expert over the window and how evenly the ranks share them."""
        totals, ep = self.load.totals(), self.p.ep_size
        layers = [_layer_stats(layer, block.placement, totals[i], ep)
                  for i, (layer, block) in enumerate(self.blocks)]
        return {
            "ep_size": ep,
            # routed tokens each expert-parallel rank computed over the window, all layers together
            "rank_tokens": [round(sum(x["rank_tokens"][r] for x in layers), 2) for r in range(ep)],
            "physical_experts": len(self.blocks[0][1].placement) if self.blocks else 0,
            "window_steps": self.window,
            "rebalances": self.rebalances,
            "balancedness": round(sum(x["balancedness"] for x in layers) / max(1, len(layers)), 4),
            "layers": layers,
        }


def _changed_slots(old: list[int], new: list[int]) -> set[int]:
    return {j for j, (a, b) in enumerate(zip(old, new)) if a != b}


def _layer_stats(layer: int, placement: list[int], tokens: list[int], ep: int) -> dict:
    n = len(placement) // ep
    per_rank = rank_loads(tokens, placement, ep)
    return {"layer": layer,
            "tokens": tokens,  # per logical expert
            "rank_tokens": [round(x, 2) for x in per_rank],  # replicas split their expert's tokens evenly
            "balancedness": round(balancedness(per_rank), 4),  # over ranks
            "expert_balancedness": round(balancedness(tokens), 4),  # over experts, any placement
            "placement": [placement[r * n:(r + 1) * n] for r in range(ep)]}
