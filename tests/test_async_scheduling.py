"""Async scheduling (actors/engine/llm_engine.py). With one rank the next step is scheduled
and launched before a step's tokens are read (its rows take them on the device, from
placeholders); a step that cannot go ahead (grammar, penalties, prompt log-probs), or with
SHOAL_SCHEDULE_AHEAD=0 every step, makes its outputs during the next one, so they leave a step
later. Nothing else may change: tokens, text, finish reasons, log-probs, metrics and the KV
pool come out as with it off.

On CPU the forward finishes inside execute(), so these tests check the bookkeeping (stop
tokens and strings found a step late, length limits, preemption of a sequence whose token is
pending, aborts between steps, streamed deltas); tests/bench/bench_gpu.py measures the overlap
on a GPU.
"""
import pytest
from oracle import hf_greedy
from test_engine import assert_pool_free, prompts_of

from actors.engine.llm import LLM
from actors.outputs import merge
from actors.request import EngineRequest
from actors.sampling_params import SamplingParams


def summary(out):
    return [(o.index, o.token_ids, o.text, o.finish_reason, o.stop_reason, o.logprobs) for o in out.outputs]


def run(path, async_scheduling, prompts, params, **options):
    """(each request's summary, the metrics' counters and finishes, the steps that went ahead)."""
    llm = LLM(str(path), async_scheduling=async_scheduling, **options)
    ahead = count_steps_ahead(llm.engine)
    outs = llm.generate(prompts, params)
    assert_pool_free(llm)
    snap = llm.engine.metrics.snapshot(llm.engine)
    return [summary(o) for o in outs], (snap["counters"], snap["finished"]), ahead


def count_steps_ahead(engine) -> list[int]:
    """A one-item list that counts the steps launched before the step before them was read."""
    count, execute = [0], engine.executor.execute

    def counted(output, previous=None):
        count[0] += previous is not None
        return execute(output, previous)
    engine.executor.execute = counted
    return count


def sample_only_one_hits(texts: list[str]) -> str:
    """A two-character stop string that the first sample's text has and the second's lacks."""
    first, second = texts
    return next(first[i:i + 2] for i in range(2, len(first) - 1)
                if first[i:i + 2].strip() and first[i:i + 2] not in second and first[i:i + 2] not in first[:i + 1])


@pytest.mark.parametrize("ahead", [True, False], ids=["ahead", "held"])
@pytest.mark.parametrize("pool", [dict(num_kv_blocks=64), dict(block_size=4, num_kv_blocks=24, max_num_batched_tokens=64)],
                         ids=["roomy", "preempting"])
def test_same_outputs_as_synchronous_steps(llama_ckpt, pool, ahead, monkeypatch):
    """Every kind of request in one batch, with async scheduling off and on (and, in a pool too
    small for the batch, preemption): identical outputs, metrics and a free pool."""
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ids = prompts_of([6], seed=10)[0]
    base = LLM(str(llama_ckpt), num_kv_blocks=64, async_scheduling=False)
    free = base.generate([ids], greedy)[0].outputs[0]
    two = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=24, ignore_eos=True)
    samples = [o.text for o in base.generate([ids], two)[0].outputs]
    stop_one = sample_only_one_hits(samples)
    prompts = prompts_of([9, 17, 5, 12, 20, 8, 14, 11], seed=3) + [ids, ids, ids]
    params = [greedy,
              SamplingParams(temperature=0, max_tokens=12),
              SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop_token_ids=[free.token_ids[4]]),
              SamplingParams(max_tokens=0, prompt_logprobs=1),
              SamplingParams(temperature=0, max_tokens=15, ignore_eos=True, min_tokens=15),
              SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[free.text[10:14]]),
              SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=24, ignore_eos=True, stop=[stop_one]),
              greedy]
    sync, sync_metrics, _ = run(llama_ckpt, False, prompts, params, **pool)
    monkeypatch.setenv("SHOAL_SCHEDULE_AHEAD", "1" if ahead else "0")
    overlapped, overlapped_metrics, steps_ahead = run(llama_ckpt, True, prompts, params, **pool)
    assert (steps_ahead[0] > 10) if ahead else (steps_ahead[0] == 0)  # (not while prompt log-probs run)
    assert overlapped == sync
    if "max_num_batched_tokens" in pool:  # when preempted sequences return, and so what their
        for counters, _ in (sync_metrics, overlapped_metrics):  # prefix-cache lookups find, moves
            del counters["prefix_cache_queries"], counters["prefix_cache_hits"]  # with scheduling ahead
    assert overlapped_metrics == sync_metrics
    # The stop strings did stop: one sample of the pair, and the greedy row, a step before the
    # next token (which async scheduling had already computed) could leak.
    assert [s[3] for s in sync[9]] == ["stop", "length"]
    assert sync[8][0][3] == "stop" and sync[8][0][2] == free.text[:10]
    assert sync[0][0][1] == hf_greedy(llama_ckpt, prompts[0], 30)


@pytest.mark.parametrize("ahead", [True, False], ids=["ahead", "held"])
def test_streamed_deltas_add_up(llama_ckpt, ahead, monkeypatch):
    """Streamed requests: the deltas add up to what synchronous steps give; an aborted request
    sends nothing more. Scheduling ahead, each step sends its own tokens (the next step is
    already launched); holding outputs, the first step sends nothing (its outputs are made
    during the second)."""
    monkeypatch.setenv("SHOAL_SCHEDULE_AHEAD", "1" if ahead else "0")
    prompts = prompts_of([7, 13, 10], seed=21)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    two = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=24, ignore_eos=True)
    base = LLM(str(llama_ckpt), num_kv_blocks=64, async_scheduling=False)
    two.stop = [sample_only_one_hits([o.text for o in base.generate([prompts[0]], two)[0].outputs])]
    params = [greedy, greedy, two]
    ref = base.generate(prompts, params)
    llm = LLM(str(llama_ckpt), num_kv_blocks=64, async_scheduling=True)
    engine = llm.engine
    for i, (ids, p) in enumerate(zip(prompts + [prompts[0]], params + [greedy])):
        engine.add_request(EngineRequest(f"r{i}", ids, p))
    first = engine.step()
    assert (len(first) == 4) if ahead else (first == [])
    assert (engine._launched is not None) == ahead
    got = {out.request_id: out for out in first}
    finishes, steps = [], 0
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id != "r3" or steps < 3, "an aborted request sent an output"
            finishes += [(out.request_id, o.index) for o in out.outputs if o.finished]
            got[out.request_id] = merge(got[out.request_id], out) if out.request_id in got else out
        steps += 1
        if steps == 3:
            assert engine.abort_request("r3")
    for i, want in enumerate(ref):
        assert got[f"r{i}"].finished and summary(got[f"r{i}"]) == summary(want)
    assert [o.finish_reason for o in got["r2"].outputs] == ["stop", "length"]
    assert sorted(finishes) == [("r0", 0), ("r1", 0), ("r2", 0), ("r2", 1)]  # each sample's finish once
    assert not got["r3"].finished and len(got["r3"].outputs[0].token_ids) == 3 + ahead
    assert_pool_free(llm)
