"""Gemma-style tool calls: Python calls in a fence, ```tool_code\nget_weather(city="Paris")\n```
(one per line, or a list `[f(a=1), g()]`). Arguments must be literals."""
from __future__ import annotations

import ast

from app.protocol.tool_parsers.calls import ParsedCall, ToolFormat, dumps, strip_markers

START, END = "```tool_code", "```"


def parse_block(block: str) -> list[ParsedCall] | None:
    source = strip_markers(block, START, END).strip()
    try:
        tree = ast.parse(source, mode="exec")
    except (SyntaxError, ValueError, RecursionError):
        return None
    nodes = []
    for stmt in tree.body:
        if not isinstance(stmt, ast.Expr):
            return None
        value = stmt.value
        nodes.extend(value.elts if isinstance(value, (ast.List, ast.Tuple)) else [value])
    calls = [_call(node) for node in nodes]
    return calls if calls and all(calls) else None


def _call(node: ast.AST) -> ParsedCall | None:
    if not isinstance(node, ast.Call) or node.args:
        return None
    name = _dotted(node.func)
    if name is None:
        return None
    try:
        args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
        if len(args) != len(node.keywords):  # **kwargs
            return None
        return ParsedCall(name, dumps(args))
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        return None  # not literals, or values JSON can't hold


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and (base := _dotted(node.value)):
        return f"{base}.{node.attr}"
    return None


# Python calls cannot be written as a JSON-schema grammar: forced calls use the JSON format.
FORMAT = ToolFormat("gemma", (START,), END, parse_block)
