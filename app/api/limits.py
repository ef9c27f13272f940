"""Request limits, checked on the parsed body before any templating or tokenizing, so an
oversized request costs the server almost nothing. Each is a ServerSettings option, and a
request over one gets a 400 naming the field (the body size: 413, in the middleware)."""
from __future__ import annotations

import json

from app.api.errors import ApiError


def check(body, settings) -> None:
    """Raise ApiError for the first limit `body` (any request model) goes over."""
    s = settings
    _at_most("best_of", getattr(body, "best_of", None) or 0, s.max_n, "samples (best_of)")
    _at_most("n", getattr(body, "n", 1), s.max_n, "samples (n)")
    for field in ("prompt", "prompts", "input"):  # input: /v1/embeddings
        prompts = getattr(body, field, None)
        if isinstance(prompts, list) and prompts and not isinstance(prompts[0], int):
            _at_most(field, len(prompts), s.max_prompts, "prompts")
        if prompts is not None:
            _at_most(field, _chars(prompts), s.max_input_chars, "characters of prompt text")
    messages = getattr(body, "messages", None)
    if messages is not None:
        _at_most("messages", len(messages), s.max_messages, "messages")
        _at_most("messages", sum(_chars(m.content) for m in messages), s.max_input_chars,
                 "characters of message text")
    _at_most("logit_bias", len(getattr(body, "logit_bias", None) or {}), s.max_logit_bias, "logit_bias entries")
    top = getattr(body, "top_logprobs", None)
    if top is None and isinstance(getattr(body, "logprobs", None), int):
        top = body.logprobs  # completions: logprobs is the number of alternatives
    _at_most("top_logprobs" if hasattr(body, "top_logprobs") else "logprobs", top or 0,
             s.max_top_logprobs, "alternatives per token")
    if s.max_tokens_cap is not None:
        for field in ("max_tokens", "max_completion_tokens"):
            _at_most(field, getattr(body, field, None) or 0, s.max_tokens_cap, "tokens")
    _check_stop(getattr(body, "stop", None), s)
    _check_tools(getattr(body, "tools", None), s)


def _check_stop(stop, s) -> None:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    _at_most("stop", len(stops), s.max_stop, "stop strings")
    _at_most("stop", max(map(len, stops), default=0), s.max_stop_chars, "characters in a stop string")


def _check_tools(tools, s) -> None:
    if not tools:
        return
    _at_most("tools", len(tools), s.max_tools, "tools")
    biggest = max(len(json.dumps(t.function.parameters or {})) for t in tools)
    _at_most("tools", biggest, s.max_tool_schema_bytes, "bytes in a tool's parameter schema")


def _at_most(field: str, value: int, limit: int, what: str) -> None:
    if value > limit:
        raise ApiError(400, f"{field}: {value} {what} is over this server's limit of {limit}",
                       param=field, code="limit_exceeded")


def _chars(value) -> int:
    """Characters of text in a prompt, a list of prompts, or a message's content."""
    if value is None or isinstance(value, int):
        return 0
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(_chars(v) for v in value)
    return len(getattr(value, "text", "") or "")
