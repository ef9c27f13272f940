"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE (shared expert + gate), Qwen3-MoE, OLMoE,
GLM-4.5 (DeepSeek-V3's routing on GQA attention), MiniMax-M2 (sigmoid routing with a bias), ERNIE 4.5
(softmax routing with a bias), Granite MoE (its experts stacked, an ungated shared MLP), Llama 4
(a sigmoid weight on one expert's input, a shared expert), PhiMoE (its sparsemixer's two experts),
HunYuan MoE (a float32 router, a shared MLP), and the MoE half of DeepSeek (shared experts,
grouped routing; its attention: actors/models/deepseek.py).

The Llama-family decoder with a SparseMoeBlock in place of the MLP of its sparse layers.
Each rank holds some physical expert slots (`placement`: slot -> expert, see actors/models/eplb.py):
under expert parallelism a share of the experts at full width, otherwise every expert at
1/tp of its width. Either way each rank's output is a partial sum, and one all-reduce over
the stage's TP group completes it (tokens are replicated across that group).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from actors.distributed.parallel import Parallel
from actors.models.args import ModelArgs, Routing
from actors.models.eplb import initial_placement
from actors.models.llama import LlamaForCausalLM
from kernels import triton_fused, triton_moe
from kernels.activation import silu_and_mul
from kernels.moe import grouped_experts, route, route_grouped, route_sparsemixer, spread_over_replicas

# Checkpoint names of an expert's projections -> which part of our fused weights they fill.
EXPERT_PROJ = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}


class Experts(nn.Module):
    """This rank's expert slots, stacked: gate_up_proj [L, 2I, H] (gate rows, then up rows)
    and down_proj [L, H, I]."""

    def __init__(self, slots: int, hidden: int, width: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(slots, 2 * width, hidden))
        self.down_proj = nn.Parameter(torch.empty(slots, hidden, width))


class Router(nn.Linear):
    """One logit per expert. DeepSeek-V3's bias steers which experts are chosen, not their weights."""

    def __init__(self, hidden: int, experts: int, score_bias: bool):
        super().__init__(hidden, experts, bias=False)
        self.register_parameter("e_score_correction_bias", nn.Parameter(torch.empty(experts)) if score_bias else None)


class SharedExpert(nn.Module):
    """The always-on expert (Qwen2-MoE; DeepSeek's shared experts as one wider one), TP-sharded
    like the dense MLP, but without an all-reduce of its own: its partial sum joins the block's."""

    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)

    def forward(self, x, fused: bool = False):
        act = triton_fused.silu_and_mul if fused else silu_and_mul
        return self.down_proj(act(self.gate_up_proj(x)))


@dataclass
class Tables:
    """A placement as index tensors on the compute device."""
    replica_slots: torch.Tensor  # [E, max copies] physical slots of each expert (padded)
    replica_counts: torch.Tensor  # [E]
    slot_to_local: torch.Tensor  # [S] this rank's slot index, or -1


