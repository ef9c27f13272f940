"""The engine options every engine-running command shares (`serve`, `run-batch`, `chat
--model-path`, `bench throughput`), under the names areno/vLLM/SGLang users already type.

Options default to SUPPRESS, so the namespace holds only what the user typed and
`engine_overrides` can be layered over YAML or environment defaults. A leaf: it imports
nothing from app.cli, so every subcommand module can use it.
"""
from __future__ import annotations

import argparse
import sys

from actors.config import EngineConfig

DTYPE_ALIASES = {"half": "float16", "fp16": "float16", "bf16": "bfloat16", "float": "float32",
                 "fp32": "float32"}


def dtype_arg(value: str) -> str:
    return DTYPE_ALIASES.get(value, value)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Every EngineConfig field, under the names areno/vLLM/SGLang users already type."""
    group = parser.add_argument_group("engine")

    def add(*names, **kwargs):
        group.add_argument(*names, default=argparse.SUPPRESS, **kwargs)

    add("--model-path", "--model", "--model-name-or-path", dest="model_path", metavar="DIR",
        help="Hugging Face checkpoint directory (default: the bundled demo model)")
    add("--dtype", type=dtype_arg, choices=["auto", "float32", "bfloat16", "float16"],
        help="weight and activation dtype (also half, bf16, float)")
    add("--device", choices=["auto", "cpu", "cuda"])
    add("--seed", type=int, metavar="N", help="seed for requests that set none")
    add("--max-model-len", type=int, metavar="N",
        help="context length (default: from the checkpoint)")
    add("--block-size", type=int, metavar="N", help="tokens per KV cache block")
    add("--num-kv-blocks", "--num-gpu-blocks-override", dest="num_kv_blocks", type=int,
        metavar="N", help="KV cache size in blocks (overrides the memory-based size)")
    add("--kv-cache-memory", type=float, metavar="GIB", help="KV cache size in GiB")
    add("--kv-cache-fraction", "--gpu-memory-utilization", "--mem-fraction-static",
        dest="kv_cache_fraction", type=float, metavar="FRACTION",
        help="fraction of free memory for the KV cache")
    add("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
        help="reuse KV blocks of shared prompt prefixes")
    add("--disable-radix-cache", dest="enable_prefix_caching", action="store_false",
        help="SGLang spelling of --no-enable-prefix-caching")
    add("--max-num-batched-tokens", "--chunked-prefill-size", dest="max_num_batched_tokens",
        type=int, metavar="N", help="token budget of one engine step")
    add("--max-num-seqs", "--max-running-prompts", "--max-running-requests",
        dest="max_num_seqs", type=int, metavar="N", help="most sequences running at once")
    add("--scheduling-policy", choices=["fcfs", "priority"])
    add("--max-queued-requests", type=int, metavar="N",
        help="refuse new requests while this many are waiting (default: no limit)")
    add("--attn-backend", "--attention-backend", dest="attn_backend",
        choices=["native", "flash"])
    add("--num-threads", type=int, metavar="N",
        help="torch intra-op threads (default: all cores)")
    add("--tp-size", "--tensor-parallel-size", "--tp", "-tp", dest="tp_size", type=int,
        metavar="N", help="tensor parallel ranks")
    add("--pp-size", "--pipeline-parallel-size", "--pp", "-pp", dest="pp_size", type=int,
        metavar="N", help="pipeline parallel stages")
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
    add("--enable-expert-parallel", "--enable-ep", dest="enable_expert_parallel",
        action=argparse.BooleanOptionalAction,
        help="MoE models: split the experts over the tensor-parallel ranks instead of their width")
    add("--ep-size", "--expert-parallel-size", "--ep", dest="ep_size", type=int, metavar="N",
        help="expert parallel ranks; must equal --tp-size (implies --enable-expert-parallel)")
    add("--num-redundant-experts", "--ep-num-redundant-experts", dest="num_redundant_experts",
        type=int, metavar="K", help="extra expert slots holding copies of the hottest experts")
    add("--eplb-window-size", type=int, metavar="STEPS",
        help="steps of per-expert routed-token counts kept for /stats and re-planning")
    add("--eplb-step-interval", "--eplb-rebalance-num-iterations", dest="eplb_step_interval",
        type=int, metavar="STEPS", help="re-plan the expert placement every N steps (0: never)")
    for what, name in (("time to first token", "ttft"), ("inter-token latency", "itl"),
                       ("end-to-end latency", "e2e")):
        add(f"--metrics-{name}-buckets", metavar="S,S,...",
            help=f"histogram buckets (seconds) of the {what} metric (default: built in)")


def engine_overrides(args: argparse.Namespace) -> dict:
    """The engine options the user actually gave."""
    return {k: v for k, v in vars(args).items() if k in EngineConfig.field_names()}


def engine_config_from_args(args: argparse.Namespace, base: dict | None = None) -> EngineConfig:
    """EngineConfig from defaults, then `base` (e.g. a YAML file), then the command line."""
    config = EngineConfig(**{**(base or {}), **engine_overrides(args)})
    config.validate()
    return config


def engine_config_or_exit(args: argparse.Namespace, base: dict | None = None) -> EngineConfig:
    try:
        return engine_config_from_args(args, base)
    except (TypeError, ValueError) as exc:  # a bad option value: one line, not a traceback
        sys.exit(f"shoal {args.command}: error: {exc}")
