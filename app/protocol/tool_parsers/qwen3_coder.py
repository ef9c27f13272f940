"""Qwen3-Coder: one call per block, each argument between tags, typed by the tool's schema
(app/protocol/tool_parsers/xml_args.py):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>
"""
from __future__ import annotations

import re

from app.protocol.tool_parsers.calls import ParsedCall, ToolFormat, strip_markers
from app.protocol.tool_parsers.xml_args import raw_call

START, END = "<tool_call>", "</tool_call>"
FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)(?:</function>\s*)?$", re.S)
PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)


def parse_block(block: str) -> list[ParsedCall] | None:
    m = FUNCTION.match(strip_markers(block, START, END))
    if not m:
        return None
    body = m[2]
    args = {p[1].strip(): _unwrap(p[2]) for p in PARAMETER.finditer(body)}
    if PARAMETER.sub("", body).strip():  # anything but parameters inside the function
        return None
    call = raw_call(m[1], args)
    return [call] if call else None


def _unwrap(value: str) -> str:
    """The template puts the value on lines of its own: one newline each side is markup."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


# Forced calls need a JSON spelling (xgrammar's JSON-schema content): they use the JSON format.
FORMAT = ToolFormat("qwen3_coder", (START,), END, parse_block, typed_by_schema=True)