class SparseMoeBlock(nn.Module):
    def __init__(self, a: ModelArgs, p: Parallel):
        super().__init__()
        m, ep = a.moe, p.ep_size
        self.p, self.top_k, self.renormalize, self.num_experts = p, m.top_k, m.renormalize, m.num_experts
        self.routing, self.weight_input, self.stacked_for_x_at_w = m.routing, m.weight_input, m.stacked_for_x_at_w
        self.plain_routing = m.routing == Routing()  # softmax, top-k (decided once, not per step)
        slots = m.num_experts + p.redundant_experts
        if slots % ep or p.redundant_experts > m.num_experts * (ep - 1):
            raise ValueError(f"{m.num_experts} experts + {p.redundant_experts} redundant must split evenly over "
                             f"{ep} expert-parallel ranks, at most one copy of an expert per rank")
        tp_width = 1 if p.expert_parallel else p.tp_size  # without EP each expert is split by width
        if m.intermediate_size % tp_width or m.shared_intermediate_size % p.tp_size:
            raise ValueError(f"tensor parallel size {p.tp_size} must divide the expert width "
                             f"({m.intermediate_size}) and the shared expert width ({m.shared_intermediate_size})")
        self.width, self.slots_per_rank = m.intermediate_size // tp_width, slots // ep
        self.hidden = a.hidden_size
        self.gate = Router(a.hidden_size, m.num_experts, m.routing.score_bias)  # on every rank
        self.experts = Experts(self.slots_per_rank, a.hidden_size, self.width)
        self.shared_expert = self.shared_expert_gate = None
        if m.shared_intermediate_size:
            self.shared_expert = SharedExpert(a.hidden_size, m.shared_intermediate_size // p.tp_size)
        if m.shared_intermediate_size and m.shared_gate:
            self.shared_expert_gate = nn.Linear(a.hidden_size, 1, bias=False)
        self.load, self.load_index = None, 0  # an ExpertLoad recorder, attached by the runner
        self.graph_ids: torch.Tensor | None = None  # choices made inside a CUDA graph, recorded after replays
        self.set_placement(initial_placement(m.num_experts, ep, self.slots_per_rank))

    # ---- placement ----------------------------------------------------------------------
    def set_placement(self, placement: list[int]) -> None:
        self.placement = list(placement)
        self._tables: Tables | None = None  # rebuilt on the next forward

    def local_slots(self, placement: list[int] | None = None) -> list[int]:
        """The logical expert in each of this rank's slots."""
        first = self.p.ep_rank * self.slots_per_rank
        return (placement or self.placement)[first:first + self.slots_per_rank]

    def tables(self, device) -> Tables:
        if self._tables is None:
            copies = [[s for s, e in enumerate(self.placement) if e == x] for x in range(self.num_experts)]
            widest = max(len(c) for c in copies)
            padded = [c + c[:1] * (widest - len(c)) for c in copies]
            first = self.p.ep_rank * self.slots_per_rank
            local = [s - first if 0 <= s - first < self.slots_per_rank else -1 for s in range(len(self.placement))]
            self._tables = Tables(torch.tensor(padded, device=device),
                                  torch.tensor([len(c) for c in copies], device=device),
                                  torch.tensor(local, device=device))
        return self._tables

    # ---- forward ------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """fused (steps of the Triton backend): the experts through kernels/triton_moe.py, which
        never waits for the GPU, so a decode step with this block can be a CUDA graph."""
        weights, ids = self._route(x)
        if self.load is not None:
            self._record(ids)
        e = self.experts
        experts = triton_moe.grouped_experts if fused else grouped_experts
        if self.weight_input:  # Llama 4 (one expert per token): the weight scales what the expert reads
            y = experts(x * weights.to(x.dtype), torch.ones_like(weights), self._local_ids(ids), e.gate_up_proj,
                        e.down_proj)
        else:
            y = experts(x, weights, self._local_ids(ids), e.gate_up_proj, e.down_proj)
        if self.shared_expert_gate is not None:  # the gate is replicated: gating each rank's part is exact
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, fused)
        elif self.shared_expert is not None:
            y = y + self.shared_expert(x, fused)
        return self.p.all_reduce(y)

    def _route(self, x: torch.Tensor):
        if self.plain_routing:
            return route(self.gate(x), self.top_k, self.renormalize)
        r = self.routing
        if r.scoring == "sparsemixer":  # PhiMoE
            return route_sparsemixer(self.gate(x), r.jitter_eps)
        # DeepSeek's router (HunYuan's) runs in float32 whatever the model's dtype, as transformers keeps it
        logits = torch.nn.functional.linear(x.float(), self.gate.weight.float())
        return route_grouped(logits, self.top_k, self.renormalize, r.scoring, r.group_score, r.n_group,
                             r.topk_group, self.gate.e_score_correction_bias, r.scale)

    def _record(self, ids: torch.Tensor) -> None:
        """The routed load, for /stats and re-planning. Inside a CUDA graph the choices go to a
        static buffer instead, recorded after each replay for the step's real rows only
        (actors/worker/expert_balancer.py), padding rows left out."""
        if ids.is_cuda and torch.cuda.is_current_stream_capturing():
            self.graph_ids[:ids.shape[0]].copy_(ids)  # (made by ExpertBalancer.hold_graph_rows)
        else:
            self.load.record(self.load_index, ids)

    def _local_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Expert choices -> this rank's slot computing each (-1: another rank's)."""
        if self.p.ep_size == 1:
            return ids  # every expert, in order, lives here
        t = self.tables(ids.device)
        if self.p.redundant_experts:
            return t.slot_to_local[spread_over_replicas(ids, t.replica_slots, t.replica_counts)]
        return t.slot_to_local[t.replica_slots[ids, 0]]

    # ---- weight loading -----------------------------------------------------------------
    def weight_rule(self, rest: str, placement: list[int] | None = None, only: set[int] | None = None):
        """Rule (see LlamaForCausalLM.weight_rule) for a checkpoint tensor under this block.

        placement/only: load for that placement, into those local slots only (re-planning).
        """
        m = re.match(r"experts\.(gate_up_proj|down_proj)$", rest)
        if m:  # every expert in one tensor: as transformers holds them, or for x @ W (Llama 4's, Qwen3-VL-MoE's)
            part = m.group(1)
            return self._stacked_rule(part, stacked_either(part, self.stacked_for_x_at_w, self.hidden), placement,
                                      only)
        m = re.match(r"(input|output)_linear\.weight$", rest)
        if m:  # Granite's MoE: every expert in one tensor, already [E, 2I, H] / [E, H, I]
            part, take = ("gate_up_proj", stacked_rows) if m.group(1) == "input" else ("down_proj", stacked_columns)
            return self._stacked_rule(part, take, placement, only)
        m = re.match(r"experts\.(\d+)\.(\w+)\.weight$", rest)
        if m:
            slots = [j for j, e in enumerate(self.local_slots(placement))
                     if e == int(m.group(1)) and (only is None or j in only)]
            if not slots:
                return None  # an expert held by another rank
            start = 0 if self.p.expert_parallel else self.p.tp_rank * self.width
            return _ffn_rule("experts.", "", EXPERT_PROJ[m.group(2)], start, self.width, slots[0])
        m = re.match(r"shared_(?:experts?|mlp)\.(\w+)\.weight$", rest)  # DeepSeek: shared_experts; HunYuan: shared_mlp
        if only is not None:
            return None
        if m:
            w = self.shared_expert.down_proj.in_features
            return _ffn_rule("shared_expert.", ".weight", EXPERT_PROJ[m.group(1)], self.p.tp_rank * w, w)
        if rest == "e_score_correction_bias":  # MiniMax-M2 keeps the routing bias beside its router
            return ("gate.e_score_correction_bias", 0, None, 0, 0)
        if rest in ("router.layer.weight", "router.weight", "gate.wg.weight"):  # Granite's router, Llama 4's, HunYuan's
            return ("gate.weight", 0, None, 0, 0)
        if rest == "moe_statics.e_score_correction_bias":  # ERNIE 4.5's: [1, experts]
            return ("gate.e_score_correction_bias", 0, lambda t: t[:].reshape(-1), 0, 0)
        return (rest, 0, None, 0, 0)  # the router and the shared expert's gate: whole on every rank

    def _stacked_rule(self, part: str, take, placement: list[int] | None, only: set[int] | None):
        """One rule per local slot for a tensor stacking every expert: `take(expert, start, width)`
        cuts that expert's part (this rank's slice of its width) in our layout."""
        start = 0 if self.p.expert_parallel else self.p.tp_rank * self.width
        rules = [(f"experts.{part}", 0, take(expert, start, self.width), 0, 0, slot)
                 for slot, expert in enumerate(self.local_slots(placement)) if only is None or slot in only]
        return rules or None


def stacked_gate_up(expert: int, start: int, width: int):
    """[E, H, 2I] (gate columns, then up columns, as `x @ W` takes them) -> this expert's
    [2 * width, H]: gate rows start.., then up rows start.."""
    def take(t):
        cols = t[expert:expert + 1][0]
        half = cols.shape[1] // 2
        return torch.cat((cols[:, start:start + width], cols[:, half + start:half + start + width]), 1).t()
    return take


def stacked_down(expert: int, start: int, width: int):
    """[E, I, H] -> this expert's [H, width] (its columns start..)."""
    return lambda t: t[expert:expert + 1, start:start + width][0].t()


def stacked_rows(expert: int, start: int, width: int):
    """[E, 2I, H] (gate rows, then up rows: our own layout) -> this expert's [2 * width, H]."""
    def take(t):
        rows = t[expert:expert + 1][0]
        half = rows.shape[0] // 2
        return torch.cat((rows[start:start + width], rows[half + start:half + start + width]))
    return take


def stacked_columns(expert: int, start: int, width: int):
    """[E, H, I] (our own layout) -> this expert's [H, width]."""
    return lambda t: t[expert:expert + 1, :, start:start + width][0]


STACKED_PARTS = {"gate_up_proj": stacked_gate_up, "down_proj": stacked_down}  # for x @ W
STACKED_AS_HELD = {"gate_up_proj": stacked_rows, "down_proj": stacked_columns}  # transformers' [E, 2I, H], [E, H, I]


def stacked_either(part: str, for_x_at_w: bool, hidden: int):
    """A `take` maker for a stacked `part` in either layout: its shape tells them apart (hidden
    last in gate_up_proj / first in down_proj as transformers holds them, the other way round for
    x @ W); where it cannot (2I or I equal to hidden, or a wrapper that names no shape), the
    family's layout (`for_x_at_w`) decides."""
    def make(expert: int, start: int, width: int):
        def take(t):
            shape = getattr(t, "get_shape", None)
            dims = tuple(shape() if shape else getattr(t, "shape", ()))[1:]
            held = len(dims) == 2 and dims[1 if part == "gate_up_proj" else 0] == hidden
            x_at_w = len(dims) == 2 and dims[0 if part == "gate_up_proj" else 1] == hidden
            if held == x_at_w:
                x_at_w = for_x_at_w
            return (STACKED_PARTS if x_at_w else STACKED_AS_HELD)[part](expert, start, width)(t)
        return take
    return make


def _ffn_rule(prefix: str, suffix: str, part: str, start: int, width: int, *slot):
    """gate and up fill the two halves of gate_up_proj's rows; down takes a column slice."""
    if part == "down":
        return (f"{prefix}down_proj{suffix}", 0, 1, start, width, *slot)
    return (f"{prefix}gate_up_proj{suffix}", width if part == "up" else 0, 0, start, width, *slot)


class MoeForCausalLM(LlamaForCausalLM):
    def make_mlp(self, layer: int) -> nn.Module:
        if self.args.moe is not None and self.args.moe.is_sparse(layer):
            return SparseMoeBlock(self.args, self.p)
        return super().make_mlp(layer)

    def moe_blocks(self) -> list[tuple[int, SparseMoeBlock]]:
        """(global layer, block) of this stage's sparse layers."""
        return [(self.first_layer + i, layer.mlp) for i, layer in enumerate(self.model.layers)
                if isinstance(layer.mlp, SparseMoeBlock)]

    def _layer_rule(self, prefix: str, rest: str):
        rest = re.sub(r"^(block_sparse_moe|feed_forward)\.", "mlp.", rest)  # (Mixtral's, Llama 4's name for it)
        if rest.startswith("shared_mlp."):  # GraniteMoeShared's, beside the block: [gate; up] fused
            w = self.model.layers[int(prefix.split(".")[2])].mlp.shared_expert.down_proj.in_features
            full = self.args.moe.shared_intermediate_size
            if rest == "shared_mlp.input_linear.weight":
                return [(f"{prefix}mlp.shared_expert.gate_up_proj.weight", 0, 0, self.p.tp_rank * w, w),
                        (f"{prefix}mlp.shared_expert.gate_up_proj.weight", w, 0, full + self.p.tp_rank * w, w)]
            return (f"{prefix}mlp.shared_expert.down_proj.weight", 0, 1, self.p.tp_rank * w, w)
        block = self.model.layers[int(prefix.split(".")[2])].mlp
        if not (isinstance(block, SparseMoeBlock) and rest.startswith("mlp.")):
            return super()._layer_rule(prefix, rest)
        return _under(f"{prefix}mlp.", block.weight_rule(rest[len("mlp."):]))

    def expert_reload_rule(self, plans: dict[int, list[int]], changed: dict[int, set[int]]):
        """weight_rule for fetching only the experts that `plans` (global layer -> placement)
        moves into new local slots (`changed`: global layer -> those slots)."""
        def rule(name: str):
            m = re.match(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe|feed_forward)\."
                         r"(experts\..*|(?:in|out)put_linear\.weight)", name)
            layer = int(m.group(1)) if m else None
            if layer not in plans:
                return None
            block = self.model.layers[layer - self.first_layer].mlp
            return _under(f"model.layers.{layer - self.first_layer}.mlp.",
                          block.weight_rule(m.group(2), plans[layer], changed[layer]))
        return rule


def _under(prefix: str, rule):
    """A block's rule (None, one, or a list) with its target names under `prefix`."""
    if rule is None:
        return None
    if isinstance(rule, list):
        return [(prefix + r[0], *r[1:]) for r in rule]
    return (prefix + rule[0], *rule[1:])
