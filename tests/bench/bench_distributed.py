"""Per-step orchestration cost across ranks, and tokens/s at tp=1 vs tp=2.

    .venv/bin/python tests/bench/bench_distributed.py

Orchestration = rank 0 broadcasting a real step description (a batch-32 decode step's
tensors) to every rank over torch.distributed and an all-reduce back, with no forward.
"""
import os
import statistics
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402
import torch  # noqa: E402
from common import bench_checkpoint, workload  # noqa: E402

from actors.distributed.pipeline import ping  # noqa: E402
from actors.engine.llm import LLM  # noqa: E402
from actors.request import EngineRequest  # noqa: E402
from actors.sampling_params import SamplingParams  # noqa: E402


def orchestration_ms(path, tp: int, iters: int = 200) -> float:
    llm = LLM(str(path), tp_size=tp, kv_cache_memory=0.5, shard_cpus=0.5)
    engine = llm.engine
    for i, ids in enumerate(workload(32, 64, 128, seed=2)):
        engine.add_request(EngineRequest(f"o{i}", ids, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)))
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running):
        engine.step()
    payload = engine.scheduler.schedule()  # a decode step's SchedulerOutput: what a step broadcasts
    runner = engine.executor.runner
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        if tp > 1:
            ping(runner.p, payload)
        times.append(time.perf_counter() - t)
    for rid in list(engine.requests):
        engine.abort_request(rid)
    llm.shutdown()
    return statistics.median(times) * 1e3


def tokens_per_second(path, tp: int) -> float:
    llm = LLM(str(path), tp_size=tp, kv_cache_memory=0.5, shard_cpus=1)
    prompts = workload(16, 32, 128, seed=3)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    rate = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)
    llm.shutdown()
    return rate


def main():
    torch.set_num_threads(1)
    ray.init(address="local", include_dashboard=False, num_cpus=4, log_to_driver=False)
    path = bench_checkpoint()
    print("| measure | value |")
    print("| --- | --- |")
    for tp in (1, 2, 4):
        print(f"| orchestration per step, tp={tp} (median) | {orchestration_ms(path, tp):.2f} ms |")
    t1, t2 = tokens_per_second(path, 1), tokens_per_second(path, 2)
    print(f"| tokens/s tp=1 (16 requests x 64 tokens) | {t1:.0f} |")
    print(f"| tokens/s tp=2 | {t2:.0f} ({t2 / t1:.2f}x of tp=1) |")
    ray.shutdown()


if __name__ == "__main__":
    main()
