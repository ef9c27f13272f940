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
from app.protocol.tool_parsers.xml_args import raw_call, tiled

START, END = "<minimax:tool_call>", "</minimax:tool_call>"
INVOKE = re.compile(r"\s*<invoke name=\"([^\"]*)\">(.*?)</invoke>", re.S)
PARAMETER = re.compile(r"\s*<parameter name=\"([^\"]*)\">(.*?)</parameter>", re.S)


def parse_block(block: str) -> list[ParsedCall] | None:
    calls = []
    for invoke in tiled(INVOKE, strip_markers(block, START, END)) or ():
        parameters = tiled(PARAMETER, invoke[2])
        call = raw_call(invoke[1], {m[1].strip(): m[2] for m in parameters}) if parameters is not None else None
        if call is None:
            return None
        calls.append(call)
    return calls or None


# Forced calls need a JSON spelling (xgrammar's JSON-schema content): they use the JSON format.
FORMAT = ToolFormat("minimax_m2", (START,), END, parse_block, typed_by_schema=True)
