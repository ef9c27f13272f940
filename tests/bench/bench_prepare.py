"""Time building a step's input tensors (the model runner's `prepare`) on either layout: a
prefill step of 2,048 tokens in chunks, and a decode step, at batch 32 and 128.

    .venv/bin/python tests/bench/bench_prepare.py
    (cd OLD_CHECKOUT && PYTHONPATH=$PWD python /path/to/bench_prepare.py)   # the layout before 2026-11-27
"""
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from common import bench_checkpoint, workload  # noqa: E402

try:
    from actors.engine.llm import LLM
    from actors.request import EngineRequest
    new = True
except ImportError:
    from actors.llm import LLM
    new = False
from actors.sampling_params import SamplingParams  # noqa: E402

torch.set_num_threads(2)



def run(batch, prompt_lo, prompt_hi, chunk_budget):
    llm = LLM(str(bench_checkpoint()), max_num_seqs=batch, kv_cache_memory=2.0, eager_decode=True,
              max_num_batched_tokens=chunk_budget)
    engine = llm.engine
    runner = engine.executor.runner if new else engine.runner
    for i, ids in enumerate(workload(batch, prompt_lo, prompt_hi, seed=1)):
        p = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        if new:
            engine.add_request(EngineRequest(f"r{i}", ids, p))
        else:
            engine.add_request(f"r{i}", ids, p)
    # a prefill step: the first schedule (chunks), then decode steps
    results = {}
    out = engine.scheduler.schedule()
    if new:
        runner.batch.update(out)
    for kind in ("prefill", "decode"):
        times = []
        for _ in range(300):
            t = time.perf_counter()
            runner.prepare(out)
            times.append(time.perf_counter() - t)
        results[kind] = statistics.median(times) * 1e6
        # run the prefill step for real, then reach pure decode
        engine.scheduler.update(out, runner.execute(out).tokens)
        while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                                              for s in engine.scheduler.running):
            engine.step()
        out = engine.scheduler.schedule()
        if new:
            runner.batch.update(out)
    return results


for batch, lo, hi, budget in ((32, 96, 160, 2048), (128, 16, 24, 2048)):
    r = run(batch, lo, hi, budget)
    print(f"{'input batch' if new else 'rows rebuilt'}, batch {batch}: prepare a prefill step "
          f"{r['prefill']:.0f} us, a decode step {r['decode']:.0f} us")
