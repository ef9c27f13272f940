"""Training throughput of the demo model (app/demo/train.py) by thread count and precision.

    .venv/bin/python tests/bench/bench_demo_train.py [--steps 40]

The same batches (seeded) through the same initial model for each setting, in this process,
one after another: tokens per second of forward + backward + AdamW step, after 10 warm-up
steps. Run it on an idle machine; the figures back `--threads 2` as the training default.
"""
import argparse
import time

import torch

from app.demo import train

SETTINGS = [(1, False), (2, False), (1, True), (2, True)]  # (threads, bf16 autocast)


def tokens_per_s(tok, threads: int, bf16: bool, steps: int) -> float:
    torch.set_num_threads(threads)
    model = train.build_model(tok)  # seeded: the same start for every setting
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stream = train.batches(tok, train.SEED, tokens_per_batch=2048)
    seen, start = 0, None
    for step in range(10 + steps):
        if step == 10:
            seen, start = 0, time.perf_counter()
        ids, labels, mask = next(stream)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        seen += int(mask.sum())
    return seen / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args()
    tok = train.build_tokenizer()
    rates = {s: tokens_per_s(tok, *s, args.steps) for s in SETTINGS}
    base = rates[(1, False)]
    print("| threads | precision | tokens/s | vs 1 thread float32 |")
    print("| --- | --- | --- | --- |")
    for (threads, bf16), rate in rates.items():
        print(f"| {threads} | {'bf16 autocast' if bf16 else 'float32'} | {rate:,.0f} | {rate / base:.2f}x |")


if __name__ == "__main__":
    main()
