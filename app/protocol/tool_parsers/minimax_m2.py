"""MiniMax-M2: one block of one or more invocations, each argument between tags, typed by the
tool's schema (app/protocol/tool_parsers/xml_args.py):

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    </invoke>
    </minimax:tool_call>
"""
from __future__ import annotations

import re

from app.protocol.tool_parsers.calls import ParsedCall, ToolFormat, strip_markers
from app.protocol.tool_parsers.xml_args import raw_call

START, END = "<minimax:tool_call>", "</minimax:tool_call>"
INVOKE = re.compile(r"\s*<invoke name=\"([^\"]*)\">(.*?)</invoke>", re.S)
PARAMETER = re.compile(r"\s*<parameter name=\"([^\"]*)\">(.*?)</parameter>", re.S)


def parse_block(block: str) -> list[ParsedCall] | None:
    body = strip_markers(block, START, END)
    calls, at = [], 0
    for m in INVOKE.finditer(body):
        if m.start() != at:
            return None
        args = _arguments(m[2])
        call = raw_call(m[1], args) if args is not None else None
        if call is None:
            return None
        calls.append(call)
        at = m.end()
    return calls if calls and not body[at:].strip() else None


def _arguments(body: str) -> dict[str, str] | None:
    args, at = {}, 0
    for m in PARAMETER.finditer(body):
        if m.start() != at:
            return None
        args[m[1].strip()] = m[2]
        at = m.end()
    return args if not body[at:].strip() else None


# Forced calls need a JSON spelling (xgrammar's JSON-schema content): they use the JSON format.
FORMAT = ToolFormat("minimax_m2", (START,), END, parse_block, typed_by_schema=True)
