"""The engine options every engine-running command shares (`serve`, `run-batch`, `chat
--model-path`, `bench throughput`), under the names areno/vLLM/SGLang users already type.

Options default to SUPPRESS, so the namespace holds only what the user typed and
`engine_overrides` can be layered over YAML or environment defaults. A leaf: it imports
nothing from app.cli, so every subcommand module can use it.
"""
from __future__ import annotations

import argparse
import sys

from actors.config import CHECKPOINT_FORMATS, QUANTIZATIONS, EngineConfig
from app.config import ALIASES, NEGATED_ALIASES, VALUE_ALIASES

DTYPE_ALIASES = VALUE_ALIASES["dtype"]
SINGLE_DASH = ("tp", "pp")  # aliases that also take one dash, as vLLM's -tp and -pp


def dtype_arg(value: str) -> str:
    return DTYPE_ALIASES.get(value, value)


def option_flags(name: str) -> list[str]:
    """Every command-line spelling of an option: tp_size -> --tp-size --tensor-parallel-size
    --tp -tp (the aliases from app/config.py ALIASES)."""
    spellings = (name, *ALIASES.get(name, ()))
    return [f"--{s.replace('_', '-')}" for s in spellings] + \
        [f"-{s}" for s in spellings if s in SINGLE_DASH]


