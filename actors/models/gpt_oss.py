"""OpenAI's gpt-oss (`GptOssForCausalLM`): the Llama block with

- attention sinks: a learned logit per head in each softmax's denominator (`self_attn.sinks`,
  held by actors/models/llama.py's Attention, computed by every backend in kernels/attention.py
  but flash);
- sliding and full layers alternating (`layer_types`), q/k/v/o biases, YaRN rotary;
- a mixture of experts in every layer: a router with a bias whose top-k logits are softmaxed,
  and experts with biases and a clamped SwiGLU (kernels/swiglu_moe.py; on the Triton
  backend kernels/triton_moe.py).

The checkpoint stacks each layer's experts in one tensor per projection, as transformers lays
them out for `x @ W`: `experts.gate_up_proj` [E, H, 2I] with gate and up in alternate columns,
`experts.down_proj` [E, I, H], and their biases [E, 2I] / [E, H]. The loader takes each
expert's part (and this rank's slice of its width) and transposes it into the layout of
actors/models/moe.py: gate_up_proj [slots, 2I, H] (gate rows, then up rows), down_proj
[slots, H, I]. MXFP4 checkpoints (`*_blocks` / `*_scales`) arrive dequantised
(actors/worker/mxfp4_checkpoint.py).
"""
from __future__ import annotations

import re

import torch
from torch import nn

from actors.distributed.parallel import Parallel
from actors.models.args import ModelArgs
from actors.models.moe import MoeForCausalLM, SparseMoeBlock, stacked_down
from kernels import swiglu_moe, triton_moe


class GptOssExperts(nn.Module):
    """This rank's expert slots, stacked, with their biases."""

    def __init__(self, slots: int, hidden: int, width: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(slots, 2 * width, hidden))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(slots, 2 * width))
        self.down_proj = nn.Parameter(torch.empty(slots, hidden, width))
        self.down_proj_bias = nn.Parameter(torch.empty(slots, hidden))


class GptOssMoeBlock(SparseMoeBlock):
    """SparseMoeBlock's placement, expert parallelism and load recording, with gpt-oss's router
    and experts."""

    def __init__(self, a: ModelArgs, p: Parallel):
        super().__init__(a, p)
        del self.gate  # the router has a bias, and the checkpoint's name
        self.router = nn.Linear(a.hidden_size, a.moe.num_experts, bias=True)
        self.experts = GptOssExperts(self.slots_per_rank, a.hidden_size, self.width)
        self.alpha, self.limit = a.moe.swiglu
        # Each rank's output is a partial sum: with experts split by width, one rank adds the
        # down bias; with whole experts (EP) each assignment is computed on one rank only.
        self.adds_down_bias = p.expert_parallel or p.tp_rank == 0

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """fused (steps of the Triton backend): the experts through kernels/triton_moe.py, which
        never waits for the GPU, so a decode step can be a CUDA graph."""
        weights, ids = swiglu_moe.route_top_logits(self.router(x), self.top_k)
        if self.load is not None:
            self._record(ids)
        e, local = self.experts, self._local_ids(ids)
        down_bias = e.down_proj_bias if self.adds_down_bias else None
        if fused:
            y = triton_moe.grouped_experts(x, weights, local, e.gate_up_proj, e.down_proj, e.gate_up_proj_bias,
                                           down_bias, (self.alpha, self.limit))
        else:
            y = swiglu_moe.grouped_experts(x, weights, local, e.gate_up_proj, e.gate_up_proj_bias, e.down_proj,
                                           down_bias, self.alpha, self.limit)
        return self.p.all_reduce(y)

    def weight_rule(self, rest: str, placement: list[int] | None = None, only: set[int] | None = None):
        """Rules (see LlamaForCausalLM.weight_rule) for a checkpoint tensor under this block: a
        stacked expert tensor gives one rule per local slot, whose `dim` is a function that takes
        that expert's part of the tensor, in our layout."""
        m = re.match(r"experts\.(gate_up_proj|down_proj)(_bias)?$", rest)
        if m:
            start = 0 if self.p.expert_parallel else self.p.tp_rank * self.width
            part = EXPERT_PARTS[m.group(0)[len("experts."):]]
            rules = [(rest, 0, part(expert, start, self.width), 0, 0, slot)
                     for slot, expert in enumerate(self.local_slots(placement)) if only is None or slot in only]
            return rules or None
        if only is not None:
            return None
        return (rest, 0, None, 0, 0)  # the router: whole on every rank


def _gate_up(expert: int, start: int, width: int):
    """[E, H, 2I] with gate j in column 2j and up j in 2j + 1 -> this expert's [2 * width, H]:
    gate rows start.., then up rows start.."""
    def take(t):
        cols = t[expert:expert + 1, :, 2 * start:2 * (start + width)][0]
        return torch.cat((cols[:, 0::2], cols[:, 1::2]), 1).t()
    return take


def _gate_up_bias(expert: int, start: int, width: int):
    def take(t):
        b = t[expert:expert + 1, 2 * start:2 * (start + width)][0]
        return torch.cat((b[0::2], b[1::2]))
    return take


def _down_bias(expert: int, start: int, width: int):
    return lambda t: t[expert:expert + 1][0]  # whole: added once (GptOssMoeBlock.adds_down_bias)


EXPERT_PARTS = {"gate_up_proj": _gate_up, "gate_up_proj_bias": _gate_up_bias,
                "down_proj": stacked_down, "down_proj_bias": _down_bias}


class GptOssForCausalLM(MoeForCausalLM):
    def make_mlp(self, layer: int) -> nn.Module:
        return GptOssMoeBlock(self.args, self.p)
