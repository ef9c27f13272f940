"""Speculative decoding (n-gram prompt lookup and a draft model): greedy output is
transformers' token for token with drafts verified several at a time, sampled output keeps the
model's distribution, and the features a request combines (stop strings, max_tokens,
logprobs, n > 1, chunked prefill, prefix caching, preemption) behave as without speculation.
The draft model is the bundled model without its third layer (tests/checkpoints.py
draft_copy): it shares the tokenizer and agrees with the model about half the time. The
rejection sampler's own distribution test is in tests/test_sampling_distributions.py."""
from __future__ import annotations

import re

from types import SimpleNamespace

import pytest
import regex  # (transformers' dependency) partial matches: a prefix of a match
import torch
from checkpoints import draft_copy
from oracle import hf_greedy, hf_logits
from test_sampling_distributions import CHI2_CRITICAL, pooled
from test_engine import assert_pool_free

from actors.config import EngineConfig, SpeculativeConfig
from actors.core.speculation import RecentOutputs, Speculator, ngram_proposal
from actors.engine.llm import LLM
from actors.engine.metrics import DecodeProgress
from actors.sampling_params import SamplingParams, StructuredOutput
from actors.worker.checkpoint_files import resolve_model_path

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
         "disable_by_batch_size": 64}
# A small pool and token budget: prompts arrive in chunks and long requests preempt each other.
POOL = dict(num_kv_blocks=48, block_size=4, max_num_batched_tokens=24, dtype="float32")


DEMO = str(resolve_model_path(None))  # the bundled model, trained to quote: it copies its prompts
COPY_TEXTS = ["Repeat after me: the quick brown fox jumps over the lazy dog. the quick brown fox",
              "Quote the line exactly: 'All happy families are alike; each unhappy family is unhappy in its own way.'",
              "a b c d e f g a b c d e f g a b c",
              "The list is: apples, pears, plums, apples, pears, plums, apples,",
              "def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
              "Say it twice: we meet at noon by the old mill. We meet at noon"]


DRAFT_LAYERS = [0, 1, 3, 4]  # the bundled model's five but one


def demo_draft(folder) -> dict:
    """A speculative_config with the bundled model's draft (written under `folder`)."""
    path = draft_copy(DEMO, folder / "demo-draft", DRAFT_LAYERS)
    return {"model": str(path), "num_speculative_tokens": 3, "disable_by_batch_size": 64}


@pytest.fixture(scope="module")
def draft_config(tmp_path_factory):
    return demo_draft(tmp_path_factory.mktemp("draft"))


@pytest.fixture(scope="module", params=["ngram", "draft_model"])
def engines(request, draft_config):
    """(with drafts, without): the bundled model and the same pool."""
    spec = LLM(DEMO, speculative_config=NGRAM if request.param == "ngram" else draft_config, **POOL)
    # These tests check what drafts do, not whether they pay here (the bundled model's draft
    # does not, and the cost rule would pause it for up to 1,024 steps, depending on timing).
    spec.engine.scheduler.speculator.compared_steps = 10**9
    plain = LLM(DEMO, **POOL)
    yield spec, plain
    spec.shutdown()
    plain.shutdown()


# ---- proposing ------------------------------------------------------------------------

def test_ngram_proposes_what_followed_the_latest_longest_match():
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert ngram_proposal(tokens, 2, 1, 3) == [7, 8]  # "2 3" last seen before "7 8"
    assert ngram_proposal(tokens + [7], 5, 1, 3) == [8, 5, 2, 3, 7]  # "2 3 7" once: the longest wins
    assert ngram_proposal([1, 2, 3, 4], 3, 1, 3) == []  # nothing recurs
    assert ngram_proposal([5, 5], 3, 1, 1) == [5]  # what follows may run into the suffix itself
    assert ngram_proposal([4, 1, 2, 4, 1], 3, 3, 3) == []  # min 3: a 2-token match is not enough


