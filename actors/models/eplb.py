"""Expert load recording and placement planning (expert-parallel load balancing, EPLB).

A MoE layer has E logical experts and S = E + K physical slots (K redundant copies of hot
experts); under expert parallelism rank r holds slots [r*S/ep, (r+1)*S/ep). A placement is
a list: slot -> logical expert. Plain Python over small lists; nothing here knows the model.
"""
from __future__ import annotations

from collections import Counter

import torch


class ExpertLoad:
    """Tokens routed to each expert of this rank's MoE layers over the last `window` forwards.

    A ring of per-forward counts; the first MoE layer of a forward opens a new row, so every
    rank of a stage (which runs the same forwards) holds the same window.
    """

    def __init__(self, num_layers: int, num_experts: int, window: int):
        self.shape = (window, num_layers, num_experts)
        self.counts: torch.Tensor | None = None  # made on the device of the first routing
        self.row = -1

    def record(self, layer: int, ids: torch.Tensor) -> None:
        if self.counts is None:
            self.counts = torch.zeros(self.shape, dtype=torch.long, device=ids.device)
        if layer == 0:
            self.row = (self.row + 1) % self.shape[0]
            self.counts[self.row].zero_()
        flat = ids.flatten()  # (scatter_add, not bincount: no wait for the GPU to size the result)
        self.counts[self.row, layer].scatter_add_(0, flat, torch.ones_like(flat))

    def clear(self) -> None:
        self.counts, self.row = None, -1

    def totals(self) -> list[list[int]]:
        """[layer][expert] tokens over the window."""
        if self.counts is None:
            return [[0] * self.shape[2] for _ in range(self.shape[1])]
        return self.counts.sum(0).tolist()


# --------------------------------------------------------------------------- placement

def replica_counts(load: list[float], num_slots: int, ranks: int, hot: int) -> list[int]:
    """Copies per expert. `hot` extra slots go, one at a time, to the expert with the most load
    per copy; any further ones to the coldest experts (they must hold something). Never more
    copies than ranks: two copies on one rank would not share its work."""
    counts = [1] * len(load)
    for i in range(num_slots - len(load)):
        open_ = [e for e in range(len(load)) if counts[e] < ranks]
        if not open_:
            raise ValueError(f"{num_slots - len(load)} redundant experts is more than "
                             f"{len(load)} experts x {ranks - 1} other ranks can hold")
        per_copy = {e: load[e] / counts[e] for e in open_}
        pick = max(open_, key=lambda e: (per_copy[e], -e)) if i < hot else min(open_, key=lambda e: (load[e], e))
        counts[pick] += 1
    return counts


def pack(load: list[float], counts: list[int], ranks: int, slots_per_rank: int) -> list[int]:
    """Slot -> expert for given copy counts, by greedy packing.

    Replicated experts go first, each copy on a different rank (the ranks with the fewest
    used slots, so this always fits); then single experts, heaviest first, each to the least
    loaded rank with a free slot.
    """
    per_copy = [load[e] / counts[e] for e in range(len(load))]
    held: list[list[int]] = [[] for _ in range(ranks)]
    rank_load = [0.0] * ranks

    def put(e: int, r: int) -> None:
        held[r].append(e)
        rank_load[r] += per_copy[e]

    for e in sorted((e for e in range(len(load)) if counts[e] > 1), key=lambda e: (-per_copy[e], e)):
        free = [r for r in range(ranks) if len(held[r]) < slots_per_rank]
        for r in sorted(free, key=lambda r: (len(held[r]), rank_load[r], r))[:counts[e]]:
            put(e, r)
    for e in sorted((e for e in range(len(load)) if counts[e] == 1), key=lambda e: (-per_copy[e], e)):
        put(e, min((r for r in range(ranks) if len(held[r]) < slots_per_rank), key=lambda r: (rank_load[r], r)))
    return [e for r in range(ranks) for e in sorted(held[r])]


def plan_placement(load: list[float], ranks: int, slots_per_rank: int,
                   previous: list[int] | None = None) -> list[int]:
    """The placement with the lowest busiest-rank load among: the previous one, and a packing
    for each way of spending the redundant slots (0..K copies of hot experts, the rest on
    cold ones). Ties keep the previous placement; experts that stay on a rank keep their
    slot, so only the experts that really move are read again."""
    slots = ranks * slots_per_rank
    candidates = [previous] if previous else []
    candidates += [pack(load, replica_counts(load, slots, ranks, hot), ranks, slots_per_rank)
                   for hot in range(slots - len(load), -1, -1)]
    best = min(candidates, key=lambda placement: max(rank_loads(load, placement, ranks)))
    return [e for r in range(ranks) for e in _keep_slots(best[r * slots_per_rank:(r + 1) * slots_per_rank],
                                                          previous, r, slots_per_rank)]


def _keep_slots(experts: list[int], previous: list[int] | None, rank: int, n: int) -> list[int]:
    """Order a rank's experts so those it already held stay in the same slot."""
    old = previous[rank * n:(rank + 1) * n] if previous else []
    slots = [e if e in experts else None for e in old] + [None] * (n - len(old))
    rest = iter(sorted(e for e in experts if e not in slots))
    return [e if e is not None else next(rest) for e in slots]


def initial_placement(num_experts: int, ranks: int, slots_per_rank: int) -> list[int]:
    """Before any load is known: every expert counts the same."""
    return plan_placement([1.0] * num_experts, ranks, slots_per_rank)


def rank_loads(load: list[float], placement: list[int], ranks: int) -> list[float]:
    """Tokens each rank computes when replicas split their expert's tokens evenly."""
    copies = Counter(placement)
    n = len(placement) // ranks
    return [sum(load[e] / copies[e] for e in placement[r * n:(r + 1) * n]) for r in range(ranks)]


def balancedness(loads: list[float]) -> float:
    """mean / max: 1.0 is perfectly even; 1/n means one of n does all the work."""
    top = max(loads, default=0)
    return 1.0 if top == 0 else sum(loads) / len(loads) / top
