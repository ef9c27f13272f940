"""--quantization int8 on CPU: speed and memory against shoal's bfloat16 server and llama.cpp's
Q8_0, and quality against the unquantized model.

    .venv/bin/python tests/bench/bench_quantization.py speed --llama-server BUILD/bin/llama-server \\
        --llama-cpp SRC/vendor/llama.cpp [--rounds 3] [--requests 64] [--output-len 32] \\
        [--formats int8,w8a8_int8,bf16]
    .venv/bin/python tests/bench/bench_quantization.py speed --llama-server BUILD/bin/llama-server \\
        --gguf FILE.gguf [--formats bf16,int8-bf16,w8a8_int8-bf16]
    .venv/bin/python tests/bench/bench_quantization.py quality [--model DIR] [--formats int8,w8a8_int8,fp8,fp8-dynamic]
    .venv/bin/python tests/bench/bench_quantization.py kernel [--threads 2] [--best]

kernel: the 8-bit kernel (int8 and fp8 weights) and w8a8_int8's int8 x int8 product
(the CPU's kernel of kernels/quantization.py, activations quantized per call) against float32 (shoal's CPU linear: oneDNN, or
the panel kernel on AVX-512) on the Qwen2.5-0.5B shape's projections, at decode and prefill row
counts.

speed: a Qwen2.5-0.5B-shaped checkpoint (24 layers, hidden 896, 14 query / 2 KV heads, MLP
4,864, vocab 151,936, tied embeddings; random weights: speed does not depend on them), its
Q8_0 GGUF by llama.cpp's converter, and the servers up at once on 127.0.0.1: `llama-server`
(Q8_0, f32 KV) and by default `shoal serve --quantization int8` and `shoal serve --dtype
bfloat16` (--formats: any of int8, w8a8_int8 and bf16; all --max-num-seqs 32, 2 torch
threads). They take turns on the same requests (random prompts,
concurrency 32, ignore_eos; tests/bench/bench_llama_cpp.py's client), round after round. Each
shoal server's memory is taken over its process tree (the CLI, Ray's daemons and workers, the
engine) after the rounds: resident (RSS, which counts shared pages once per process) and
proportional (PSS), and the resident memory of its largest process (the engine) alone.

quality: SmolLM2-135M-Instruct (a real trained model; `make smollm2`) in float32 and in each
format (FORMATS: int8, w8a8_int8 (int8 activations per token too), fp8 weight-only as on CPU, fp8 with a GPU's dynamic FP8 activations, an
fp8 KV cache, and GPTQ / AWQ / compressed-tensors int4 checkpoints written from it by round to
nearest, no calibration), teacher-forced on fixed texts: per position, whether each agrees with
float32 on the most likely next token, and |log p(actual next token)| difference.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
from pathlib import Path

from common import workload  # (first: it puts tests/ on sys.path)

from bench_llama_cpp import add_workload_args, convert, drive, start_llama_server, start_shoal, stop, wait_ready  # noqa: E402,I001
from checkpoints import make_checkpoint  # noqa: E402

# --formats of `speed`: (server name, --dtype, shoal serve options)
SHOAL_SERVERS = {"int8": ("shoal int8", "float32", "--quantization int8"),
                 # int8 as --dtype auto runs a bf16 checkpoint on a CPU with bf16 matmuls
                 "int8-bf16": ("shoal int8 bf16", "bfloat16", "--quantization int8"),
                 "w8a8_int8": ("shoal w8a8_int8", "float32", "--quantization w8a8_int8"),
                 # what --dtype auto gives a bf16 checkpoint on a CPU with bf16 matmuls: the
                 # activations and the KV cache in bfloat16
                 "w8a8_int8-bf16": ("shoal w8a8_int8 bf16", "bfloat16", "--quantization w8a8_int8"),
                 "bf16": ("shoal bf16", "bfloat16", "")}
QWEN_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                intermediate_size=4864, vocab_size=151936, max_position_embeddings=4096,
                tie_word_embeddings=True)
SEED = 20261128


def tree_memory_mib(pid: int) -> dict[str, float]:
    """Memory of a process and all its descendants, MiB: the sum of their resident sets (`rss`,
    which counts a page shared by several processes in each: torch's libraries, the forked
    dashboard workers), of their proportional sets (`pss`: a shared page split among its
    sharers), and the resident set of the largest process (`engine`: a shoal server's)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    kib = {"rss": 0, "pss": 0, "engine": 0}
    todo = [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        rss = _kib(f"/proc/{p}/status", "VmRSS:")
        kib["rss"] += rss
        kib["pss"] += _kib(f"/proc/{p}/smaps_rollup", "Pss:")
        kib["engine"] = max(kib["engine"], rss)
    return {k: v / 1024 for k, v in kib.items()}


def _kib(path: str, field: str) -> int:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1])
    except OSError:  # the process has ended
        pass
    return 0


