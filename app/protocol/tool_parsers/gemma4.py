"""Gemma 4: one call per block, blocks back to back, the arguments in the chat template's own
object syntax (keys unquoted; strings between `<|"|>` tokens; numbers, true / false, null,
nested objects and lists as they are):

    <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>
    <|tool_call>call:book{extras:{wifi:true},guests:[<|"|>ann<|"|>,<|"|>bo<|"|>]}<tool_call|>

The values carry their types, so the arguments read as JSON without the tool's schema (the
template prints Python's spelling: `None` for null, `1e-05`). Leniencies, as vLLM's and SGLang's
gemma4 parsers read the syntax: blanks between tokens, a trailing comma, keys between `<|"|>`,
`nil` for null, a bare word as a string; and a JSON-quoted string as a string. Anything else (an
unterminated string, object or list, text after the object) leaves the block in the content.
"""
from __future__ import annotations

import math
import re
from typing import Any

from app.protocol.tool_parsers.calls import DECODER, ParsedCall, ToolFormat, dumps, strip_markers

START, END, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
CALL = re.compile(r"\s*call:([^\s{}<>]+)\s*(?=\{)")
KEY = re.compile(r"[^:,{}\[\]<>\"]+")  # up to the colon, blanks inside kept (as vLLM reads keys)
BARE = re.compile(r"[^,{}\[\]<]+")  # a number, true / false / null, or a bare word
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?", re.ASCII)
NULLS = ("null", "none", "nil")


class Malformed(ValueError):
    pass


def parse_block(block: str) -> list[ParsedCall] | None:
    body = strip_markers(block, START, END)
    m = CALL.match(body)
    if not m:
        return None
    try:
        args, at = _object(body, m.end())
        if body[at:].strip():
            return None
        return [ParsedCall(m[1], dumps(args))]
    except (ValueError, RecursionError):  # Malformed, bad JSON-quoted text, NaN
        return None


def _object(text: str, i: int) -> tuple[dict, int]:
    """`{key:value,...}` opening at text[i] -> (the dict, where it ends)."""
    found: dict = {}
    i = _blank(text, i + 1)
    while not text.startswith("}", i):
        key, i = _key(text, i)
        if not text.startswith(":", i := _blank(text, i)):
            raise Malformed(f"no ':' after {key!r}")
        found[key], i = _value(text, _blank(text, i + 1))
        i = _after_item(text, i, "}")
    return found, i + 1


def _array(text: str, i: int) -> tuple[list, int]:
    items: list = []
    i = _blank(text, i + 1)
    while not text.startswith("]", i):
        value, i = _value(text, i)
        items.append(value)
        i = _after_item(text, i, "]")
    return items, i + 1


def _after_item(text: str, i: int, close: str) -> int:
    """Past the comma after an item (a trailing one allowed), or at `close`."""
    i = _blank(text, i)
    if text.startswith(",", i):
        return _blank(text, i + 1)
    if text.startswith(close, i):
        return i
    raise Malformed(f"expected ',' or {close!r} at {i}")


def _key(text: str, i: int) -> tuple[str, int]:
    if text.startswith(QUOTE, i) or text.startswith('"', i):
        return _string(text, i)
    m = KEY.match(text, i)
    if not m:
        raise Malformed(f"no key at {i}")
    return m[0].rstrip(), m.end()


def _value(text: str, i: int) -> tuple[Any, int]:
    if text.startswith(QUOTE, i) or text.startswith('"', i):
        return _string(text, i)
    if text.startswith("{", i):
        return _object(text, i)
    if text.startswith("[", i):
        return _array(text, i)
    m = BARE.match(text, i)
    if not m or not m[0].strip():
        raise Malformed(f"no value at {i}")
    return _bare(m[0].strip()), m.end()


def _string(text: str, i: int) -> tuple[str, int]:
    """Between `<|"|>` tokens, as it is; or a JSON string."""
    if text.startswith('"', i):
        return DECODER.raw_decode(text, i)
    end = text.find(QUOTE, i + len(QUOTE))
    if end < 0:
        raise Malformed("unterminated string")
    return text[i + len(QUOTE):end], end + len(QUOTE)


def _bare(word: str) -> Any:
    if word in ("true", "false"):
        return word == "true"
    if word.lower() in NULLS:
        return None
    if NUMBER.fullmatch(word):
        if word.lstrip("-").isdigit():
            return int(word)
        number = float(word)
        if not math.isfinite(number):
            raise Malformed(f"{word} is not a JSON number")
        return number
    return word


def _blank(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


# Forced calls need a JSON spelling (xgrammar's JSON-schema content): they use the JSON format.
FORMAT = ToolFormat("gemma4", (START,), END, parse_block)