def add_option(group, flag: str, **kwargs) -> None:
    """The option `flag` (--canonical-name) under all its spellings, defaulting to SUPPRESS;
    its negated aliases (--disable-radix-cache) store False."""
    name = flag.removeprefix("--").replace("-", "_")
    group.add_argument(*option_flags(name), dest=name, default=argparse.SUPPRESS, **kwargs)
    for alias in NEGATED_ALIASES.get(name, ()):
        group.add_argument(f"--{alias.replace('_', '-')}", dest=name, action="store_false",
                           default=argparse.SUPPRESS, help=f"the same as --no-{flag[2:]}")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Every EngineConfig field, under the names areno/vLLM/SGLang users already type."""
    group = parser.add_argument_group("engine")

    def add(flag, **kwargs):
        add_option(group, flag, **kwargs)

    add("--model-path", metavar="DIR",
        help="Hugging Face checkpoint directory, or a llama.cpp .gguf file (default: the bundled demo model)")
    add("--tokenizer", metavar="DIR",
        help="the tokenizer of another checkpoint (a directory, a cached repo id or a .gguf), e.g. the "
             "original release's beside a GGUF (default: the model's own)")
    add("--dtype", type=dtype_arg, choices=["auto", "float32", "bfloat16", "float16"],
        help=f"weight and activation dtype (also {', '.join(DTYPE_ALIASES)})")
    add("--quantization", choices=[*QUANTIZATIONS, *CHECKPOINT_FORMATS],
        help="int8 / fp8 (e4m3): 8-bit linear layers, quantized from the checkpoint as it loads "
             "(per output channel; weight-only on CPU; fp8 multiplies in FP8 on GPUs that have "
             "it, with per-token activation scales); w8a8_int8: int8 weights times int8 "
             "activations quantized per token. Quantized checkpoints (GPTQ, AWQ, compressed-tensors, "
             "FP8, MXFP4, NVFP4, GGUF) need no option; naming their format (gptq, awq_marlin, gguf, ...) checks it "
             "(docs/quantization.md)")
    add("--device", choices=["auto", "cpu", "cuda"])
    add("--seed", type=int, metavar="N",
        help="torch.manual_seed at engine start-up: seeds the global generator that requests "
             "without their own seed sample from, so their output also depends on what ran "
             "before them (default 0)")
    add("--max-model-len", type=int, metavar="N",
        help="context length (default: from the checkpoint)")
    add("--block-size", type=int, metavar="N",
        help="tokens per KV cache block (default 16; 256 when the flash backend is flash-attn)")
    add("--num-kv-blocks", type=int, metavar="N",
        help="KV cache size in blocks (overrides the memory-based size)")
    add("--kv-cache-memory", type=float, metavar="GIB",
        help="KV cache size in GiB (overrides --gpu-memory-utilization / --kv-cache-fraction)")
    add("--kv-cache-fraction", type=float, metavar="FRACTION",
        help="CPU: fraction of the available RAM for the KV cache (default 0.3)")
    add("--gpu-memory-utilization", type=float, metavar="FRACTION",
        help="CUDA: fraction of each GPU's total memory this engine may use for weights, "
             "activations (measured by a profiling forward), CUDA graphs and the KV cache, "
             "which gets what is left, as in vLLM (default 0.9)")
    add("--kv-cache-dtype", choices=["auto", "fp8", "fp8_e4m3"],
        help="auto: cache K/V in the model's dtype (default); fp8 (= fp8_e4m3): one byte per "
             "element, float8 e4m3 with one K and one V scale per layer, read from the checkpoint "
             "(k_scale / v_scale) or 1.0: about twice the blocks of bf16 in the same memory "
             "(docs/quantization.md)")
    add("--mamba-cache-dtype", choices=["auto", "float32", "bfloat16", "float16"],
        help="hybrid models (Qwen3.5, Granite 4.0-H, Nemotron-H, LFM2): the per-sequence states' dtype, "
             "the convolutions' and, unless --mamba-ssm-cache-dtype says otherwise, the recurrent "
             "states' (auto: the model's dtype for the convolutions)")
    add("--mamba-ssm-cache-dtype", choices=["auto", "float32", "bfloat16", "float16"],
        help="hybrid models: the recurrent states' dtype (auto: --mamba-cache-dtype's if set, else the "
             "checkpoint's mamba_ssm_cache_dtype, else float32); SGLang's --mamba-ssm-dtype")
    add("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
        help="reuse KV blocks of shared prompt prefixes (default: on)")
    add("--max-num-batched-tokens", type=int, metavar="N", help="token budget of one engine step")
    add("--max-num-seqs", type=int, metavar="N", help="most sequences running at once")
    add("--itl-target-ms", type=float, metavar="MS",
        help="while streams decode, size each step's prompt chunks so the step takes about MS "
             "milliseconds, the time between a stream's tokens (default: 75 on CPU, off on "
             "CUDA; 0: off, each step takes up to --max-num-batched-tokens)")
    add("--scheduling-policy", choices=["fcfs", "priority"])
    add("--max-queued-requests", type=int, metavar="N",
        help="requests that may wait to start, per replica; more get 429 (default 256)")
    add("--attn-backend", choices=["auto", "native", "flash", "triton"],
        help="attention kernels: flash (vllm-flash-attn or flash-attn on an Ampere+ GPU, 16-bit "
             "dtypes; where it can't run, native with one warning), native (torch; the C++ decode "
             "kernel on CPU), or auto (default: flash where it runs, else native, silently)")
    add("--eager-decode", action="store_true",
        help="run decode steps eagerly: without CUDA graphs on a GPU, without torch.compile on "
             "CPU (vLLM's --enforce-eager; no background compile job on CPU)")
    add("--async-scheduling", action=argparse.BooleanOptionalAction,
        help="make each step's outputs (detokenizing, stop strings, deltas) while the next step "
             "runs on the GPU; they leave one step later (default: on with CUDA, off on CPU; "
             "SGLang's --disable-overlap-schedule turns it off)")
    add("--cuda-graph-sizes", type=int, nargs="+", metavar="N",
        help="CUDA: decode batch sizes captured as graphs: one N means 1, 2, 4, 8, 16, ... up to "
             "N; several mean those sizes (default: up to min(2 x --max-num-seqs, 512)); never "
             "above --max-num-seqs")
    add("--max-seq-len-to-capture", type=int, metavar="N",
        help="CUDA: decodes with a longer context than N run eagerly (default 8192)")
    add("--num-threads", type=int, metavar="N",
        help="torch intra-op threads of rank 0 (default: under Ray Serve, the CPUs Ray gives the "
             "scheduler actor, --shard-cpus rounded, at least 1; in-process engines (run-batch, "
             "chat --model-path, bench throughput) keep torch's default). Shard ranks 1.. use "
             "int(--shard-cpus), at least 1")
    add("--watchdog-timeout", type=float, metavar="S",
        help="seconds one engine step may take before the replica is declared dead and "
             "replaced (default 300; 0: off)")
    add("--tp-size", type=int, metavar="N", help="tensor parallel ranks")
    add("--pp-size", type=int, metavar="N", help="pipeline parallel stages")
    add("--pp-layer-split", metavar="N,N,...", help="layers per pipeline stage (default: even)")
    add("--placement-strategy", choices=["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"],
        help="of each model instance's placement group (default: STRICT_PACK if a node fits it, else PACK)")
    add("--shard-cpus", type=float, metavar="N",
        help="CPUs (and torch threads) of each shard rank, the scheduler's included (default 1)")
    add("--shard-gpus", type=float, metavar="N",
        help="GPUs of each shard rank (default: 1 when the engine runs on CUDA, else 0)")
    add("--dist-timeout", type=float, metavar="S",
        help="seconds for shard ranks to start and join, and for one step's collectives; "
             "idle ranks wait without a deadline (default 120)")
    add("--enable-expert-parallel", action=argparse.BooleanOptionalAction,
        help="MoE models: split the experts over the tensor-parallel ranks instead of their width")
    add("--ep-size", type=int, metavar="N",
        help="expert parallel ranks: 1, or --tp-size (then the same as "
             "--enable-expert-parallel)")
    add("--num-redundant-experts", type=int, metavar="K",
        help="extra expert slots holding copies of the hottest experts")
    add("--eplb-window-size", type=int, metavar="STEPS",
        help="steps of per-expert routed-token counts kept for /stats and re-planning")
    add("--eplb-step-interval", type=int, metavar="STEPS",
        help="re-plan the expert placement every N steps (0: never)")
    add("--enable-lora", action=argparse.BooleanOptionalAction,
        help="serve LoRA adapters: allocate --max-loras adapter slots and accept "
             "/v1/load_lora_adapter (implied by --lora-modules)")
    add("--lora-modules", nargs="+", metavar="NAME=PATH",
        help="PEFT LoRA adapters to register at start (a request names one in `model`); "
             "vLLM's JSON form {\"name\": ..., \"path\": ...} works too")
    add("--max-loras", type=int, metavar="N",
        help="adapter slots: distinct adapters in one batch; more registered adapters take "
             "turns, least recently used first (default 1)")
    add("--max-lora-rank", type=int, metavar="R", help="the largest adapter rank accepted (default 16)")
    add("--speculative-config", metavar="JSON",
        help="speculative decoding, vLLM's JSON: '{\"method\": \"ngram\", "
             "\"num_speculative_tokens\": 3, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}' "
             "(optional \"disable_by_batch_size\": no drafts above that many running "
             "sequences); see docs/speculative-decoding.md")
    for what, name in (("time to first token", "ttft"), ("inter-token latency", "itl"),
                       ("end-to-end latency", "e2e")):
        add(f"--metrics-{name}-buckets", metavar="S,S,...",
            help=f"histogram buckets (seconds) of the {what} metric (default: built in)")
    vllm = parser.add_argument_group("vLLM's options for what shoal does one way (a vLLM command line runs "
                                     "unchanged; another value is refused)")
    add_option(vllm, "--trust-remote-code", action="store_true",
               help="let a tokenizer run its own code (shoal runs its own model code whatever the checkpoint says)")
    add_option(vllm, "--load-format", choices=["auto", "safetensors", "pt", "gguf"],
               help="accepted: the checkpoint's own files decide")
    add_option(vllm, "--tokenizer-mode", choices=["auto", "hf"], help="accepted: transformers' tokenizer")
    add_option(vllm, "--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
               help="accepted: prompts are always chunked")
    add_option(vllm, "--distributed-executor-backend", choices=["ray"], help="accepted: shards are Ray actors")
    add_option(vllm, "--cpu-offload-gb", type=float, metavar="GIB", help="accepted at 0: weights stay on the device")
    add_option(vllm, "--swap-space", type=float, metavar="GIB",
               help="accepted: a preempted request is recomputed, never swapped to CPU memory")


def engine_overrides(args: argparse.Namespace) -> dict:
    """The engine options the user actually gave."""
    return {k: v for k, v in vars(args).items() if k in EngineConfig.field_names()}


def engine_config_from_args(args: argparse.Namespace, base: dict | None = None) -> EngineConfig:
    """EngineConfig from defaults, then `base` (e.g. a YAML file), then the command line."""
    config = EngineConfig(**{**(base or {}), **engine_overrides(args)})
    config.validate()
    return config


def engine_config_or_exit(args: argparse.Namespace) -> EngineConfig:
    try:
        return engine_config_from_args(args)
    except (TypeError, ValueError) as exc:  # a bad option value: one line, not a traceback
        sys.exit(f"shoal {args.command}: error: {exc}")
