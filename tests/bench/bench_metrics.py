"""What recording metrics costs the engine loop, per step.

    .venv/bin/python tests/bench/bench_metrics.py [--batch 32] [--steps 40] [--ray]

1. The hooks alone: the calls one decode step of `--batch` sequences makes into
   actors/engine/metrics.py (record_step: the first-step check, one token per sequence), timed
   in a tight loop on synthetic requests: microseconds per step.
2. Real decode steps of the bench model at that batch with the hooks on and with no-op
   hooks, two engines in this process stepped in turn (medians): the hooks' share of a step.
3. --ray: in a Ray actor, the cost of one ray.util.metrics record call and of one
   RayExporter push after a step's worth of observations (off the loop thread).
"""
import argparse
import statistics
import time
from types import SimpleNamespace

from common import bench_checkpoint, workload

from actors.config import EngineConfig
from actors.engine.llm import LLM
from actors.engine.metrics import EngineMetrics
from actors.sampling_params import SamplingParams


def fake_step(n: int) -> tuple[SimpleNamespace, dict]:
    """A decode step of n one-token rows (SchedulerOutput-shaped) and its live requests."""
    reqs = {f"r{i}": SimpleNamespace(arrival_time=0.0, scheduled_time=None, first_token_time=None,
                                     token_times={}, prompt_token_ids=[1] * 100) for i in range(n)}
    seqs = [SimpleNamespace(seq=SimpleNamespace(request_id=rid, index=0, num_prompt_tokens=100,
                                                params=SimpleNamespace(max_tokens=10_000)),
                            num_tokens=1, start=100, samples=True) for rid in reqs]
    return SimpleNamespace(seqs=seqs), reqs


def hook_cost_us(batch: int, steps: int = 2000) -> float:
    metrics, (output, reqs) = EngineMetrics(EngineConfig()), fake_step(batch)
    tokens = [7] * batch
    start = time.perf_counter()
    for i in range(steps):
        now = 1.0 + i * 0.01
        metrics.record_step(output, tokens, reqs, now - 0.01, now)
    return (time.perf_counter() - start) / steps * 1e6


class NoMetrics(EngineMetrics):
    """The same engine without the recording work (the baseline)."""

    def record_step(self, output, tokens, requests, start, now):
        for s in output.seqs:
            requests[s.seq.request_id].scheduled_time = start


def step_times(batch: int, steps: int) -> tuple[float, float]:
    """Median decode step (ms) with metrics and without, stepped in turn."""
    path = bench_checkpoint()
    engines = [LLM(str(path), max_num_seqs=batch, kv_cache_memory=1.0) for _ in range(2)]
    engines[1].engine.metrics.__class__ = NoMetrics
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for llm in engines:
        for i, prompt in enumerate(workload(batch, 16, 32)):
            llm.add_request(f"r{i}", prompt, params)
        for _ in range(3):  # prefill and warm-up
            llm.engine.step()
    times = [[], []]
    for _ in range(steps):
        for which, llm in enumerate(engines):
            start = time.perf_counter()
            llm.engine.step()
            times[which].append(time.perf_counter() - start)
    return tuple(1000 * statistics.median(t) for t in times)


def ray_costs(batch: int) -> dict:
    import os
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback, before import
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    ray.init(address="local", include_dashboard=False, num_cpus=1, log_to_driver=False)
    try:
        return ray.get(ray.remote(_ray_costs).remote(batch))
    finally:
        ray.shutdown()


def _ray_costs(batch: int) -> dict:
    from ray.util.metrics import Histogram

    from actors.host.ray_metrics import RayExporter
    h, tags, n = Histogram("shoal_bench_seconds", "", [0.1, 1.0], ("model", "replica")), \
        {"model": "m", "replica": "r"}, 20000
    start = time.perf_counter()
    for _ in range(n):
        h.observe(0.5, tags)
    per_call = (time.perf_counter() - start) / n * 1e6
    engine = SimpleNamespace(metrics=EngineMetrics(EngineConfig()), scheduler=SimpleNamespace(
        running=[], waiting=[], num_preemptions=0, query_tokens=0, hit_tokens=0),
        blocks=SimpleNamespace(num_blocks=10, num_free_blocks=10))
    exporter = RayExporter(engine, interval=3600)  # pushed by hand below
    output, reqs = fake_step(batch)
    for i in range(2):  # one step's tokens: batch ITL observations at one interval
        engine.metrics.record_step(output, [7] * batch, reqs, 1.0 + i - 0.01, 1.0 + i)
    start = time.perf_counter()
    exporter.push()
    return {"record_call_us": per_call, "push_one_step_us": (time.perf_counter() - start) * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--ray", action="store_true")
    args = parser.parse_args()
    hooks = {b: hook_cost_us(b) for b in (1, args.batch, 128)}
    with_m, without = step_times(args.batch, args.steps)
    print("| batch | hooks per step | decode step with metrics | without | hooks' share |")
    print("| --- | --- | --- | --- | --- |")
    print(f"| {args.batch} | {hooks[args.batch]:.1f} us | {with_m:.1f} ms | {without:.1f} ms | "
          f"{hooks[args.batch] / (1000 * without):.3%} |")
    print(f"hooks per step at batch 1 / 128: {hooks[1]:.1f} / {hooks[128]:.1f} us")
    if args.ray:
        print("Ray (off the loop thread):", {k: round(v, 1) for k, v in ray_costs(args.batch).items()})


if __name__ == "__main__":
    main()
