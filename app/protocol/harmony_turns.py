"""Chat turns as harmony templates (gpt-oss's) can render them.

Harmony has one call per assistant message (`<|call|>` ends the turn), and gpt-oss's template
renders only an assistant turn's first call and names each tool result after the latest call.
An OpenAI turn with several calls (parallel calls, forced ones) therefore becomes one turn per
call, each followed by its result: the model sees every call with its own answer.
The template also shows a call turn's text as its analysis and refuses a turn with both text
and reasoning, so there the text joins the reasoning; and it cannot render a turn without
content (a null answer), so that gets an empty one.
"""
from __future__ import annotations

from typing import Any

Message = dict[str, Any]


def harmony_turns(messages: list[Message]) -> list[Message]:
    return one_call_per_turn([_with_content(_text_in_reasoning(m)) for m in messages])


def _with_content(message: Message) -> Message:
    if message.get("tool_calls") or message.get("content") is not None:
        return message
    return {**message, "content": ""}


def _text_in_reasoning(message: Message) -> Message:
    reasoning = message.get("reasoning_content") or message.get("thinking")
    if not (message.get("tool_calls") and message.get("content") and reasoning):
        return message
    joined = f"{reasoning}\n{message['content']}"
    rest = {k: v for k, v in message.items() if k != "content"}
    return {**rest, "reasoning_content": joined, "thinking": joined}


def one_call_per_turn(messages: list[Message]) -> list[Message]:
    out: list[Message] = []
    i = 0
    while i < len(messages):
        message = messages[i]
        calls = message.get("tool_calls") or []
        if message.get("role") != "assistant" or len(calls) < 2:
            out.append(message)
            i += 1
            continue
        end = i + 1
        while end < len(messages) and messages[end].get("role") == "tool":
            end += 1
        out += _interleaved(message, calls, messages[i + 1:end])
        i = end
    return out


def _interleaved(turn: Message, calls: list[Message], results: list[Message]) -> list[Message]:
    """The first call keeps the turn's text and reasoning; each result follows its call (by
    tool_call_id, else in order; results past the calls stay at the end)."""
    ids = [call.get("id") for call in calls]
    if len(set(ids)) == len(ids) and all(r.get("tool_call_id") in ids for r in results):
        answers = [[r for r in results if r.get("tool_call_id") == i] for i in ids]
        rest: list[Message] = []
    else:
        answers = [results[k:k + 1] for k in range(len(calls))]
        rest = results[len(calls):]
    out: list[Message] = []
    for k, (call, answer) in enumerate(zip(calls, answers)):
        out.append({**turn, "tool_calls": [call]} if k == 0 else {"role": "assistant", "tool_calls": [call]})
        out += answer
    return out + rest