def speed(args) -> None:
    args.logs = args.root / "logs"
    args.logs.mkdir(parents=True, exist_ok=True)
    if not (args.gguf or args.llama_cpp):
        raise SystemExit("speed: --llama-cpp (to convert the Qwen2.5-0.5B shape) or --gguf FILE")
    if args.gguf:  # one GGUF file served by both: llama-server reads it, shoal dequantises it as it loads
        hf = gguf = args.gguf
        llama = f"llama-server {gguf.name}"
    else:
        hf = args.root / "qwen2.5-0.5b-shape"
        if not (hf / "config.json").exists():
            make_checkpoint(hf, "qwen2", seed=SEED, init_std=0.02, **QWEN_05B)
        gguf, llama = convert(hf, args.llama_cpp, "q8_0"), "llama-server Q8_0"
    prompts = workload(args.requests, args.min_prompt, args.max_prompt, seed=7, vocab=512)
    base = args.shoal_args
    servers = {}
    try:
        args.dtype = "float32"  # llama-server's KV cache (f32), as shoal's
        servers[llama] = start_llama_server(args.llama_server, gguf, args)
        for kind in args.formats.split(","):
            if kind not in SHOAL_SERVERS:
                raise SystemExit(f"--formats: one of {', '.join(SHOAL_SERVERS)}, got {kind!r}")
        for name, dtype, options in (SHOAL_SERVERS[kind] for kind in args.formats.split(",")):
            args.dtype, args.shoal_args = dtype, f"{base} {options}"
            args.logs = args.root / f"logs-{'-'.join(name.split()[1:])}"  # (each server's log file of its own)
            args.logs.mkdir(exist_ok=True)
            servers[name] = start_shoal(hf, args)
        for proc, url in servers.values():
            wait_ready(url, proc, timeout=600)
        runs = {name: [] for name in servers}
        for _, url in servers.values():  # warm-up: a batch at full width each
            asyncio.run(drive(url, prompts[:args.concurrency], args))
        for i in range(args.rounds):
            for name, (_, url) in servers.items():
                run = asyncio.run(drive(url, prompts, args))
                runs[name].append(run)
                print(f"round {i + 1} {name}: {run['rate']:.1f} tok/s, load average {run['load']}", flush=True)
        memory = {name: tree_memory_mib(proc.pid) for name, (proc, _) in servers.items()}
    finally:
        for proc, _ in servers.values():
            stop(proc)
    print(f"\n{args.requests} requests at concurrency {args.concurrency}, prompts of {args.min_prompt}-"
          f"{args.max_prompt} tokens, {args.output_len} output tokens; {args.rounds} rounds\n")
    print("| server | tok/s per round | median | memory, process tree (MiB): RSS / PSS | its largest process (RSS) |")
    print("| --- | --- | ---: | ---: | ---: |")
    for name, rounds in runs.items():
        rates, m = [r["rate"] for r in rounds], memory[name]
        print(f"| {name} | {' / '.join(f'{x:.1f}' for x in rates)} | {statistics.median(rates):.1f} | "
              f"{m['rss']:.0f} / {m['pss']:.0f} | {m['engine']:.0f} |")
    for name in (n for n in runs if n.startswith(("shoal int8", "shoal w8a8_int8"))):
        for other, target in ((llama, 1.5), ("shoal bf16", 1.3)):
            if other not in runs:
                continue
            ratios = [a["rate"] / b["rate"] for a, b in zip(runs[name], runs[other])]
            print(f"{name} / {other}: {' / '.join(f'{r:.2f}' for r in ratios)}, median "
                  f"{statistics.median(ratios):.2f}x (target >= {target}x)")
        if "shoal bf16" in memory:
            share = {k: memory[name][k] / memory["shoal bf16"][k] for k in ("rss", "pss", "engine")}
            print(f"memory {name} / shoal bf16 (target <= 60%): process tree RSS {share['rss']:.0%}, "
                  f"PSS {share['pss']:.0%}; the engine processes alone {share['engine']:.0%}")


