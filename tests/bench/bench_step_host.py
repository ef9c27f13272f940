"""Host time of an engine step: the step's wall time minus the model's forward and LM head,
at a batch of decodes (eager decode, so the forward is one module call to time).

    .venv/bin/python tests/bench/bench_step_host.py [--batch 32] [--steps 60]

Works on this layout and on the pre-2026-11-27 one (actors.llm), so a run can time both:
    (cd OLD_CHECKOUT && python /path/to/bench_step_host.py)
"""
import argparse
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
except ImportError:  # the layout before actors/ was split by role
    from actors.llm import LLM
    EngineRequest = None
from actors.sampling_params import SamplingParams  # noqa: E402


def model_of(engine):
    runner = getattr(engine, "runner", None) or engine.executor.runner
    return runner.model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sampled", action="store_true", help="temperature 0.8, top-p 0.9, a seed per request")
    args = ap.parse_args()
    torch.set_num_threads(2)
    llm = LLM(str(bench_checkpoint()), max_num_seqs=args.batch, kv_cache_memory=2.0, eager_decode=True)
    engine = llm.engine
    model = model_of(engine)
    spans = []

    def pre(*_):
        spans.append(time.perf_counter())

    def post(*_):
        spans[-1] = time.perf_counter() - spans[-1]

    for m in (model, model.lm_head):
        m.register_forward_pre_hook(pre)
        m.register_forward_hook(post)
    results = []
    for r in range(args.repeats):
        for i, ids in enumerate(workload(args.batch, 96, 160, seed=1)):
            sampling = dict(temperature=0.8, top_p=0.9, seed=i) if args.sampled else dict(temperature=0)
            params = SamplingParams(max_tokens=args.steps + 40, ignore_eos=True, **sampling)
            if EngineRequest is None:
                engine.add_request(f"r{r}-{i}", ids, params)
            else:
                engine.add_request(EngineRequest(f"r{r}-{i}", ids, params))
        while not all(s.num_computed_tokens >= s.num_prompt_tokens for s in engine.scheduler.running) \
                or engine.scheduler.waiting:
            engine.step()
        host, step = [], []
        for _ in range(args.steps):
            spans.clear()
            t = time.perf_counter()
            engine.step()
            total = time.perf_counter() - t
            step.append(total)
            host.append(total - sum(spans))
        for rid in list(engine.requests):
            engine.abort_request(rid)
        results.append((statistics.median(host), statistics.median(step)))
    host = statistics.median(h for h, _ in results)
    step = statistics.median(s for _, s in results)
    print(f"batch {args.batch}, {'sampled' if args.sampled else 'greedy'}: step {step * 1e3:.2f} ms, host (step - forward - LM head) {host * 1e3:.3f} ms "
          f"(repeats: {', '.join(f'{h * 1e3:.3f}' for h, _ in results)})")


if __name__ == "__main__":
    main()
