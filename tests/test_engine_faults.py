"""Faults inside one engine: a request whose post-processing raises fails alone, and anything
that ends the engine loop makes the engine dead (requests fail, `alive` is False) instead of
leaving requests hanging behind a loop that no longer runs."""
import asyncio

import pytest
from oracle import hf_greedy
from test_engine import GREEDY, assert_pool_free, prompts_of

from actors.config import EngineConfig
from actors.engine.async_engine import AsyncEngine
from actors.engine.llm import LLM
from actors.errors import EngineDeadError, RequestFailedError
from actors.request import EngineRequest
from actors.sampling_params import SamplingParams


def test_a_request_whose_post_processing_raises_fails_alone(llama_ckpt):
    llm = LLM(str(llama_ckpt), num_kv_blocks=64)
    good, bad = prompts_of([9, 14])
    llm.engine.add_request(EngineRequest("good", good, GREEDY))
    llm.engine.add_request(EngineRequest("bad", bad, GREEDY))
    calls = 0

    def broken_add(token, check_stop=True):
        nonlocal calls
        calls += 1
        if calls == 3:
            raise KeyError("a bug in one request's handling")
        return None

    llm.engine.requests["bad"].detoks[0].add = broken_add
    tokens, failures = {"good": [], "bad": []}, []
    while llm.engine.has_unfinished():
        for out in llm.engine.step():
            tokens[out.request_id] += out.outputs[0].token_ids
            assert not (out.request_id == "bad" and out.finished)
        failures += llm.engine.take_failures()
    assert tokens["good"] == hf_greedy(llama_ckpt, good, GREEDY.max_tokens)
    assert len(tokens["bad"]) == 2  # what it streamed before its third token broke
    ((rid, error),) = failures
    assert rid == "bad" and isinstance(error, RequestFailedError) and "KeyError" in str(error)
    assert_pool_free(llm)


def test_an_engine_loop_that_ends_fails_every_request_and_is_not_alive(llama_ckpt):
    engine = AsyncEngine(EngineConfig(model_path=str(llama_ckpt), num_kv_blocks=32))

    def crash():
        raise MemoryError("outside any per-request handling")

    engine.engine.step = crash

    async def one(rid):
        return [out async for out in engine.generate(EngineRequest(rid, prompts_of([6])[0], SamplingParams(max_tokens=4)))]

    try:
        with pytest.raises(EngineDeadError, match="MemoryError|outside any"):
            asyncio.run(one("first"))
        assert not engine.alive and engine.stats()["engine_alive"] is False
        with pytest.raises(EngineDeadError):  # refused at once, never queued
            asyncio.run(one("second"))
    finally:
        engine.shutdown()


def test_a_sequence_that_outgrows_the_pool_finishes_with_length_and_the_queue_moves(llama_ckpt):
    """4 blocks of 4 tokens: a request without max_tokens can never hold more than 16 tokens.
    It used to be preempted and never readmitted, blocking every request behind it."""
    llm = LLM(str(llama_ckpt), num_kv_blocks=4, block_size=4, max_num_batched_tokens=8)
    greedy, short = prompts_of([6, 5])
    outs = llm.generate([greedy, short], [SamplingParams(temperature=0, ignore_eos=True, max_tokens=None),
                                         SamplingParams(temperature=0, ignore_eos=True, max_tokens=4)])
    grown, behind = outs[0].outputs[0], outs[1].outputs[0]
    # 16 slots hold 16 computed tokens; the token sampled from the last of them comes out too
    assert grown.finish_reason == "length" and len(greedy) + len(grown.token_ids) == 17
    assert grown.token_ids == hf_greedy(llama_ckpt, greedy, len(grown.token_ids))
    assert behind.finish_reason == "length" and behind.token_ids == hf_greedy(llama_ckpt, short, 4)
    assert_pool_free(llm)


def test_queue_limit_counts_requests_not_samples(llama_ckpt):
    """A running n=3 request is one request: with room for one waiting request, the second
    waits and the third is refused (counting samples let both in)."""
    from actors.errors import QueueFullError

    engine = AsyncEngine(EngineConfig(model_path=str(llama_ckpt), num_kv_blocks=64, max_num_seqs=3,
                                      max_queued_requests=1))
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, n=3)

    async def scenario():
        a = engine.generate(EngineRequest("a", prompts_of([5])[0], long))
        await a.__anext__()  # its three samples are running
        b = engine.generate(EngineRequest("b", prompts_of([6])[0], SamplingParams(max_tokens=2)))
        b_first = asyncio.ensure_future(b.__anext__())
        await asyncio.sleep(0.05)
        with pytest.raises(QueueFullError):
            await engine.generate(EngineRequest("c", prompts_of([7])[0], SamplingParams(max_tokens=2))).__anext__()
        await a.aclose()
        await b_first
        await b.aclose()

    try:
        asyncio.run(scenario())
    finally:
        engine.shutdown()


def test_watchdog_declares_a_stuck_step_dead(llama_ckpt):
    import time

    engine = AsyncEngine(EngineConfig(model_path=str(llama_ckpt), num_kv_blocks=32, watchdog_timeout=0.5))
    execute = engine.engine.executor.runner.execute

    def stuck(*step):
        time.sleep(4)
        return execute(*step)

    engine.engine.executor.runner.execute = stuck

    async def one():
        return [out async for out in engine.generate(EngineRequest("x", prompts_of([6])[0], SamplingParams(max_tokens=4)))]

    try:
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"watchdog: engine step 1 .* over --watchdog-timeout 0.5 s"):
            asyncio.run(one())
        assert time.monotonic() - start < 3 and not engine.alive
    finally:
        engine.shutdown()


def test_the_engine_loop_thread_gets_the_callers_matmul_threads(llama_ckpt):
    """OpenMP keeps its thread count per OS thread and a new thread starts from the default
    (OMP_NUM_THREADS, else the core count), whatever torch.get_num_threads() says. The engine
    loop's thread must run its matmuls (oneDNN, MKL) with the count set where the engine was
    built; in a Ray actor the default is 1, and decode steps ran on one thread."""
    import ctypes

    import torch
    omp_threads = ctypes.CDLL(None).omp_get_max_threads  # torch's OpenMP runtime
    before = torch.get_num_threads()
    want = 1 if omp_threads() != 1 else 2  # not what a fresh thread would start with
    torch.set_num_threads(want)
    engine = AsyncEngine(EngineConfig(model_path=str(llama_ckpt), num_kv_blocks=32))
    seen, step = [], engine.engine.step

    def observed_step():
        seen.append(omp_threads())
        return step()

    engine.engine.step = observed_step

    async def one():
        return [out async for out in engine.generate(EngineRequest("r", prompts_of([6])[0], SamplingParams(max_tokens=3)))]

    try:
        assert asyncio.run(one())
        assert seen and set(seen) == {want}
    finally:
        engine.shutdown()
        torch.set_num_threads(before)