TEXTS = [
    "The old lighthouse stood at the edge of the cliff for more than two hundred years. Every night "
    "its keeper climbed the narrow stairs to light the lamp.",
    "Photosynthesis is the process by which green plants turn sunlight into chemical energy.",
    "def add(a, b):\n    \"\"\"Return the sum of a and b.\"\"\"\n    return a + b\n",
    "To reset your password, open the settings page and choose the security tab. Click the button "
    "labeled change password and enter your current password.",
    "Honey bees live in colonies that can hold tens of thousands of workers. Each colony has a single "
    "queen who lays all the eggs.",
    "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is",
]


# What each quality row runs: (an int4 checkpoint written from the float model by
# tests/checkpoints.py int4_copies, or None), engine options, environment. The int4 copies round
# to nearest on GPTQ's grid (no calibration: what GPTQ / AWQ add on top is not measured here), in
# each writer's layout; SmolLM2's hidden size 576 is not a multiple of 128: groups of 64.
FORMATS = {
    "int8": (None, {"quantization": "int8"}, {}),
    "w8a8_int8": (None, {"quantization": "w8a8_int8"}, {}),  # int8 weights x per-token int8 activations
    "fp8": (None, {"quantization": "fp8"}, {}),  # weight-only, as on CPU
    "fp8-dynamic": (None, {"quantization": "fp8"}, {"SHOAL_FP8_ACTIVATIONS": "1"}),  # a GPU's per-token FP8 activations
    "kv-fp8": (None, {"kv_cache_dtype": "fp8"}, {}),  # weights float, the KV cache e4m3 (scales 1.0)
    "gptq-int4-g64-sym": (("gptq", dict(group_size=64, sym=True)), {}, {}),
    "awq-int4-g64": (("awq", dict(group_size=64, sym=False)), {}, {}),
    "compressed-tensors-int4-channel": (("compressed-tensors", dict(group_size=-1, sym=True)), {}, {}),
}


def quality(args) -> None:
    import tempfile

    from checkpoints import int4_copies
    from smollm2 import smollm2_checkpoint

    from actors.engine.llm import LLM
    from actors.sampling_params import SamplingParams

    path = args.model or str(smollm2_checkpoint())
    params = SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0)

    def score(where: str, options: dict, env: dict) -> list:
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            llm = LLM(where, dtype="float32", eager_decode=True, **options)
            prompts = [llm.encode(t) for t in TEXTS]
            rows = [o.prompt_logprobs for o in llm.generate(prompts, params)]
            llm.shutdown()
            return rows
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)

    reference = score(path, {}, {})
    print(f"model: {path}; {len(TEXTS)} texts")
    print("| format | top-1 agreement with float32 | mean abs delta log p(next token) | max |")
    print("| --- | ---: | ---: | ---: |")
    for name in args.formats.split(","):
        written, options, env = FORMATS[name]
        with tempfile.TemporaryDirectory(prefix="shoal-quality-") as tmp:  # an int4 copy: ~0.5 GB
            where = path if written is None else str(int4_copies(path, Path(tmp), written[0], **written[1])["packed"])
            rows = score(where, options, env)
        agree = total = 0
        deltas = []
        for ref_rows, q_rows in zip(reference, rows):
            for ref, q in zip(ref_rows, q_rows):
                if ref is None:
                    continue
                actual = next(iter(ref))  # the prompt's own next token comes first
                agree += max(ref, key=ref.get) == max(q, key=q.get)
                total += 1
                deltas.append(abs(ref[actual] - q[actual]))
        print(f"| {name} | {agree / total:.1%} of {total} | {statistics.mean(deltas):.4f} | {max(deltas):.3f} |")


