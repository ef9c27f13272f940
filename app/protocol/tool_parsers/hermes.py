"""Hermes, Qwen2.5, Qwen3, MiniCPM: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`."""
from __future__ import annotations

import json

from app.protocol.tool_parsers.calls import ParsedCall, ToolFormat, call_from_json, loads, strip_markers

START, END = "<tool_call>", "</tool_call>"


def parse_block(block: str) -> list[ParsedCall] | None:
    try:
        call = call_from_json(loads(strip_markers(block, START, END)))
    except json.JSONDecodeError:
        return None
    return [call] if call else None


FORMAT = ToolFormat("hermes", (START,), END, parse_block,
                    call_begin=START + '\n{"name": {name}, "arguments": ', call_end="}\n" + END)
