"""Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (v3 tokenizers) or
`[TOOL_CALLS]name[ARGS]{...}` once per call (v11 and later)."""
from __future__ import annotations

import json
import re

from app.protocol.tool_parsers.calls import (
    DECODER, ParsedCall, ToolFormat, call_from_json, calls_from_json, loads,
)

START = "[TOOL_CALLS]"
NAMED = re.compile(r"\s*([\w.\-]+)\s*(?:\[ARGS\])?\s*(?=\{)")


def parse_block(block: str) -> list[ParsedCall] | None:
    calls: list[ParsedCall] = []
    for piece in block.split(START)[1:]:
        found = _piece_calls(piece)
        if found is None:
            return None
        calls.extend(found)
    return calls or None


def _piece_calls(piece: str) -> list[ParsedCall] | None:
    if piece.lstrip()[:1] in ("[", "{"):
        try:
            return calls_from_json(loads(piece))
        except json.JSONDecodeError:
            return None
    match = NAMED.match(piece)
    if not match:
        return None
    try:
        args, end = DECODER.raw_decode(piece, match.end())
    except json.JSONDecodeError:
        return None
    if piece[end:].strip() or not isinstance(args, dict):
        return None
    call = call_from_json({"name": match[1], "arguments": args})
    return [call] if call else None


FORMAT = ToolFormat("mistral", (START,), None, parse_block,
                    call_begin='{"name": {name}, "arguments": ', call_end="}", separator=", ",
                    wrap=(START + "[", "]"))
