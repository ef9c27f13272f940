"""`shoal bench serve` (load on a running server) and `shoal bench throughput` (the engine
in this process), with vLLM's option names."""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys

from app.cli.client import add_client_args, api_key, base_url, fail, model_name, openai_client
from app.cli.engine_args import add_engine_args, engine_config_or_exit


def add_bench_parser(subparsers) -> None:
    parser = subparsers.add_parser("bench", allow_abbrev=False,
                                   help="benchmark a server or the engine",
                                   description="Benchmark online serving or offline throughput.")
    kinds = parser.add_subparsers(dest="bench_command", required=True, metavar="KIND")
    add_serve_parser(kinds)
    add_throughput_parser(kinds)


def add_workload_args(parser: argparse.ArgumentParser, num_prompts_default, seed: bool) -> None:
    group = parser.add_argument_group("workload")
    default = num_prompts_default or "100, or unlimited with --duration"
    group.add_argument("--num-prompts", type=int, default=num_prompts_default, metavar="N",
                       help=f"requests to send (default {default})")
    group.add_argument("--input-len", type=int, default=128, metavar="N",
                       help="synthetic prompt length in tokens (default 128)")
    group.add_argument("--output-len", type=int, default=128, metavar="N",
                       help="tokens to generate per request (default 128)")
    group.add_argument("--dataset", "--dataset-path", dest="dataset", metavar="FILE.jsonl",
                       help="prompts, one JSON object a line: 'prompt' or 'messages', optional "
                            "'max_tokens' (default: synthetic prompts)")
    group.add_argument("--temperature", type=float, default=0.0, help="default 0: greedy")
    if seed:  # `bench throughput` has the engine's --seed, which seeds its prompts too
        group.add_argument("--seed", type=int, default=0,
                           help="seed of the synthetic prompts and arrivals")
    group.add_argument("--json", "--result-file", dest="json", metavar="FILE",
                       help="write the results as JSON")
    group.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def add_serve_parser(kinds) -> None:
    parser = kinds.add_parser("serve", allow_abbrev=False, help="load a running server over HTTP",
                              description="Stream requests to a running server and report "
                                          "throughput and TTFT / TPOT / ITL / E2E latency.")
    add_client_args(parser)
    parser.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                        help="/v1/completions (default) or /v1/chat/completions")
    parser.add_argument("--request-rate", type=float, default=math.inf, metavar="R",
                        help="Poisson arrivals at R requests/s (default inf: all at once)")
    parser.add_argument("--max-concurrency", type=int, default=None, metavar="N",
                        help="at most N requests in flight")
    parser.add_argument("--duration", type=float, default=None, metavar="S",
                        help="start no request after S seconds (in-flight ones finish)")
    parser.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                        help="let requests stop at end-of-sequence (default: exactly --output-len)")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="latency CDF and throughput over time (needs matplotlib: shoal[plot])")
    add_workload_args(parser, None, seed=True)
    parser.set_defaults(handler=bench_serve_command)


def add_throughput_parser(kinds) -> None:
    parser = kinds.add_parser("throughput", allow_abbrev=False,
                              help="offline throughput of the engine in this process",
                              description="Run every request at once on the in-process engine.")
    add_workload_args(parser, 64, seed=False)
    add_engine_args(parser)
    parser.set_defaults(handler=bench_throughput_command)


# --------------------------------------------------------------------------- serve

def check_bounded(args: argparse.Namespace) -> None:
    if args.num_prompts is None and args.duration is None:
        args.num_prompts = 100
    if args.num_prompts is None and math.isinf(args.request_rate) and not args.max_concurrency:
        sys.exit("shoal bench serve: error: --duration without --num-prompts needs "
                 "--request-rate or --max-concurrency (else it would start requests without end)")


def bench_serve_command(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from app.cli.bench.load import LoadPlan, run_load
    from app.cli.bench.prompts import bench_prompts
    from app.cli.bench.report import format_table, summarize, write_json

    check_bounded(args)
    if args.plot:
        from app.cli.bench.plot import require_matplotlib
        require_matplotlib()
    try:
        model = model_name(openai_client(args.url, api_key(args)), args.model_name)
        prompts = bench_prompts(args)
    except Exception as exc:
        return fail("bench serve", exc)
    plan = LoadPlan(url=base_url(args.url), model=model, endpoint=args.endpoint,
                    num_prompts=args.num_prompts, duration=args.duration,
                    request_rate=args.request_rate, max_concurrency=args.max_concurrency,
                    temperature=args.temperature, ignore_eos=args.ignore_eos, seed=args.seed,
                    api_key=api_key(args))
    bar = tqdm(total=args.num_prompts, unit="req", disable=args.disable_tqdm, file=sys.stderr)
    results, duration = asyncio.run(run_load(plan, prompts, on_done=lambda r: bar.update(1)))
    bar.close()
    summary = summarize(results, duration, config=plan_config(plan, args))
    print(format_table(summary))
    if args.json:
        write_json(summary, args.json)
    if args.plot:
        from app.cli.bench.plot import save_plot
        save_plot(results, duration, args.plot, title=f"{model}: shoal bench serve")
    return 0 if summary["completed"] else 1


def plan_config(plan, args: argparse.Namespace) -> dict:
    config = {k: v for k, v in vars(plan).items() if k != "api_key"}
    config["request_rate"] = None if math.isinf(plan.request_rate) else plan.request_rate
    return {**config, "input_len": None if args.dataset else args.input_len,
            "output_len": args.output_len, "dataset": args.dataset}


# --------------------------------------------------------------------------- throughput

def bench_throughput_command(args: argparse.Namespace) -> int:
    from actors.engine.llm import LLM
    from app.cli.bench.throughput import dataset_prompts, format_result, run_throughput, token_prompts

    config = engine_config_or_exit(args)
    llm = LLM(**vars(config))
    try:
        if args.dataset:
            prompts = dataset_prompts(llm.tokenizer, args.dataset, args.num_prompts,
                                      args.output_len)
        else:
            ids = token_prompts(llm.tokenizer, args.num_prompts, args.input_len, config.seed)
            prompts = [(p, args.output_len) for p in ids]
        result = run_throughput(llm, prompts, args.temperature, not args.disable_tqdm)
    finally:
        llm.shutdown()
    print(format_result(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**result, "config": {"model_path": config.model_path,
                                            "input_len": args.input_len,
                                            "output_len": args.output_len}}, f, indent=2)
    return 0
