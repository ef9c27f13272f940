"""The batched sampler (kernels/sampling.py) against an exact definition of each setting's
distribution, on an 8-token vocabulary.

The reference below is written out in float64 from the settings' definitions (vLLM's order:
logit bias, repetition / frequency / presence penalties, temperature, min-p, top-k, top-p; each
filter renormalises what it keeps). Every setting gets 8,000 draws from rows interleaved with
every other setting in one batch, so a row's distribution must not depend on its neighbours.
The bound: Pearson's chi-square at a 1e-3 false-failure rate (draws are seeded, so the test is
deterministic); tokens the definition gives no mass must never be drawn.
"""
from __future__ import annotations

import math

import pytest
import torch

from kernels.sampling import SamplingBatch, sample, verify_drafts

V = 8
LOGITS = torch.tensor([2.0, 1.6, 1.1, 0.7, 0.2, -0.3, -0.9, -1.5], dtype=torch.float64)
COUNTS = torch.tensor([0, 3, 0, 1, 0, 0, 2, 0], dtype=torch.float64)  # tokens generated so far
SEEN = torch.tensor([1, 1, 0, 1, 0, 1, 1, 0], dtype=torch.bool)  # in the prompt or the output
DRAWS = 8000
# Pearson's chi-square at 1 - 1e-3 by degrees of freedom
CHI2_CRITICAL = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}

SETTINGS = {
    "temperature 1": dict(),
    "temperature 0.5": dict(temperature=0.5),
    "temperature 2, top-k 3": dict(temperature=2.0, top_k=3),
    "top-p 0.7": dict(top_p=0.7),
    "min-p 0.2": dict(min_p=0.2),
    "temperature 0.7, top-k 4, top-p 0.8": dict(temperature=0.7, top_k=4, top_p=0.8),
    "penalties": dict(repetition=1.3, frequency=0.5, presence=0.8),
    "logit bias (one raised, the top banned)": dict(bias={5: 3.0, 0: -math.inf}),
    "everything": dict(bias={7: 2.5}, repetition=1.2, frequency=0.3, presence=0.4, temperature=1.4,
                       min_p=0.05, top_k=6, top_p=0.9),
}


def reference(s: dict) -> torch.Tensor:
    """The setting's distribution over the vocabulary, from the definitions (float64)."""
    x = LOGITS.clone()
    for token, value in s.get("bias", {}).items():
        x[token] += value
    r = s.get("repetition", 1.0)
    x = torch.where(SEEN, torch.where(x > 0, x / r, x * r), x)
    x = x - s.get("frequency", 0.0) * COUNTS - s.get("presence", 0.0) * (COUNTS > 0)
    p = torch.softmax(x / s.get("temperature", 1.0), dim=0)
    if "min_p" in s:
        p = torch.where(p >= s["min_p"] * p.max(), p, 0.0)
        p = p / p.sum()
    order = torch.argsort(p, descending=True)
    if "top_k" in s:
        p[order[s["top_k"]:]] = 0.0
        p = p / p.sum()
    if "top_p" in s:  # the most likely tokens until their mass reaches top_p (the one crossing it kept)
        above = torch.cumsum(p[order], 0) - p[order]
        p[order[above >= s["top_p"]]] = 0.0
        p = p / p.sum()
    return p


def pooled(observed: torch.Tensor, expected: torch.Tensor):
    """Bins expected fewer than 5 times pooled into one (into the smallest other bin if the
    pool is still under 5), as the chi-square approximation needs."""
    small = expected < 5
    if not small.any():
        return observed, expected
    o, e = observed[~small], expected[~small]
    po, pe = observed[small].sum(), expected[small].sum()
    if pe >= 5:
        return torch.cat([o, po[None]]), torch.cat([e, pe[None]])
    i = int(e.argmin())
    o, e = o.clone(), e.clone()
    o[i] += po
    e[i] += pe
    return o, e


def batch_of(rows: list[dict], generators=None) -> SamplingBatch:
    """The SamplingBatch the runner's sampler builds for these rows' settings."""
    n = len(rows)
    col = lambda key, default, dtype=torch.float32: torch.tensor([r.get(key, default) for r in rows], dtype=dtype)  # noqa: E731
    bias = torch.zeros(n, V)
    for i, r in enumerate(rows):
        for token, value in r.get("bias", {}).items():
            bias[i, token] = value
    return SamplingBatch(
        temperature=col("temperature", 1.0), top_p=col("top_p", 1.0), top_k=col("top_k", V, torch.long),
        min_p=col("min_p", 0.0), presence=col("presence", 0.0), frequency=col("frequency", 0.0),
        repetition=col("repetition", 1.0), output_counts=COUNTS.float().expand(n, V).clone(),
        seen=SEEN.expand(n, V).clone(), bias=bias, generators=generators)


