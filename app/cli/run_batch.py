"""`shoal run-batch`: an OpenAI Batch API input file through one engine, offline.

Every valid line is queued before the engine starts, so continuous batching runs them
together; results come back one line per input line, in input order. A bad line gets an
error result (as OpenAI's batch output has) and never stops the others.
"""
from __future__ import annotations

import json
import logging
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from actors.logs import setup_logging
from actors.pooling_params import PoolingParams
from actors.sampling_params import SamplingParams
from app.protocol.chat_output import OutputPlan, constraint, plan_output, tools_in_use
from app.protocol.chat_template import render_chat_prompt
from app.protocol.embeddings import EmbeddingRequest, check_input_length, embedding_response
from app.protocol.generation_defaults import model_sampling_defaults, with_model_defaults
from app.protocol.model_parsers import with_model_parsers
from app.protocol.models import (
    ChatCompletionRequest, CompletionRequest, error_body, request_error_body, validation_error_body,
)
from app.protocol.responses import chat_response, completion_response

log = logging.getLogger("shoal.run_batch")

ENDPOINTS = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
             "/v1/embeddings": EmbeddingRequest}


@dataclass
class BatchItem:
    """One input line on its way through: parsed, submitted, then answered."""
    line_no: int
    custom_id: str | None = None
    url: str | None = None
    request: ChatCompletionRequest | CompletionRequest | EmbeddingRequest | None = None
    error: dict | None = None  # a 400 body: the line parsed but the request is invalid
    line_error: dict | None = None  # the line itself is unusable (not JSON, not an object)
    engine_ids: list[str] = field(default_factory=list)  # one per prompt
    plan: OutputPlan | None = None  # chat: how the output splits into reasoning, tool calls
    request_id: str = field(default_factory=lambda: f"req_{uuid.uuid4().hex}")


@dataclass
class BatchOptions:
    model_name: str
    default_max_tokens: int | None = None
    disable_thinking: bool = False
    tool_call_parser: str | None = None  # as `shoal serve`'s (None: from the chat template)
    reasoning_parser: str | None = None
    sampling_defaults: dict = field(default_factory=dict)  # the model's generation_config.json values


# --------------------------------------------------------------------------- parsing

def parse_line(line_no: int, text: str) -> BatchItem:
    item = BatchItem(line_no)
    try:
        line = json.loads(text)
    except json.JSONDecodeError as exc:
        item.line_error = {"code": "invalid_json", "message": f"line {line_no}: {exc}"}
        return item
    if not isinstance(line, dict):
        item.line_error = {"code": "invalid_request", "message": f"line {line_no}: not an object"}
        return item
    item.custom_id, item.url = line.get("custom_id"), line.get("url")
    item.error = parse_request(item, line)
    return item


def parse_request(item: BatchItem, line: dict) -> dict | None:
    """Validate method, url and body; returns an error body or None (and sets item.request)."""
    if line.get("method", "POST") != "POST":
        return error_body(f"method must be POST, got {line.get('method')!r}", param="method")
    if item.url not in ENDPOINTS:
        return error_body(f"url must be one of {sorted(ENDPOINTS)}, got {item.url!r}",
                          param="url")
    if not isinstance(line.get("body"), dict):
        return error_body("body must be a JSON object", param="body")
    try:
        item.request = ENDPOINTS[item.url].model_validate(line["body"])
    except ValidationError as exc:
        return validation_error_body(exc)
    return None


# --------------------------------------------------------------------------- submitting

def prompt_ids(llm, item: BatchItem, opts: BatchOptions) -> list[list[int]]:
    """The line's prompts; a chat line also gets its output plan (as the server makes it)."""
    request = item.request
    if isinstance(request, ChatCompletionRequest):
        text, ids = render_chat_prompt(llm.tokenizer, request.messages,
                                       request.tools if tools_in_use(request) else None,
                                       request.add_generation_prompt,
                                       request.template_kwargs(), opts.disable_thinking)
        item.plan = plan_output(opts, llm.tokenizer, request, text)
        return [ids]
    return [llm.encode(prompt) for prompt in request.prompts()]