def test_config_defaults_and_errors_follow_vllm():
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = SpeculativeConfig.parse({"method": "ngram", "prompt_lookup_max": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)
    assert EngineConfig(speculative_config='{"method": "ngram", "prompt_lookup_min": 2}').speculative.prompt_lookup_max == 2
    assert EngineConfig().speculative is None
    draft = SpeculativeConfig.parse({"model": "/some/draft", "num_speculative_tokens": 4})  # vLLM infers the method
    assert (draft.method, draft.model, draft.num_speculative_tokens) == ("draft_model", "/some/draft", 4)
    for bad, why in [({"method": "eagle"}, "method must be one of ngram, draft_model"),
                     ({"method": "draft_model"}, "draft_model needs \"model\""),
                     ({"method": "ngram", "model": "/some/draft"}, "\"model\" is for a draft model"),
                     ({"model": "/some/draft", "draft_tensor_parallel_size": 2}, "must be 1"),
                     ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be a positive"),
                     ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "is above"),
                     ({"method": "ngram", "k": 3}, "unknown key(s) k")]:
        with pytest.raises(ValueError, match=re.escape(why)):
            EngineConfig(speculative_config=bad).validate()
    with pytest.raises(ValueError, match="must be a JSON object"):
        EngineConfig(speculative_config="{method: ngram}")


def test_a_row_that_keeps_rejecting_backs_off_and_a_busy_batch_does_not_propose():
    s = Speculator(SpeculativeConfig.parse({"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 4}),
                   max_batch=4)
    tokens = [1, 2, 3, 1]  # only its last token recurs

    def propose():
        return s.propose([(7, tokens, 3), (8, [5, 6], 3)])  # (sequence 8 has nothing to look up)

    assert propose() == {7: [2, 3, 1]}
    assert s.propose([(7, tokens, 2)]) == {7: [2, 3]}  # room for 2
    waits = []
    for _ in range(4):  # every proposal rejected: waits of 2, 4, 8, 16 steps
        s.record(7, proposed=3, accepted=0)
        waits.append(sum(1 for _ in iter(propose, {7: [2, 3, 1]})))
    assert waits == [2, 4, 8, 16]
    s.record(7, proposed=3, accepted=0)  # waiting again: a 2-token match waits, a 3-token one proposes
    assert s.propose([(7, [1, 2, 3, 1, 2], 3)]) == {}
    assert s.propose([(7, [1, 2, 3, 1, 2, 3], 3)]) == {7: [1, 2, 3]}
    assert propose() == {}
    s.record(7, proposed=3, accepted=3)  # accepted again: no wait
    s.record(7, proposed=3, accepted=3)
    assert propose() == {7: [2, 3, 1]}
    assert not s.active(4)  # no plain step timed yet: the next is one
    for rows in (1, 4, 5):
        s.observe([SimpleNamespace(num_tokens=1, draft=[])] * rows, [1] * rows, 0.01)
    assert s.active(1) and s.active(4) and not s.active(5)  # 5: over max_batch
    assert not s.active(3)  # no 3-row plain step timed yet
    assert s.stats()["acceptance_rate"] == pytest.approx(6 / 21)
    s.forget(7)
    assert not s.records


def test_rows_without_a_match_of_their_own_look_up_outputs_finished_lately():
    """A tool call's shape is in other answers, not in the request: a row whose own tokens have
    no match of 2+ tokens proposes what followed its suffix in an output finished before."""
    s = Speculator(SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4,
                                            "prompt_lookup_min": 1, "prompt_lookup_max": 3}), max_batch=4)
    call = [50, 51, 52, 53, 54, 55]  # <tool_call> { "name": ... in another request's answer
    assert s.propose([(1, [9, 8, 50, 51], 4)]) == {}
    s.forget(2, call)  # finished
    assert s.propose([(1, [9, 8, 50, 51], 4)]) == {1: [52, 53, 54, 55]}
    assert s.propose([(1, [9, 50, 51, 52, 53], 4)]) == {1: [54, 55]}  # the longest match: 51 52 53
    # Its own match of 2+ tokens comes first; then the others' outputs; then a 1-token match.
    assert s.propose([(1, [7, 50, 51, 60, 7, 50, 51], 4)]) == {1: [60, 7, 50, 51]}
    assert s.propose([(1, [7, 9, 3, 7], 4)]) == {1: [9, 3, 7]}
    s.forget(3, [3, 7, 40, 41])
    assert s.propose([(1, [7, 9, 3, 7], 4)]) == {1: [40, 41]}
    s.forget(4)  # preempted: nothing learned
    assert len(s.proposer.recent.table) == 7 + 3  # the n-grams with a token after them, 2 and 3 long
    small = RecentOutputs(k=2, max_n=2, capacity=3)
    small.learn([1, 2, 3, 4, 5, 6])
    assert list(small.table) == [(2, 3), (3, 4), (4, 5)]  # the oldest went
    assert small.lookup([0, 4, 5], 2, 1) == [6] and small.lookup([1, 2], 2, 1) == []