def test_each_setting_draws_its_distribution_whatever_its_neighbours():
    names = list(SETTINGS)
    rows = [SETTINGS[names[i % len(names)]] for i in range(DRAWS * len(names))]
    torch.manual_seed(0)
    drawn = sample(LOGITS.float().expand(len(rows), V).clone(), batch_of(rows))
    for k, name in enumerate(names):
        counts = torch.bincount(drawn[k::len(names)], minlength=V).double()
        want = reference(SETTINGS[name])
        assert counts.sum() == DRAWS
        assert (counts[want == 0] == 0).all(), (name, counts, want)  # no mass: never drawn
        observed, expected = pooled(counts[want > 0], want[want > 0] * DRAWS)
        chi2 = float(((observed - expected) ** 2 / expected).sum())
        df = len(expected) - 1
        assert df == 0 or chi2 < CHI2_CRITICAL[df], (name, chi2, df, (counts / DRAWS).tolist(), want.tolist())


def test_the_reference_itself_is_not_trivial():
    """The settings give distributions that differ from each other (a sampler that ignored any
    one setting would fail the bound above)."""
    dists = {name: reference(s) for name, s in SETTINGS.items()}
    for a in dists:
        for b in dists:
            if a < b:
                assert (dists[a] - dists[b]).abs().sum() > 0.05, (a, b)
    assert (dists["logit bias (one raised, the top banned)"][0] == 0) and (dists["top-p 0.7"] == 0).sum() >= 4


@pytest.mark.parametrize("setting", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)],
                         ids=["top_k=1", "top_p~0", "min_p=1"])
def test_settings_that_leave_one_token_equal_greedy(setting):
    torch.manual_seed(1)
    logits = torch.randn(400, 50) * 3
    b = batch_of([dict(setting, temperature=1.3)] * 400)
    b.output_counts = b.seen = b.bias = b.repetition = b.presence = b.frequency = None  # plain rows
    assert torch.equal(sample(logits, b), logits.argmax(dim=-1))


def test_a_seeded_row_draws_the_same_tokens_in_any_batch():
    def draws(rows_before: int) -> list[int]:
        out = []
        gen = torch.Generator().manual_seed(1234)
        for _ in range(50):
            rows = [dict(temperature=1.5)] * (rows_before + 1)
            gens = [None] * rows_before + [gen]
            out.append(int(sample(LOGITS.float().expand(len(rows), V).clone(), batch_of(rows, gens))[-1]))
        return out

    torch.manual_seed(5)
    alone = draws(0)
    torch.manual_seed(6)
    assert draws(7) == alone  # other rows (unseeded, other noise) around it change nothing
    assert len(set(alone)) > 2  # and it does sample


@pytest.mark.parametrize("draft", [0, 2, 5, 7, -1], ids=["likely", "middling", "unlikely", "least", "none"])
def test_verifying_a_draft_emits_each_settings_distribution(draft):
    """Speculative decoding's rejection sampling (kernels/sampling.py verify_drafts): what a
    position emits -- its draft where accepted, else the draw from the rest -- follows the
    setting's distribution whatever the draft (also one the setting gives no mass, and none)."""
    names = list(SETTINGS)
    rows = [SETTINGS[names[i % len(names)]] for i in range(DRAWS * len(names))]
    torch.manual_seed(2)
    drafts = torch.full((len(rows),), draft)
    tokens, accepted = verify_drafts(LOGITS.float().expand(len(rows), V).clone(), batch_of(rows), drafts)
    emitted = torch.where(accepted, drafts, tokens)
    assert draft >= 0 or not accepted.any()
    for k, name in enumerate(names):
        counts = torch.bincount(emitted[k::len(names)], minlength=V).double()
        want = reference(SETTINGS[name])
        assert (counts[want == 0] == 0).all(), (name, counts, want)
        observed, expected = pooled(counts[want > 0], want[want > 0] * DRAWS)
        chi2 = float(((observed - expected) ** 2 / expected).sum())
        df = len(expected) - 1
        assert df == 0 or chi2 < CHI2_CRITICAL[df], (name, chi2, df, (counts / DRAWS).tolist(), want.tolist())
        if draft >= 0:  # accepted as often as the setting gives the draft
            rate = float(accepted[k::len(names)].double().mean())
            assert rate == pytest.approx(float(want[draft]), abs=4 * math.sqrt(0.25 / DRAWS) + 1e-9)


def test_verifying_greedy_rows_accepts_exactly_the_argmax():
    torch.manual_seed(3)
    logits = torch.randn(64, 50)
    drafts = torch.where(torch.rand(64) < 0.5, logits.argmax(-1), torch.randint(0, 50, (64,)))
    drafts[::7] = -1
    tokens, accepted = verify_drafts(logits, SamplingBatch(temperature=torch.zeros(64), all_greedy=True), drafts)
    assert torch.equal(tokens, logits.argmax(-1))
    assert torch.equal(accepted, (drafts == logits.argmax(-1)) & (drafts >= 0))
