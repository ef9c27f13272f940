"""Batched sampling: every row has its own settings, and one pass serves the whole batch.

Order as in vLLM: grammar masks (structured outputs), logit bias and banned tokens,
repetition/frequency/presence penalties, temperature, min-p, top-k, top-p, then a draw.
Rows with a seed draw their noise from their own generator, so their text does not depend
on what else is in the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingBatch:
    temperature: torch.Tensor  # [B] float, 0 = greedy
    top_p: torch.Tensor | None = None  # [B] float, None when no row filters
    top_k: torch.Tensor | None = None  # [B] long, vocab size = off
    min_p: torch.Tensor | None = None  # [B] float
    presence: torch.Tensor | None = None  # [B] float
    frequency: torch.Tensor | None = None  # [B] float
    repetition: torch.Tensor | None = None  # [B] float
    output_counts: torch.Tensor | None = None  # [B, V] generated-token counts
    seen: torch.Tensor | None = None  # [B, V] bool: token appears in prompt or output
    bias: torch.Tensor | None = None  # [B, V] float added to logits (-inf bans a token)
    generators: list | None = None  # [B] torch.Generator or None
    allowed: torch.Tensor | None = None  # [B, ceil(V/32)] int32: bit j of word i allows 32i+j
    allowed_rows: list[int] | None = None  # rows under a grammar (others of `allowed` unread)
    all_greedy: bool = False


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                        rows: list[int]) -> torch.Tensor:
    """A copy of logits with -inf for every token row r's packed bitmask (bitmask[r]) leaves
    out, for r in rows; other rows untouched.

    xgrammar's kernel (C++ on CPU, CUDA/Triton on GPU): a single pass, where the equivalent
    torch ops (unpack, masked_fill, index_put) cost 10-30x more on a busy 2-core machine.
    """
    from xgrammar import apply_token_bitmask_inplace

    out = logits.clone()  # callers keep the raw logits (log-probs are of the model's output)
    apply_token_bitmask_inplace(out, bitmask.to(out.device), indices=rows)
    return out


def apply_penalties(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    if b.allowed is not None:
        logits = apply_token_bitmask(logits, b.allowed, b.allowed_rows)
    if b.bias is not None:
        logits = logits + b.bias
    if b.repetition is not None:
        p = b.repetition[:, None]
        penalised = torch.where(logits > 0, logits / p, logits * p)
        logits = torch.where(b.seen, penalised, logits)
    if b.frequency is not None:
        logits = logits - b.frequency[:, None] * b.output_counts
    if b.presence is not None:
        logits = logits - b.presence[:, None] * (b.output_counts > 0).to(logits.dtype)
    return logits


def sample(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """logits: [B, V] float32 (raw model output) -> token ids [B]."""
    logits = apply_penalties(logits, b)
    greedy = logits.argmax(dim=-1)
    if b.all_greedy:
        return greedy
    temperature = torch.where(b.temperature > 0, b.temperature, torch.ones_like(b.temperature))
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    probs = _filter(probs, b)
    sampled = (probs / _exponential_noise(probs, b.generators)).argmax(dim=-1)
    return torch.where(b.temperature > 0, sampled, greedy)


def verify_drafts(logits: torch.Tensor, b: SamplingBatch, drafts: torch.Tensor):
    """Speculative decoding's verification. logits: [N, V], one row per position of the rows
    under verification; drafts: [N] the token proposed for each position (-1: none, the
    position after a row's last draft). Returns (tokens [N], accepted [N] bool): a position's
    draft is accepted (greedy: it is the argmax; sampled: with probability p(draft), the draft
    distribution being a point mass), and `tokens` holds what the position emits if its draft
    is rejected or it has none: a draw from p with the draft taken out (renormalised), which
    makes the emitted tokens exactly distributed as p (Leviathan et al.'s rejection sampling).
    """
    logits = apply_penalties(logits, b)
    greedy = logits.argmax(dim=-1)
    proposed = drafts >= 0
    if b.all_greedy:
        return greedy, proposed & (greedy == drafts)
    temperature = torch.where(b.temperature > 0, b.temperature, torch.ones_like(b.temperature))
    probs = _filter(torch.softmax(logits / temperature[:, None], dim=-1), b)
    index = drafts.clamp(min=0)[:, None]
    p_draft = probs.gather(-1, index).squeeze(-1) / probs.sum(dim=-1)
    u = _uniform(p_draft, b.generators)
    accepted = proposed & torch.where(b.temperature > 0, u < p_draft, greedy == drafts)
    kept = probs.gather(-1, index) * ~proposed[:, None]  # the draft's column: 0 where proposed
    residual = probs.scatter(-1, index, kept)
    # (all of p on the draft: it is accepted whatever the draw; keep the residual drawable)
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, probs)
    sampled = (residual / _exponential_noise(residual, b.generators)).argmax(dim=-1)
    return torch.where(b.temperature > 0, sampled, greedy), accepted


def _uniform(like: torch.Tensor, generators) -> torch.Tensor:
    """U[0, 1) per row, from the row's own generator where it has one."""
    u = torch.rand_like(like)
    for row, gen in enumerate(generators or []):
        if gen is not None:
            u[row] = torch.rand((), generator=gen, device=like.device)
    return u


def _filter(probs: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    if b.min_p is not None:
        floor = b.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
    if b.top_k is None and b.top_p is None:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    drop = torch.zeros_like(sorted_probs, dtype=torch.bool)
    if b.top_k is not None:
        ranks = torch.arange(probs.shape[-1], device=probs.device)
        drop |= ranks[None, :] >= b.top_k[:, None]
    if b.top_p is not None:
        kept = sorted_probs.masked_fill(drop, 0.0)
        before = kept.cumsum(dim=-1) - kept  # mass strictly above each token
        drop |= before >= b.top_p[:, None] * kept.sum(dim=-1, keepdim=True)
    drop[:, 0] = False  # always keep the most likely token
    return probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))


def _exponential_noise(probs: torch.Tensor, generators) -> torch.Tensor:
    """Exp(1) noise: argmax(p / q) draws from p (the Gumbel-max trick in another form)."""
    q = torch.empty_like(probs).exponential_()
    for row, gen in enumerate(generators or []):
        if gen is not None:
            q[row].exponential_(generator=gen)
    return q


def token_logprobs(logits: torch.Tensor, chosen: torch.Tensor, k: int):
    """Raw model log-probs: of each chosen token [B], and the top-k [B, k] (ids, values)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen_lp = logprobs.gather(-1, chosen[:, None]).squeeze(-1)
    if k == 0:
        return chosen_lp, None, None
    top_lp, top_ids = logprobs.topk(k, dim=-1)
    return chosen_lp, top_ids, top_lp