def submit(llm, item: BatchItem, opts: BatchOptions) -> None:
    """Queue every prompt of a valid line; any refusal turns the whole line into a 400."""
    try:
        if isinstance(item.request, EmbeddingRequest):
            return submit_embedding(llm, item)
        prompts = prompt_ids(llm, item, opts)
        fields = constraint(item.request, item.plan)  # structured outputs, forced tool calls
        request = with_model_defaults(item.request, opts.sampling_defaults)  # as `shoal serve` does
        params = [request.to_sampling_params(opts.default_max_tokens, llm.max_model_len, len(ids), **fields)
                  for ids in prompts]
        for i, (ids, p) in enumerate(zip(prompts, params)):
            engine_id = f"batch-{item.line_no}-{i}"
            llm.add_request(engine_id, ids, p, priority=item.request.priority)
            item.engine_ids.append(engine_id)
    except ValueError as exc:  # RequestError, template errors, engine refusals
        item.error = request_error_body(exc)


def submit_embedding(llm, item: BatchItem) -> None:
    """An embeddings line: one pooled request per input, as /v1/embeddings makes them."""
    prompts = [llm.encode(prompt) for prompt in item.request.prompts()]
    for ids in prompts:
        check_input_length(ids, llm.max_model_len)
    pooling = PoolingParams(dimensions=item.request.dimensions)
    for i, ids in enumerate(prompts):
        engine_id = f"batch-{item.line_no}-{i}"
        llm.add_request(engine_id, ids, SamplingParams(max_tokens=0), pooling=pooling)
        item.engine_ids.append(engine_id)


# --------------------------------------------------------------------------- results

def response_body(item: BatchItem, outputs: dict, tokenizer, opts: BatchOptions) -> dict:
    request, done = item.request, [outputs[rid] for rid in item.engine_ids]
    if isinstance(request, EmbeddingRequest):
        return embedding_response(done, opts.model_name, request.encoding_format).model_dump()
    if isinstance(request, ChatCompletionRequest):
        return chat_response(request, done[0], tokenizer, opts.model_name,
                             f"chatcmpl-{uuid.uuid4().hex}", plan=item.plan)
    return completion_response(request, done, tokenizer, opts.model_name,
                               f"cmpl-{uuid.uuid4().hex}")


def result_line(item: BatchItem, outputs: dict, tokenizer, opts: BatchOptions) -> dict:
    line = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": item.custom_id,
            "response": None, "error": None}
    if item.line_error is not None:
        line["error"] = item.line_error
    elif item.error is not None:
        line["response"] = {"status_code": 400, "request_id": item.request_id, "body": item.error}
    else:
        line["response"] = {"status_code": 200, "request_id": item.request_id,
                            "body": response_body(item, outputs, tokenizer, opts)}
    return line


def run_batch(llm, lines: list[str], opts: BatchOptions, use_tqdm: bool = True) -> list[dict]:
    """Result lines for the input lines (blank lines skipped), in input order."""
    items = [parse_line(no, text) for no, text in enumerate(lines, 1) if text.strip()]
    for item in items:
        if item.request is not None and item.error is None:
            submit(llm, item, opts)
    outputs = llm.run(use_tqdm=use_tqdm)
    return [result_line(item, outputs, llm.tokenizer, opts) for item in items]


def run_batch_file(args, config) -> int:
    """The `shoal run-batch` command: load the engine, run the file, write the results."""
    from actors.engine.llm import LLM  # torch and the engine load only when there is work

    setup_logging()
    lines = Path(args.input_file).read_text(encoding="utf-8").splitlines()
    options = {k: v for k, v in vars(config).items() if k != "model_path"}
    try:
        llm = LLM(config.model_path, **options)
    except (ValueError, FileNotFoundError) as exc:  # a checkpoint or settings it can't honour
        print(f"shoal run-batch: error: {exc}", file=sys.stderr, flush=True)
        return 1
    opts = BatchOptions(model_name=args.served_model_name or served_name(config.model_path),
                        default_max_tokens=args.default_max_tokens,
                        disable_thinking=args.disable_thinking,
                        tool_call_parser=args.tool_call_parser,
                        reasoning_parser=args.reasoning_parser)
    opts = with_model_parsers(opts, llm.engine.spec.path)  # the flags left unset: the model's
    opts.sampling_defaults = model_sampling_defaults(llm.engine.spec.path)
    start = time.perf_counter()
    results = run_batch(llm, lines, opts)
    write_jsonl(args.output_file, results)
    failed = sum(r["error"] is not None or r["response"]["status_code"] != 200 for r in results)
    log.info("%d requests (%d failed) in %.1f s -> %s", len(results), failed,
             time.perf_counter() - start, args.output_file)
    return 0


def served_name(model_path: str | None) -> str:
    return Path(model_path).name if model_path else "shoal-demo"


def write_jsonl(path: str, rows: list[dict]) -> None:
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    if path == "-":
        sys.stdout.write(text)
    else:
        Path(path).write_text(text, encoding="utf-8")
