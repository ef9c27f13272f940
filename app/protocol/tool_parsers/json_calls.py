"""Generic JSON: the whole message is a call, a list of calls or {"tool_calls": [...]}, maybe in
a ```json fence. The fallback for unknown model families, and the spelling of forced calls for
formats that are not JSON (gemma)."""
from __future__ import annotations

import re

from app.protocol.tool_parsers.calls import ParsedCall, ToolFormat, calls_from_json, json_values

FENCE = re.compile(r"^\s*```(?:json)?\s*(.*?)\s*```\s*$", re.DOTALL)


def parse_block(block: str) -> list[ParsedCall] | None:
    fenced = FENCE.match(block)
    values = json_values(fenced[1] if fenced else block, separators="")
    if not values or len(values) != 1:
        return None
    return calls_from_json(values[0])


FORMAT = ToolFormat("json", ("{", "[", "```"), None, parse_block, anywhere=False,
                    known_names_only=True, call_begin='{"name": {name}, "arguments": ',
                    call_end="}", separator=", ", wrap=("[", "]"))
