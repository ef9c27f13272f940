"""Nemotron-H (Nemotron Nano 2, Nemotron 3): layers of one norm and one mixer each, Mamba-2
(actors/models/mamba.py), attention without rotary, a squared-ReLU MLP, or (Nemotron 3) an MoE of
squared-ReLU experts routed as DeepSeek-V3 routes, as layers_block_type lays them out; Mamba and
FalconMamba, whose every layer is a Mamba(-1) mixer. Their checkpoints' backbone.* names read as the
usual layout's."""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from actors.distributed.parallel import Parallel
from actors.models.args import ModelArgs
from actors.models.hybrid import HybridForCausalLM
from actors.models.llama import Attention, LlamaForCausalLM, PlainMLP
from actors.models.mamba import Mamba1Mixer, Mamba2Mixer, mamba1_rule, mamba_rule
from actors.models.moe import Router
from kernels.activation import plain_activation
from kernels.moe import grouped, route_grouped
from kernels.norms import RMSNorm


class NoMixer(nn.Module):
    """A Nemotron-H MLP layer's place for a mixer: it has neither K/V nor a state."""
    caches_kv = False
    nope = local_rope = scales_q = False


class NemotronMoe(nn.Module):
    """Nemotron 3's MoE: DeepSeek-V3's routing (sigmoid scores, a bias on the choice, groups),
    ungated squared-ReLU experts reading (with moe_latent_size) a projection of the hidden state,
    and a shared expert. Each rank holds a share of every expert's width and of the shared one's;
    their partial sums meet in one all-reduce."""

    def __init__(self, a: ModelArgs, p: Parallel):
        super().__init__()
        m, t = a.moe, p.tp_size
        if m.intermediate_size % t or m.shared_intermediate_size % t:
            raise ValueError(f"tensor parallel size {t} must divide the expert width ({m.intermediate_size}) and "
                             f"the shared expert's ({m.shared_intermediate_size})")
        self.m, self.p, self.act = m, p, plain_activation(a.activation)
        width, dim = m.intermediate_size // t, m.latent_size or a.hidden_size
        self.gate = Router(a.hidden_size, m.num_experts, score_bias=True)
        self.experts = nn.Module()
        self.experts.up_proj = nn.Parameter(torch.empty(m.num_experts, width, dim))
        self.experts.down_proj = nn.Parameter(torch.empty(m.num_experts, dim, width))
        self.shared_experts = nn.Module()
        self.shared_experts.up_proj = nn.Linear(a.hidden_size, m.shared_intermediate_size // t, bias=a.mlp_bias)
        if a.mlp_bias and t > 1:  # (each rank's down bias would be summed over the ranks)
            raise ValueError("Nemotron-H's MoE with MLP biases is not supported with tensor parallelism")
        self.shared_experts.down_proj = nn.Linear(m.shared_intermediate_size // t, a.hidden_size, bias=a.mlp_bias)
        if m.latent_size:
            self.fc1_latent_proj = nn.Linear(a.hidden_size, m.latent_size, bias=False)
            self.fc2_latent_proj = nn.Linear(m.latent_size, a.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m, r = self.m, self.m.routing
        logits = F.linear(x.float(), self.gate.weight.float())
        weights, ids = route_grouped(logits, m.top_k, m.renormalize, r.scoring, r.group_score, r.n_group,
                                     r.topk_group, self.gate.e_score_correction_bias, r.scale)
        up, down = self.experts.up_proj, self.experts.down_proj
        h = self.fc1_latent_proj(x) if m.latent_size else x
        y = grouped(h, weights, ids, up.shape[0], lambda e, xs: F.linear(self.act(F.linear(xs, up[e])), down[e]))
        y = self.fc2_latent_proj(y) if m.latent_size else y
        shared = self.shared_experts
        return self.p.all_reduce(y + shared.down_proj(self.act(shared.up_proj(x))))


class MixerBlock(nn.Module):
    """Nemotron-H's layer: x + mixer(norm(x)), the mixer Mamba-2, attention, an MLP or an MoE."""

    def __init__(self, a: ModelArgs, p: Parallel, layer: int):
        super().__init__()
        self.kind = a.mixer_blocks[layer]
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.mlp = PlainMLP(a, p) if self.kind == "mlp" else NemotronMoe(a, p) if self.kind == "moe" else None
        mixers = {"attention": lambda: Attention(a, p, layer), "mamba": lambda: Mamba2Mixer(a, p),
                  "mamba1": lambda: Mamba1Mixer(a, p)}
        self.self_attn = NoMixer() if self.mlp is not None else mixers[self.kind]()

    def forward(self, x, cos, sin, meta, q_scale=None):
        h = self.norm(x)
        return x + (self.mlp(h) if self.mlp is not None else self.self_attn(h, cos, sin, meta))


class NemotronHForCausalLM(HybridForCausalLM):
    """Nemotron-H: MixerBlocks; its checkpoint's backbone.* names read as the Llama layout's."""
    NAMES = (("backbone.embeddings.", "model.embed_tokens."), ("backbone.norm_f.", "model.norm."),
             ("backbone.layers.", "model.layers."))

    def make_layer(self, layer: int) -> nn.Module:
        return MixerBlock(self.args, self.p, layer)

    def moe_blocks(self) -> list:
        """(Its MoE layers keep no expert-load record: no SparseMoeBlock to re-plan.)"""
        return []

    def weight_rule(self, name: str):
        for theirs, ours in self.NAMES:
            if name.startswith(theirs):
                name = ours + name[len(theirs):]
                break
        return super().weight_rule(name)

    def _layer_rule(self, prefix: str, rest: str):
        if rest.startswith("norm."):
            return (prefix + rest, 0, None, 0, 0)
        block = self.model.layers[int(prefix.split(".")[2])]
        rest = rest.removeprefix("mixer.")
        if block.kind == "mamba":
            m = re.match(r"(\w+?)(?:\.(weight|bias))?$", rest)
            return mamba_rule(f"{prefix}self_attn.", *m.groups(), self.args.linear_attn, self.p)
        if block.kind == "mamba1":
            return mamba1_rule(f"{prefix}self_attn.", rest, self.args.linear_attn)
        if block.kind == "moe":
            return _nemotron_moe_rule(f"{prefix}mlp.", rest, block.mlp, self.p)
        return LlamaForCausalLM._layer_rule(self, prefix, ("mlp." if block.kind == "mlp" else "self_attn.") + rest)


def _nemotron_moe_rule(target: str, rest: str, moe: NemotronMoe, p: Parallel):
    """Nemotron 3's MoE tensors: the router and latent projections whole, this rank's share of
    each expert's width (stacked [E, I, dim] / [E, dim, I], or one tensor per expert) and of the
    shared expert's."""
    w, r = moe.experts.up_proj.shape[1], p.tp_rank
    m = re.match(r"experts\.(up_proj|down_proj)$", rest)
    if m:
        if m.group(1) == "up_proj":
            return (f"{target}{rest}", 0, lambda t: t[:, r * w:(r + 1) * w], 0, 0)
        return (f"{target}{rest}", 0, lambda t: t[:, :, r * w:(r + 1) * w], 0, 0)
    m = re.match(r"experts\.(\d+)\.(up_proj|down_proj)\.weight$", rest)
    if m:
        return (f"{target}experts.{m.group(2)}", 0, 0 if m.group(2) == "up_proj" else 1, r * w, w, int(m.group(1)))
    m = re.match(r"shared_experts\.(up_proj|down_proj)\.(weight|bias)$", rest)
    if m:
        ws = moe.shared_experts.down_proj.in_features
        if m.group(1) == "down_proj":
            return (f"{target}{rest}", 0, 1, r * ws, ws)
        return (f"{target}{rest}", 0, 0, r * ws, ws)
    return (target + rest, 0, None, 0, 0)  # gate.weight, gate.e_score_correction_bias, fc1 / fc2_latent_proj
