"""Llama 3.x JSON tool calls: the message is `{"name": ..., "parameters": {...}}`, maybe after
`<|python_tag|>`, several separated by `;`."""
from __future__ import annotations

from app.protocol.tool_parsers.calls import ParsedCall, ToolFormat, call_from_json, json_values

PYTHON_TAG = "<|python_tag|>"


def parse_block(block: str) -> list[ParsedCall] | None:
    values = json_values(block.replace(PYTHON_TAG, " "), separators=";")
    calls = [call_from_json(v) for v in values or []]
    return calls if calls and all(calls) else None


FORMAT = ToolFormat("llama3_json", (PYTHON_TAG, "{"), None, parse_block, anywhere=False,
                    known_names_only=True, call_begin='{"name": {name}, "parameters": ',
                    call_end="}", separator="; ")
