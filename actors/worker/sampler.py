"""Rank 0's sampling: every sampling row of a step in one batched pass, and log-probs.

Each scheduled sequence reads its logits through the slice the scheduler gave it
(ScheduledSeq.logits). The per-row settings (temperature, top-p/k, min-p, penalties, logit
bias and min_tokens bans, grammar bitmasks, seeded generators) become one SamplingBatch
(kernels/sampling.py); the chosen tokens are read off the device once per step. With
`defer` (async scheduling) that read is left to the engine (RunnerOutput.resolve), which
processes the previous step's outputs while this step's GPU work runs; nothing here waits for
the GPU before then (host lists reach the device through pinned memory).
"""
from __future__ import annotations

import torch

from actors.core.step import RunnerOutput, ScheduledSeq
from actors.core.structured import bitmask_width, fill_bitmask_after
from actors.distributed.pipeline import take_rows
from kernels.host_copies import to_device
from kernels.sampling import SamplingBatch, sample, token_logprobs, verify_drafts


class Sampler:
    def __init__(self, vocab_size: int, max_rows: int, eos_ids: frozenset[int], device: torch.device,
                 defer: bool = False):
        self.eos_ids, self.device, self.defer = eos_ids, device, defer
        # Grammar masks of one step's constrained rows, filled in place (nothing grows per step).
        self.bitmask = torch.zeros(max_rows, bitmask_width(vocab_size), dtype=torch.int32)

    def __call__(self, seqs: list[ScheduledSeq], logits: torch.Tensor | None) -> RunnerOutput:
        """Each scheduled sequence's token (and log-probs where asked) from its logits."""
        n = len(seqs)
        out = RunnerOutput([None] * n, [None] * n, [None] * n)
        for i, s in enumerate(seqs):
            if s.prompt_logprobs:
                out.prompt_logprobs[i] = self._prompt_logprobs(s, logits[s.logits])
        verifying = [i for i, s in enumerate(seqs) if s.draft]
        if verifying:
            self._verify(seqs, verifying, logits, out)
        sampling = [i for i, s in enumerate(seqs) if s.samples and not s.draft]
        if not sampling:
            return out
        samples = [seqs[i].seq for i in sampling]
        last = take_rows(logits, [seqs[i].logits.stop - 1 for i in sampling])
        chosen = sample(last, self._sampling_batch(samples, last.shape[-1]))
        out.sampled = (chosen, [sq.seq_id for sq in samples])
        if self.defer and all(sq.params.logprobs is None for sq in samples):
            out.on_device = (*_copy_to_host(chosen), sampling)
            return out
        if any(sq.params.logprobs is not None for sq in samples):
            k = max((sq.params.logprobs or 0) for sq in samples)
            lp, top = _logprob_lists(*token_logprobs(last, chosen, k))
        tokens = chosen.tolist()  # one device read, not one per row (a sync each on a GPU)
        for row, (i, sq) in enumerate(zip(sampling, samples)):
            out.tokens[i] = tokens[row]
            if sq.params.logprobs is not None:
                out.logprobs[i] = _lp_dict(tokens[row], lp[row], top[row], sq.params.logprobs)
        return out

    def _verify(self, seqs: list[ScheduledSeq], rows: list[int], logits: torch.Tensor,
                out: RunnerOutput) -> None:
        """Rows with drafts: every position's logits verify its draft (kernels/sampling.py
        verify_drafts); each row emits its accepted drafts and the token after them."""
        positions = [p for i in rows for p in range(seqs[i].logits.start, seqs[i].logits.stop)]
        samples = [seqs[i].seq for i in rows for _ in range(seqs[i].num_tokens)]
        drafts = [t for i in rows for t in seqs[i].draft + [-1]]
        scores = take_rows(logits, positions)
        drafted = upload(drafts, torch.int64, self.device)
        # (a position under a grammar follows the row's drafts before it)
        before = [seqs[i].draft[:j] for i in rows for j in range(seqs[i].num_tokens)]
        chosen, accepted = verify_drafts(scores, self._sampling_batch(samples, scores.shape[-1], before), drafted)
        emitted = torch.where(accepted, drafted, chosen)  # each position's token if it is reached
        k = max((sq.params.logprobs for sq in samples if sq.params.logprobs is not None), default=None)
        if k is not None:
            lp, top = _logprob_lists(*token_logprobs(scores, emitted, k))
        emitted, accepted = emitted.tolist(), accepted.tolist()  # the step's one device read
        first = 0
        for i in rows:
            n = seqs[i].num_tokens
            taken = next((j for j in range(n) if not accepted[first + j]), n - 1) + 1
            out.tokens[i] = emitted[first:first + taken]
            want = seqs[i].seq.params.logprobs
            if want is not None:
                out.logprobs[i] = [_lp_dict(emitted[p], lp[p], top[p], want)
                                   for p in range(first, first + taken)]
            first += n

    def _prompt_logprobs(self, s: ScheduledSeq, logits: torch.Tensor) -> list:
        """Log-probs of the prompt tokens this chunk predicts (position p predicts token p+1)."""
        seq, k = s.seq, s.seq.params.prompt_logprobs
        targets = [seq.token_ids[p + 1] for p in range(s.start, s.start + s.num_tokens)
                   if p + 1 < seq.num_prompt_tokens]
        if not targets:
            return []
        rows = logits[:len(targets)]
        lp, top = _logprob_lists(*token_logprobs(rows, torch.tensor(targets, device=rows.device), k))
        return [_lp_dict(t, lp[r], top[r], k) for r, t in enumerate(targets)]

    def _sampling_batch(self, seqs, vocab: int, before: list[list[int]] | None = None) -> SamplingBatch:
        """before: (verification) the drafts each row's position follows, which its grammar
        state, penalties and min_tokens count as the row's output."""
        params = [s.params for s in seqs]
        dev = self.device
        f = lambda xs: upload(xs, torch.float32, dev)  # noqa: E731
        b = SamplingBatch(temperature=f([p.temperature for p in params]),
                          all_greedy=all(p.temperature == 0 for p in params))
        b.generators = [s.generator for s in seqs] if any(s.generator for s in seqs) else None
        if any(p.top_p < 1 for p in params):
            b.top_p = f([p.top_p for p in params])
        if any(p.top_k > 0 for p in params):
            # (a top_k past the vocabulary keeps every token, and must not overflow int64)
            b.top_k = upload([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], torch.int64, dev)
        if any(p.min_p > 0 for p in params):
            b.min_p = f([p.min_p for p in params])
        before = before or [[]] * len(seqs)
        self._penalties(b, seqs, vocab, before)
        b.bias = self._bias(seqs, vocab, before)
        self._grammar_masks(b, seqs, before)
        return b

    def _grammar_masks(self, b: SamplingBatch, seqs, before: list[list[int]]) -> None:
        """Allowed-token bitmasks for the rows under a grammar; other rows stay free."""
        rows = [row for row, s in enumerate(seqs) if s.matcher is not None]
        if not rows:
            return
        if len(seqs) > len(self.bitmask):  # a verification's positions (kept for the next)
            self.bitmask = torch.zeros(len(seqs), self.bitmask.shape[1], dtype=torch.int32)
        masks = self.bitmask[:len(seqs)]  # row r for batch row r; free rows are never read
        for row in rows:
            fill_bitmask_after(seqs[row].matcher, before[row], masks, row)
        b.allowed, b.allowed_rows = masks, rows

    def _penalties(self, b: SamplingBatch, seqs, vocab: int, before: list[list[int]]) -> None:
        params = [s.params for s in seqs]
        dev = self.device
        if any(p.presence_penalty or p.frequency_penalty for p in params):
            counts = torch.zeros(len(seqs), vocab, device=dev)
            for row, s in enumerate(seqs):
                out = s.output_token_ids + before[row]
                if out:
                    counts[row].index_add_(0, upload(out, torch.int64, dev), torch.ones(len(out), device=dev))
            b.output_counts = counts
            b.presence = upload([p.presence_penalty for p in params], torch.float32, dev)
            b.frequency = upload([p.frequency_penalty for p in params], torch.float32, dev)
        if any(p.repetition_penalty != 1.0 for p in params):
            seen = torch.zeros(len(seqs), vocab, dtype=torch.bool, device=dev)
            for row, s in enumerate(seqs):
                seen[row, upload(s.token_ids + before[row], torch.int64, dev)] = True
            b.seen = seen
            b.repetition = upload([p.repetition_penalty for p in params], torch.float32, dev)

    def _bias(self, seqs, vocab: int, before: list[list[int]]) -> torch.Tensor | None:
        """Logit bias and min_tokens bans, as one additive [B, V] tensor."""
        rows = [(row, s) for row, s in enumerate(seqs)
                if s.params.logit_bias or s.num_output_tokens + len(before[row]) < s.params.min_tokens]
        if not rows:
            return None
        bias = torch.zeros(len(seqs), vocab, device=self.device)
        for row, s in rows:
            p = s.params
            for tok, value in (p.logit_bias or {}).items():
                if 0 <= int(tok) < vocab:
                    bias[row, int(tok)] += float(value)
            # A grammar decides alone when its output ends (banning its only allowed token,
            # the stop token, would leave nothing to sample).
            if s.num_output_tokens + len(before[row]) < p.min_tokens and s.matcher is None:
                banned = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_ids)
                bias[row, upload([t for t in banned if 0 <= t < vocab], torch.int64, self.device)] = float("-inf")
        return bias


def upload(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on `device` without waiting for the step's forward."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def _copy_to_host(chosen: torch.Tensor) -> tuple[torch.Tensor, object]:
    """(host tensor, CUDA event): the copy starts now, behind the sampling; it is complete
    once the event is (None on CPU: already)."""
    if chosen.device.type != "cuda":
        return chosen, None
    host = chosen.to("cpu", non_blocking=True)  # into pinned memory
    done = torch.cuda.Event()
    done.record()
    return host, done


def _logprob_lists(chosen_lp: torch.Tensor, top_ids: torch.Tensor | None, top_lp: torch.Tensor | None):
    """token_logprobs' tensors as Python lists, read off the device once: [B] floats and, per
    row, the top-k (id, log-prob) pairs."""
    lp = chosen_lp.tolist()
    if top_ids is None:
        return lp, [()] * len(lp)
    return lp, [list(zip(ids, lps)) for ids, lps in zip(top_ids.tolist(), top_lp.tolist())]


def _lp_dict(chosen: int, chosen_lp: float, top: list[tuple[int, float]], k: int) -> dict:
    d = {chosen: chosen_lp}
    for token, value in top[:k]:
        d.setdefault(token, value)
    return d