def test_drafted_steps_that_cost_more_than_plain_ones_pause_speculation():
    """The cost check against measured step times: 2 rows decode plainly in 10 ms a step, so 3
    tokens take plain decoding 15 ms. Drafted steps emitting 3 tokens in 12 ms pay; in 30 ms
    they do not, and no row proposes for 32 steps, then 64 (longer while it keeps not paying).
    Every 32nd step is plain, so the plain time stays measured."""
    def step(drafts: list[int]):
        return [SimpleNamespace(num_tokens=1 + d, draft=[0] * d) for d in drafts]

    s = Speculator(SpeculativeConfig.parse({"method": "ngram"}), max_batch=4)
    s.observe(step([0, 0, 0]), [1, 1, 1], 0.5)  # 3 rows: another batch size, no bearing on 2
    assert s.active(3) and not s.active(2)  # 2 rows decode plainly first
    s.observe(step([3, 0]), [[1, 2], 1], 0.012)  # the 3-row time stands in for 2 rows' yet
    for _ in range(3):
        s.observe(step([0, 0]), [1, 1], 0.010)
    s.observe([SimpleNamespace(num_tokens=9, draft=[])], [1], 5.0)  # a prompt chunk: not compared
    for _ in range(15):  # 3 tokens emitted in 12 ms: pays
        s.observe(step([3, 0]), [[1, 2], 1], 0.012)
    assert s.active(2) and s.num_pauses == 0
    for _ in range(8):  # 3 tokens in 30 ms: does not
        s.observe(step([3, 0]), [[1, 2], 1], 0.030)
    assert not s.active(2) and s.paused == 32 and s.stats()["cost_pauses"] == 1
    for _ in range(32):  # paused steps are plain ones
        s.observe(step([0, 0]), [1, 1], 0.010)
    assert s.active(2)
    for _ in range(8):
        s.observe(step([3, 0]), [[1, 2], 1], 0.030)
    assert s.paused == 64
    s.paused = 0
    s.observe(step([0, 0]), [1, 1], 0.010)
    for _ in range(32):  # drafted steps that pay, until a plain one is due
        assert s.active(2)
        s.observe(step([3, 0]), [[1, 2], 1], 0.012)
    assert not s.active(2)
    s.observe(step([0, 0]), [1, 1], 0.010)
    assert s.active(2)


# ---- the engine -----------------------------------------------------------------------

