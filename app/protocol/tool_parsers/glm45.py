"""GLM-4.5 / 4.6 / 4.7: the function's name, then key and value pairs, typed by the tool's
schema (app/protocol/tool_parsers/xml_args.py); 4.7 drops the newlines:

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>
"""
from __future__ import annotations

import re

from app.protocol.tool_parsers.calls import ParsedCall, ToolFormat, strip_markers
from app.protocol.tool_parsers.xml_args import raw_call, tiled

START, END = "<tool_call>", "</tool_call>"
PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def parse_block(block: str) -> list[ParsedCall] | None:
    body = strip_markers(block, START, END)
    cut = body.find("<arg_key>")
    name, rest = (body, "") if cut < 0 else (body[:cut], body[cut:])
    pairs = tiled(PAIR, rest)
    call = raw_call(name, {m[1].strip(): m[2] for m in pairs}) if pairs is not None else None
    return [call] if call else None


# Forced calls need a JSON spelling (xgrammar's JSON-schema content): they use the JSON format.
FORMAT = ToolFormat("glm45", (START,), END, parse_block, typed_by_schema=True)
