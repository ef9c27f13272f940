"""Mixture-of-experts compute: routing, replica choice, grouped expert FFNs. Pure torch.

A token's top-k choices are flattened into T*k assignments. Assignments are sorted by expert,
so each expert runs ONE matrix product over all of its tokens (fused gate/up, then down),
and the weighted results go back to their tokens with a single index_add. The only Python
loop is over experts.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool):
    """(weights [T, k] float32, expert ids [T, k]): softmax -> top-k -> optional renormalise.

    Softmax in float32 as transformers does for Mixtral and Qwen-MoE, so the choices match.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def route_grouped(router_logits: torch.Tensor, top_k: int, renormalize: bool, scoring: str,
                  group_score: str | None, n_group: int, topk_group: int, score_bias: torch.Tensor | None,
                  scale: float):
    """DeepSeek's routing, as transformers computes it: (weights [T, k] float32, expert ids [T, k]).

    Scores are the softmax (V2) or sigmoid (V3) of the float32 logits. With group_score, only the
    experts of each token's topk_group best groups stay eligible, a group scored by its best
    expert ("max", V2; the rest masked to 0) or the sum of its best two ("top2", V3; masked to
    -inf). V3 chooses by score + score_bias but weighs by the score alone. The weights are
    optionally renormalised, then multiplied by `scale`."""
    logits = router_logits.float()
    scores = torch.softmax(logits, -1) if scoring == "softmax" else logits.sigmoid()
    choice = scores if score_bias is None else scores + score_bias.float()
    if group_score is not None:
        grouped = choice.view(-1, n_group, choice.shape[-1] // n_group)
        best = grouped.max(-1).values if group_score == "max" else grouped.topk(2, -1).values.sum(-1)
        keep = torch.zeros_like(best).scatter_(1, best.topk(topk_group, -1).indices, 1.0).bool()
        keep = keep[:, :, None].expand_as(grouped).reshape_as(choice)
        choice = choice.masked_fill(~keep, 0.0 if group_score == "max" else float("-inf"))
    ids = choice.topk(top_k, -1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scale, ids


def route_sparsemixer(router_logits: torch.Tensor, jitter_eps: float):
    """PhiMoE's sparsemixer in eval mode, as transformers computes it, in the logits' dtype:
    (weights [T, 2], expert ids [T, 2]). The first expert is the top logit, weighted by its
    softmax over the logits within 2 * jitter_eps (relative) of it; the second is the top of the
    rest, weighted by its softmax over the rest within the same distance of it."""
    top, first = router_logits.max(-1, keepdim=True)
    near = (top - router_logits) / router_logits.abs().clamp(min=top) > 2 * jitter_eps
    w1 = torch.softmax(router_logits.masked_fill(near, float("-inf")), -1).gather(-1, first)
    rest = torch.scatter(router_logits, -1, first, float("-inf"))
    top2, second = rest.max(-1, keepdim=True)
    near = (top2 - router_logits) / router_logits.abs().clamp(min=top2) > 2 * jitter_eps
    w2 = torch.softmax(rest.masked_fill(near, float("-inf")), -1).gather(-1, second)
    return torch.cat((w1, w2), -1), torch.cat((first, second), -1)


def _rank_within_expert(flat: torch.Tensor, num_experts: int) -> torch.Tensor:
    """For each assignment, how many earlier assignments (in token order) chose the same expert."""
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(flat)
    rank[order] = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    return rank


def spread_over_replicas(ids: torch.Tensor, replica_slots: torch.Tensor,
                         replica_counts: torch.Tensor) -> torch.Tensor:
    """Logical expert ids [T, k] -> physical slots [T, k].

    replica_slots [E, R] lists each expert's physical slots (padded), replica_counts [E] how
    many it has. The j-th assignment of expert e, in token order, goes to replica j mod n_e:
    an even split that every rank computes identically from the same ids.
    """
    flat = ids.flatten()
    replica = _rank_within_expert(flat, replica_counts.numel()) % replica_counts[flat]
    return replica_slots[flat, replica].view_as(ids)


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, local_ids: torch.Tensor,
                    gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """sum_k weights[t, k] * FFN_{local_ids[t, k]}(x[t]), over the experts held here.

    x [T, H]; weights, local_ids [T, k] (local_ids < 0: an expert held elsewhere, skipped);
    gate_up [L, 2I, H] (gate rows then up rows); down [L, H, I]. Returns [T, H].
    """
    def ffn(e: int, xs: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(xs, gate_up[e]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, down[e])
    return grouped(x, weights, local_ids, gate_up.shape[0], ffn)


def grouped(x: torch.Tensor, weights: torch.Tensor, local_ids: torch.Tensor, slots: int, ffn) -> torch.Tensor:
    """sum_k weights[t, k] * ffn(local_ids[t, k], x[t]) over this rank's `slots` experts:
    ffn(e, rows) runs expert e on all of its rows at once."""
    k = local_ids.shape[1]
    flat = local_ids.flatten()
    keep = (flat >= 0).nonzero().squeeze(1)
    experts = flat[keep]
    rows = keep[torch.argsort(experts, stable=True)]  # assignments grouped by expert
    tokens = torch.div(rows, k, rounding_mode="floor")
    counts = torch.bincount(experts, minlength=slots).tolist()
    xs = x[tokens]
    ys = torch.empty_like(xs)
    start = 0
    for e, n in enumerate(counts):
        if n:
            ys[start:start + n] = ffn(e, xs[start:start + n])
            start += n
    ys *= weights.flatten()[rows, None].to(ys.dtype)
    return torch.zeros_like(x).index_add_(0, tokens, ys)