def kernel(args) -> None:
    import time

    import torch

    from kernels import linear, packed_weights
    from kernels.quantization import (_cpu_linear, packed_int8_exact, prepack_w8a8, quantize, w8a8_cpu_kernel,
                                      w8a8_layout, w8a8_linear, w8a8_weight)

    torch.set_num_threads(args.threads)
    h, i = QWEN_05B["hidden_size"], QWEN_05B["intermediate_size"]
    shapes = {"qkv": (h + 2 * 128, h), "o": (h, h), "gate_up": (2 * i, h), "down": (h, i)}
    pick = "min" if args.best else "median"
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, {args.threads} threads; ms per call ({pick} of 15); "
          f"w8a8: int8 x int8 through the kernel the engine picks here, w8a8_int8-{w8a8_cpu_kernel()}")
    # Where the engine runs shoal's own int8 x int8 kernel, oneDNN's prepacked linear beside it
    onednn = w8a8_cpu_kernel() in ("vnni", "avx2") and packed_int8_exact()
    print("| projection [N, K] | rows | float32 | int8 | fp8 | w8a8 | float32 / int8 | float32 / fp8 | float32 / w8a8 "
          "| int8 / w8a8 |" + (" w8a8, oneDNN prepacked | oneDNN / w8a8 |" if onednn else ""))
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |" + (" ---: | ---: |" if onednn else ""))

    def timed(fn):
        fn()
        times = []
        for _ in range(15):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        # min: on a machine shared with other jobs the median can be a preempted call
        return (min(times) if args.best else statistics.median(times)) * 1e3

    for name, (n, k) in shapes.items():
        w = torch.randn(n, k)
        int8, fp8 = quantize(w, "int8"), quantize(w, "fp8")
        rows, scale = quantize(w, "w8a8_int8", panels=False)
        w8a8 = w8a8_weight(rows, w8a8_layout(rows.shape, torch.device("cpu"))), scale.view(1, -1)
        if w8a8_cpu_kernel() == "onednn-packed":
            prepack_w8a8(w8a8[0], 32)
        if onednn:
            packed_weights.keep(rows, torch.ops.onednn.qlinear_prepack(rows, [32, k]))
        for m in (1, 8, 32, 256):
            x = torch.randn(m, k)
            f32 = timed(lambda: linear.linear(x, w))
            q8, f8 = (timed(lambda: _cpu_linear(x, *q, None)) for q in (int8, fp8))
            a8 = timed(lambda: w8a8_linear(x, *w8a8, None))
            line = (f"| {name} [{n}, {k}] | {m} | {f32:.3f} | {q8:.3f} | {f8:.3f} | {a8:.3f} | {f32 / q8:.2f}x | "
                    f"{f32 / f8:.2f}x | {f32 / a8:.2f}x | {q8 / a8:.2f}x |")
            if onednn:
                d8 = timed(lambda: w8a8_linear(x, rows, scale.view(1, -1), None))
                line += f" {d8:.3f} | {d8 / a8:.2f}x |"
            print(line)


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="what", required=True)
    s = sub.add_parser("speed")
    s.add_argument("--llama-server", required=True)
    s.add_argument("--llama-cpp", type=Path, help="llama.cpp's source (its converter): the Q8_0 GGUF of the "
                   "Qwen2.5-0.5B shape; not needed with --gguf")
    s.add_argument("--gguf", type=Path, help="a GGUF file both servers serve (llama-server as it is, shoal "
                   "dequantised as it loads) instead of the Qwen2.5-0.5B shape")
    s.add_argument("--llama-threads", type=int, default=2)
    s.add_argument("--formats", default="int8,bf16", help=f"comma-separated shoal servers: {', '.join(SHOAL_SERVERS)}")
    add_workload_args(s)
    s.set_defaults(requests=64, output_len=32, root=Path("/tmp/shoal-bench-int8"))
    q = sub.add_parser("quality")
    q.add_argument("--model")
    q.add_argument("--formats", default=",".join(FORMATS), help="comma-separated names of FORMATS")
    k = sub.add_parser("kernel")
    k.add_argument("--threads", type=int, default=2)
    k.add_argument("--best", action="store_true", help="min of 15 instead of the median (a shared machine)")
    args = ap.parse_args()
    {"speed": speed, "quality": quality, "kernel": kernel}[args.what](args)


if __name__ == "__main__":
    sys.exit(main())
