"""`shoal` command line: the parser (one subparser function per subcommand, each in its own
module) and `main`.

Heavy imports (torch, the engine, Ray) happen inside the handlers to keep `--help` fast.
"""
from __future__ import annotations

import argparse
import atexit
import os
import sys
from typing import NoReturn

from actors.worker.process_tuning import openmp_env
from app.cli.bench.cli import add_bench_parser
from app.cli.chat import add_chat_parser, add_complete_parser
from app.cli.collect_env import add_collect_env_parser
from app.cli.drain import add_drain_parser
from app.cli.engine_args import add_engine_args, engine_config_or_exit
from app.cli.serve import add_serve_parser


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
                        help="tool-call format, as for `shoal serve` (default: the model's, "
                             "else from the chat template)")
    parser.add_argument("--reasoning-parser", metavar="NAME",
                        help="split reasoning into reasoning_content: qwen3, deepseek_r1, harmony, "
                             "gemma4 or none (default: the model's, as for `shoal serve`)")
    add_engine_args(parser)
    parser.set_defaults(handler=run_batch_command)


def run_batch_command(args: argparse.Namespace) -> NoReturn:
    from app.api.settings import check_parsers
    from app.cli.run_batch import run_batch_file
    try:
        check_parsers(args.tool_call_parser, args.reasoning_parser)
    except ValueError as exc:
        sys.exit(f"shoal run-batch: error: {exc}")
    exit_skipping_teardown(run_batch_file(args, engine_config_or_exit(args)))


def exit_skipping_teardown(code: int) -> NoReturn:
    """Exit once the work is written: the exit handlers run (Ray's shutdown, the compile job's
    stop, logging), the interpreter's teardown does not. That teardown clears torch's modules one
    by one with full collections over every object the engine process made (~0.8 s of a
    64-request run-batch, for nothing the results need)."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shoal", allow_abbrev=False,
                                     description="An LLM inference server on Ray.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_run_batch_parser(subparsers)
    add_serve_parser(subparsers)
    add_chat_parser(subparsers)
    add_complete_parser(subparsers)
    add_bench_parser(subparsers)
    add_collect_env_parser(subparsers)
    add_drain_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Before torch loads OpenMP: threads that spin only briefly at barriers, since the engine
    # shares its cores with Ray's processes (actors/executor/placement.py: OPENMP_ENV).
    os.environ.update(openmp_env())
    args = build_parser().parse_args(argv)
    return args.handler(args) or 0
