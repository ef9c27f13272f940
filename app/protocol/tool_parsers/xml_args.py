"""What the XML-style formats share (Qwen3-Coder, GLM-4.5, MiniMax-M2): each argument is written
as text between tags, so its type comes from the tool's parameter schema, as their chat templates
write it (strings as they are, everything else as JSON).

A block parses into calls whose arguments are all strings (`raw_call`); the scanner, which knows
the request's tools, types them (`typed`). Without a schema for a parameter, a value that reads
as JSON is taken as JSON, any other as a string.
"""
from __future__ import annotations

import ast
import json
import re
from typing import Any

from app.protocol.tool_parsers.calls import ParsedCall, dumps, loads


def tiled(pattern: re.Pattern, text: str) -> list[re.Match] | None:
    """The matches of `pattern` that cover `text` back to back (blanks after the last allowed);
    None if anything else is in between."""
    found, at = [], 0
    for m in pattern.finditer(text):
        if m.start() != at:
            return None
        found.append(m)
        at = m.end()
    return found if not text[at:].strip() else None


def raw_call(name: str, arguments: dict[str, str]) -> ParsedCall | None:
    name = name.strip()
    if not name or any(c.isspace() or c in "<>" for c in name):
        return None
    return ParsedCall(name, dumps(arguments))


def typed(call: ParsedCall, parameters: dict | None) -> ParsedCall | None:
    """`call` with each string argument converted by its type in `parameters` (a JSON schema);
    None if an argument cannot be what the schema says."""
    properties = (parameters or {}).get("properties") or {}
    args = {}
    for key, text in loads(call.arguments).items():
        schema = properties.get(key) if isinstance(properties, dict) else None
        value = _value(text, _types(schema))
        if value is _INVALID:
            return None
        args[key] = value
    try:
        return ParsedCall(call.name, dumps(args))
    except ValueError:  # NaN or Infinity
        return None


_INVALID = object()


def _types(schema: Any) -> list[str] | None:
    """The JSON types a parameter's schema allows; None when it says nothing usable."""
    if not isinstance(schema, dict):
        return None
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list) and all(isinstance(k, str) for k in kind):
        return kind
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            found = [t for option in schema[key] for t in (_types(option) or [])]
            return found or None
    return None


def _value(text: str, types: list[str] | None) -> Any:
    if types is None:
        return _json_or_text(text)
    if "string" in types and len(types) == 1:
        return text
    stripped = text.strip()
    if "null" in types and stripped.lower() in ("null", "none"):
        return None
    if "boolean" in types and stripped.lower() in ("true", "false"):
        return stripped.lower() == "true"
    if "integer" in types:
        try:
            return int(stripped)
        except ValueError:
            pass
    if "number" in types:
        for kind in (int, float):
            try:
                return kind(stripped)
            except ValueError:
                pass
    if "object" in types or "array" in types:
        found = _json_or_literal(stripped)
        if isinstance(found, dict if types == ["object"] else (dict, list) if "object" in types else list):
            return found
    return text if "string" in types else _INVALID


def _json_or_text(text: str) -> Any:
    try:
        return loads(text.strip())
    except json.JSONDecodeError:
        return text


def _json_or_literal(text: str) -> Any:
    """Objects and arrays as JSON, or as Python literals (single quotes, True / None)."""
    try:
        return loads(text)
    except json.JSONDecodeError:
        try:
            return ast.literal_eval(text)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return _INVALID