def test_greedy_equals_transformers_and_log_probs_equal_no_drafts(engines):
    spec, plain = engines
    prompts = [spec.encode(t) for t in COPY_TEXTS]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    before = spec.engine.scheduler.speculator.num_accepted_tokens
    got, want = spec.generate(prompts, params), plain.generate(prompts, params)
    for ids, g, w in zip(prompts, got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids == hf_greedy(DEMO, ids, 40)
        assert len(g.outputs[0].logprobs) == 40
        for lg, lw in zip(g.outputs[0].logprobs, w.outputs[0].logprobs, strict=True):
            assert lg.keys() == lw.keys()
            # (the drafts' positions run the chunk kernels, not the decode ones: float32
            # rounding of a few 1e-6 relative; either differs from transformers by ~2.5e-5)
            assert all(lg[t] == pytest.approx(lw[t], rel=1e-5, abs=1e-5) for t in lw)
    stats = spec.engine.scheduler.speculator.stats()
    assert spec.engine.scheduler.speculator.num_accepted_tokens - before >= 20, stats
    assert 0 < stats["acceptance_rate"] < 1  # some drafts were rejected too
    # Fewer steps than tokens: rows emitted several tokens at once.
    assert spec.engine.stats.steps < plain.engine.stats.steps
    assert_pool_free(spec)


def test_features_behave_as_without_drafts(engines):
    """Chunked prefill, preemption (POOL is too small for all at once), a prefix-cache hit,
    stop strings and stop tokens, max_tokens, n=2, min_tokens and penalties give the same
    outputs."""
    spec, plain = engines
    prompts = [spec.encode(t) for t in COPY_TEXTS + COPY_TEXTS[:2]]
    greedy = dict(temperature=0, ignore_eos=True)
    first = plain.generate([prompts[0]], SamplingParams(max_tokens=30, **greedy))[0].outputs[0]
    stop_text = first.text[len(first.text) // 2:][:3]  # a stop string met mid-output
    params = [SamplingParams(max_tokens=30, stop=[stop_text], **greedy),
              SamplingParams(max_tokens=30, stop_token_ids=[first.token_ids[12]], **greedy),
              SamplingParams(max_tokens=7, **greedy),
              SamplingParams(n=2, max_tokens=30, **greedy),
              SamplingParams(max_tokens=30, min_tokens=20, **greedy),
              # penalties count a position's drafts before it as output
              SamplingParams(max_tokens=60, repetition_penalty=1.2, presence_penalty=0.5, **greedy),
              SamplingParams(max_tokens=60, frequency_penalty=0.4, **greedy), SamplingParams(max_tokens=60, **greedy)]

    def run(llm):
        before = llm.engine.scheduler.num_preemptions
        outs = llm.generate(prompts, params)
        again = llm.generate([prompts[7] + [1, 2, 3]], SamplingParams(max_tokens=20, **greedy))
        got = [[(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in out.outputs] for out in outs + again]
        return got, llm.engine.scheduler.num_preemptions - before, again[0].num_cached_tokens

    accepted = spec.engine.scheduler.speculator.num_accepted_tokens
    got, preempted, cached = run(spec)
    want, _, want_cached = run(plain)
    assert got == want
    assert got[0][0][2:] == ("stop", stop_text) and got[1][0][2] == "stop" and len(got[2][0][0]) == 7
    assert preempted > 0 and cached == want_cached >= 16
    assert spec.engine.scheduler.speculator.num_accepted_tokens > accepted
    assert_pool_free(spec)


def test_structured_outputs_speculate_within_their_grammar(engines):
    """Rows under a grammar propose too: drafts the grammar refuses are cut off, each verified
    position is masked by the grammar's state after the drafts before it, and a draft that
    completes the grammar ends the row. Greedy outputs equal those without drafts; sampled
    ones all match their grammar."""
    spec, plain = engines
    constraints = [(COPY_TEXTS[0], r"(the quick brown fox ){1,2}(jumps|runs) over"),
                   (COPY_TEXTS[1], r"[A-Za-z ,;.']+"), (COPY_TEXTS[2], r"([a-g] )+[a-g]"),
                   (COPY_TEXTS[3], r"[a-z]+(, [a-z]+)*")]
    prompts = [spec.encode(text) for text, _ in constraints]

    def params(**kw):
        return [SamplingParams(max_tokens=50, structured=StructuredOutput("regex", pattern), **kw)
                for _, pattern in constraints]

    def run(llm, **kw):
        return [o.outputs[0] for o in llm.generate(prompts, params(**kw))]

    accepted = spec.engine.scheduler.speculator.num_accepted_tokens
    got, want = run(spec, temperature=0), run(plain, temperature=0)
    assert [(o.token_ids, o.finish_reason) for o in got] == [(o.token_ids, o.finish_reason) for o in want]
    assert spec.engine.scheduler.speculator.num_accepted_tokens - accepted >= 10
    assert got[0].finish_reason == "stop"  # the grammar completed (mid-proposal, or on a draft)
    for i in range(4):  # greedy, then sampled: every token allowed where it was emitted
        outs = got if i == 0 else run(spec, temperature=1.0, seed=i)
        for out, (_, pattern) in zip(outs, constraints):
            # (cut by max_tokens: a prefix of a match)
            assert regex.fullmatch(pattern, out.text, partial=out.finish_reason == "length"), (pattern, out.text)
    assert_pool_free(spec)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_sampling_keeps_the_model_distribution(method, draft_config):
    """Temperature 1 with top-k 3 on a prompt whose lookups (or the draft model) propose a
    draft for most requests' second token (some accepted, some rejected): the second token's
    distribution over 1,500 seeded requests matches transformers' exact one (chi-square at a
    1e-3 false-failure rate)."""
    config = NGRAM if method == "ngram" else draft_config
    llm = LLM(DEMO, dtype="float32", max_num_seqs=256, speculative_config={**config, "disable_by_batch_size": 512})
    prompt = llm.encode(COPY_TEXTS[2])
    llm.engine.scheduler.speculator.compared_steps = 10**9  # keep drafting (this test is not about speed)
    try:
        draws = 1500
        # (max_tokens 3: the step after the first token may propose one draft, for the second)
        params = [SamplingParams(temperature=1.0, top_k=3, seed=i, max_tokens=3, ignore_eos=True) for i in range(draws)]
        # A first pass times a plain step at each batch size the schedule goes through (the
        # speculator proposes at a size only after that): the second pass drafts at most steps.
        llm.generate([prompt] * draws, params)
        before = llm.engine.scheduler.speculator.stats()
        outs = llm.generate([prompt] * draws, params)
        after = llm.engine.scheduler.speculator.stats()
    finally:
        llm.shutdown()
    drafted, accepted = (after[k] - before[k] for k in ("draft_tokens", "accepted_tokens"))
    assert drafted > draws // 2 and accepted >= 50 and drafted - accepted >= 50, (before, after)

    def top3(ids):
        p = torch.softmax(hf_logits(DEMO, ids)[-1].double(), dim=-1)
        keep = p.topk(3).indices
        q = torch.zeros_like(p)
        q[keep] = p[keep] / p[keep].sum()
        return q

    first = top3(prompt)
    second = sum(first[t] * top3(prompt + [t]) for t in first.nonzero().flatten().tolist())
    counts = torch.bincount(torch.tensor([o.outputs[0].token_ids[1] for o in outs]), minlength=len(second)).double()
    support = second > 0
    assert counts[~support].sum() == 0  # no mass: never drawn
    observed, expected = pooled(counts[support], second[support] * draws)
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    df = len(expected) - 1
    assert 3 <= df and chi2 < CHI2_CRITICAL[df], (chi2, df)


def test_a_busy_batch_proposes_nothing():
    llm = LLM(DEMO, dtype="float32", speculative_config={**NGRAM, "disable_by_batch_size": 2})
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    try:
        llm.generate([llm.encode(t) for t in COPY_TEXTS], greedy)  # six running: over 2
        assert llm.engine.scheduler.speculator.num_drafts == 0
        progress, decoded = DecodeProgress(llm.engine), llm.engine.stats.decode_tokens
        llm.generate([llm.encode(t) for t in COPY_TEXTS[:2]], greedy)
        s = llm.engine.scheduler.speculator
        assert s.num_drafts > 0
        # The progress line's figures are the speculator's since the line before.
        rate, length = re.search(r" spec_acceptance_rate=([\d.]+) spec_mean_acceptance_length=([\d.]+)$",
                                 progress.line()).groups()
        assert float(rate) == round(s.num_accepted_tokens / s.num_draft_tokens, 2) > 0
        assert float(length) == round(1 + s.num_accepted_tokens / s.num_drafts, 2) > 1
        assert llm.engine.stats.decode_tokens - decoded == 2 * 11  # every token after the first
        snapshot = llm.engine.metrics.snapshot(llm.engine)
        snap = snapshot["counters"]
        assert snap["spec_decode_num_drafts"] == llm.engine.scheduler.speculator.num_drafts
        assert 0 < snap["spec_decode_num_accepted_tokens"] <= snap["spec_decode_num_draft_tokens"]
        per_position = snapshot["spec_accepted_per_pos"]
        assert list(per_position) == [str(i) for i in range(s.config.num_speculative_tokens)]
        assert sum(per_position.values()) == snap["spec_decode_num_accepted_tokens"]
        assert sorted(per_position.values(), reverse=True) == list(per_position.values())  # a prefix is kept
    finally:
        llm.shutdown()


def test_the_draft_model_proposes_its_own_greedy_tokens(draft_config):
    """A proposal is the draft model's greedy continuation, for a new sequence (its whole
    prompt computed) and after a verification (what the cache holds of it reused)."""
    spec = LLM(DEMO, dtype="float32", speculative_config=draft_config)
    alone = LLM(draft_config["model"], dtype="float32")
    proposer = spec.engine.scheduler.speculator.proposer
    try:
        prompts = [spec.encode(t) for t in COPY_TEXTS]
        greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        for round_ in range(3):
            want = [o.outputs[0].token_ids for o in alone.generate(prompts, greedy)]
            got = proposer.propose([(i, ids, 4) for i, ids in enumerate(prompts)])
            assert [got[i] for i in range(len(prompts))] == want
            # The target kept `round_` drafts and wrote a token of its own (1: none was kept).
            prompts = [ids + drafts[:round_] + [1] for ids, drafts in zip(prompts, want)]
        for i in range(len(prompts)):
            proposer.forget(i)
        assert not proposer.cached and len(proposer.free) == proposer.runner.num_blocks
    finally:
        spec.shutdown()
        alone.shutdown()


def test_a_draft_model_with_another_tokenizer_is_refused(llama_ckpt):
    with pytest.raises(ValueError, match="different tokenizer from the target's"):
        LLM(DEMO, speculative_config={"model": str(llama_ckpt)})
