"""`shoal` command line: one subparser function per subcommand, shared engine options.

Engine options default to SUPPRESS, so the namespace holds only what the user typed and
`engine_overrides` can be layered over YAML or environment defaults.
Heavy imports (torch, the engine) happen inside the handlers to keep `--help` fast.
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


# --------------------------------------------------------------------------- subcommands

def add_run_batch_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "run-batch", allow_abbrev=False, help="run an OpenAI batch file (JSONL) offline",
        description="Run every request of an OpenAI Batch API input file on one engine "
                    "and write the results, one line per input line, in input order.")
    parser.add_argument("-i", "--input-file", required=True, help="batch input JSONL")
    parser.add_argument("-o", "--output-file", required=True, help="results JSONL")
    parser.add_argument("--served-model-name", metavar="NAME", help="model name in responses "
                                                    "(default: the checkpoint directory name)")
    parser.add_argument("--default-max-tokens", type=int, default=None, metavar="N",
                        help="budget for chat requests that set none (default: the context left)")
    parser.add_argument("--disable-thinking", action="store_true",
                        help="pass enable_thinking=False to chat templates that support it")
    parser.add_argument("--tool-call-parser", metavar="NAME",
                        help="tool-call format, as for `shoal serve` (default: from the chat template)")
    parser.add_argument("--reasoning-parser", metavar="NAME",
                        help="split <think> reasoning into reasoning_content: qwen3 or deepseek_r1")
    add_engine_args(parser)
    parser.set_defaults(handler=run_batch_command)


def engine_config_or_exit(args: argparse.Namespace, base: dict | None = None) -> EngineConfig:
    try:
        return engine_config_from_args(args, base)
    except (TypeError, ValueError) as exc:  # a bad option value: one line, not a traceback
        sys.exit(f"shoal {args.command}: error: {exc}")


def run_batch_command(args: argparse.Namespace) -> int:
    from app.run_batch import run_batch_file
    from app.api.settings import check_parsers
    try:
        check_parsers(args.tool_call_parser, args.reasoning_parser)
    except ValueError as exc:
        sys.exit(f"shoal run-batch: error: {exc}")
    return run_batch_file(args, engine_config_or_exit(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shoal", allow_abbrev=False,
                                     description="An LLM inference server on Ray.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_run_batch_parser(subparsers)
    from app.serve_cli import add_serve_parser  # the Ray side lives in its own module
    add_serve_parser(subparsers, add_engine_args)
    from app import chat_cli, collect_env  # client tools: each in its own module
    from app.bench.cli import add_bench_parser
    chat_cli.add_chat_parser(subparsers, add_engine_args)
    chat_cli.add_complete_parser(subparsers)
    add_bench_parser(subparsers, add_engine_args)
    collect_env.add_collect_env_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args) or 0


if __name__ == "__main__":
    sys.exit(main())
