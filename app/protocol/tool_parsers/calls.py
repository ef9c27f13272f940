"""What every tool-call format shares: the parsed call, the format description, JSON helpers.

A format is plain data plus one function: the markers that open and close a call block, how
to read a complete block into calls, and (for `tool_choice` required or named) how one call
is spelled, as an xgrammar structural tag, so constrained decoding produces exactly that.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object as text, as OpenAI sends it


@dataclass(frozen=True)
class ToolFormat:
    name: str
    starts: tuple[str, ...]  # markers that open a call block
    end: str | None  # marker that closes it; None: the block runs to the end of the output
    parse_block: Callable[[str], list[ParsedCall] | None]  # None: malformed, stays text
    anywhere: bool = True  # False: a block may only open the message (bare JSON formats)
    known_names_only: bool = False  # bare JSON could be an answer: only named tools count
    # Forced calls (constrained decoding): one call's text around its arguments object.
    call_begin: str | None = None  # with {name} for the JSON-quoted name; None: not supported
    call_end: str = ""
    separator: str = "\n"  # between forced calls
    wrap: tuple[str, str] = ("", "")  # around all forced calls
    quote_name: bool = True  # {name} in call_begin as a JSON string; False: as it is (harmony)
    channels: bool = False  # harmony: the output is channel messages (app/protocol/harmony.py)
    typed_by_schema: bool = False  # arguments parse as text, typed by the tool's schema (xml_args.py)


# Lenient about raw control characters in strings: models (and grammars) let them through.
DECODER = json.JSONDecoder(strict=False)


def loads(text: str) -> Any:
    return DECODER.decode(text)


def call_from_json(item: Any) -> ParsedCall | None:
    """{"name", "arguments"|"parameters"} (or OpenAI's {"function": {...}}) -> a call."""
    if not isinstance(item, dict):
        return None
    if isinstance(item.get("function"), dict):
        item = item["function"]
    name = item.get("name")
    args = item.get("arguments", item.get("parameters"))
    if isinstance(args, str):  # some models write OpenAI's string form
        try:
            args = loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(name, str) or not name or not isinstance(args, dict):
        return None
    try:
        return ParsedCall(name, dumps(args))
    except ValueError:  # NaN or Infinity: JSON text can't carry them
        return None


def calls_from_json(obj: Any) -> list[ParsedCall] | None:
    """A call, a list of calls or {"tool_calls": [...]}; None unless every item is a call."""
    if isinstance(obj, dict) and isinstance(obj.get("tool_calls"), list):
        obj = obj["tool_calls"]
    items = obj if isinstance(obj, list) else [obj]
    calls = [call_from_json(item) for item in items]
    if not calls or any(c is None for c in calls):
        return None
    return calls


def json_values(text: str, separators: str = ";,") -> list[Any] | None:
    """Consecutive JSON values separated by whitespace or `separators`; None if anything else."""
    values, i = [], 0
    while True:
        while i < len(text) and (text[i].isspace() or text[i] in separators):
            i += 1
        if i == len(text):
            return values
        try:
            value, i = DECODER.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        values.append(value)


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


def parameters_schema(tool) -> dict:
    """A tool's parameters; none means no arguments (an empty object)."""
    return tool.function.parameters or {"type": "object", "properties": {}}


def forced_calls_tag(fmt: ToolFormat, tools: list, single: bool) -> dict:
    """xgrammar structural tag: one call (single) or one or more, to the given tools only."""
    tags = [{"type": "tag", "begin": fmt.call_begin.replace("{name}", _spelled(fmt, t.function.name)),
             "content": {"type": "json_schema", "json_schema": parameters_schema(t)},
             "end": fmt.call_end} for t in tools]
    if len(tags) == 1 and single:
        body: dict = tags[0]
    else:
        body = {"type": "tags_with_separator", "tags": tags, "separator": fmt.separator,
                "at_least_one": True, "stop_after_first": single}
    if fmt.wrap != ("", ""):
        body = {"type": "sequence", "elements": [const(fmt.wrap[0]), body, const(fmt.wrap[1])]}
    return {"type": "structural_tag", "format": body}


def _spelled(fmt: ToolFormat, name: str) -> str:
    return dumps(name) if fmt.quote_name else name


def const(text: str) -> dict:
    return {"type": "const_string", "value": text}


def strip_markers(block: str, start: str, end: str | None) -> str:
    block = block[len(start):] if block.startswith(start) else block
    if end and block.endswith(end):
        block = block[:-len(end)]
    return block
