"""Chat messages -> prompt token ids through the tokenizer's own chat template."""
from __future__ import annotations

import json
from typing import Any

import jinja2

from app.protocol.harmony import is_harmony_template
from app.protocol.harmony_turns import harmony_turns


def render_chat_prompt(tokenizer, messages, tools=None, add_generation_prompt: bool = True,
                       chat_template_kwargs: dict[str, Any] | None = None,
                       disable_thinking: bool = False) -> tuple[str, list[int]]:
    """(prompt text, token ids): output parsers read the text's tail (an open `<think>`).
    ValueError when the template can't render the chat."""
    text = render_chat_text(tokenizer, messages, tools, add_generation_prompt,
                            chat_template_kwargs, disable_thinking)
    # The template already wrote any BOS/role tokens; adding specials again would double them.
    return text, tokenizer.encode(text, add_special_tokens=False)


def render_chat_text(tokenizer, messages, tools=None, add_generation_prompt: bool = True,
                     chat_template_kwargs: dict[str, Any] | None = None,
                     disable_thinking: bool = False) -> str:
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this model's tokenizer has no chat template; use /v1/completions")
    kwargs = dict(chat_template_kwargs or {})
    if disable_thinking:
        kwargs.setdefault("enable_thinking", False)  # the request's own choice wins
    try:
        turns = [message_dict(m) for m in messages]
        if is_harmony_template(tokenizer.chat_template):
            turns = harmony_turns(turns)  # what gpt-oss's template can show
        return _apply(tokenizer, turns,
                      [tool_dict(t) for t in tools] if tools else None,
                      add_generation_prompt, kwargs)
    except (jinja2.TemplateError, TypeError, KeyError, IndexError) as exc:
        raise ValueError(f"chat template error: {exc}") from exc


def _apply(tokenizer, messages, tools, add_generation_prompt, kwargs) -> str:
    call = dict(tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False)
    try:
        return tokenizer.apply_chat_template(messages, **call, **kwargs)
    except TypeError:
        # A tokenizer whose apply_chat_template rejects unknown keywords: retry without the
        # thinking switch, which templates that don't know it would ignore anyway.
        if "enable_thinking" not in kwargs:
            raise
        kwargs = {k: v for k, v in kwargs.items() if k != "enable_thinking"}
        return tokenizer.apply_chat_template(messages, **call, **kwargs)


def message_dict(message) -> dict[str, Any]:
    """A plain dict for the template: text parts joined, tool-call arguments parsed, reasoning
    under both names templates use."""
    if hasattr(message, "model_dump"):
        message = message.model_dump(exclude_none=True)
    message = dict(message)
    content = message.get("content")
    if isinstance(content, list):
        message["content"] = "\n".join(part["text"] for part in content
                                       if part.get("type", "text") == "text")
    if message.get("tool_calls"):
        message["tool_calls"] = [_parsed_call(call) for call in message["tool_calls"]]
    _add_thinking(message)
    return message


def _add_thinking(message: dict[str, Any]) -> None:
    """Earlier reasoning also as `thinking`, the key gpt-oss's template reads (transformers 5
    does the same; older versions don't)."""
    if message.get("reasoning_content") and "thinking" not in message:
        message["thinking"] = message["reasoning_content"]


def _parsed_call(call: dict[str, Any]) -> dict[str, Any]:
    # HF templates iterate tool-call arguments as a mapping (as vLLM passes them).
    function = dict(call.get("function", {}))
    if isinstance(function.get("arguments"), str):
        try:
            function["arguments"] = json.loads(function["arguments"])
        except json.JSONDecodeError:
            pass  # leave non-JSON arguments as the string the client sent
    return {**call, "function": function}


def tool_dict(tool) -> dict[str, Any]:
    return tool.model_dump(exclude_none=True) if hasattr(tool, "model_dump") else dict(tool)
