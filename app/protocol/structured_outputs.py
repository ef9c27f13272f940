"""Request fields -> the grammar constraint the engine enforces (actors/core/structured.py).

Sources, each refused with a 400 naming the field when malformed:
- `response_format`: json_object (any JSON object) or json_schema (its `schema`);
- vLLM's `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (both endpoints);
- `tool_choice` required or a named function: the tool-call markup of the model's format
  around arguments that match the tool's parameters (app/protocol/tool_parsers).
A forced tool call wins over a response format; two other sources at once are refused.
"""
from __future__ import annotations

import json

from actors.sampling_params import StructuredOutput
from app.protocol.models import ChatCompletionRequest, NamedToolChoice, RequestError, SamplingRequest
from app.protocol.tool_parsers import ToolFormat
from app.protocol.tool_parsers.calls import forced_calls_tag

GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def request_constraint(body: SamplingRequest) -> StructuredOutput | None:
    """From response_format (chat) or a guided_* field; None when the output is free."""
    given = [name for name in GUIDED if getattr(body, name) is not None]
    fmt = getattr(body, "response_format", None)
    if fmt is not None and fmt.type != "text":
        given.append("response_format")
    if len(given) > 1:
        raise RequestError(f"give at most one of {', '.join(given)}", param=given[1])
    if not given:
        return None
    return _constraint(body, given[0])


def _constraint(body: SamplingRequest, field: str) -> StructuredOutput:
    if field == "response_format":
        return response_format_constraint(body.response_format)
    value = getattr(body, field)
    if field == "guided_json":
        return StructuredOutput.json_schema(_schema_object(value, field))
    if field == "guided_choice":
        if not value:
            raise RequestError("guided_choice must list at least one string", param=field)
        return StructuredOutput.choice(value)
    return StructuredOutput("regex" if field == "guided_regex" else "grammar", value)


def response_format_constraint(fmt) -> StructuredOutput:
    if fmt.type == "json_object":
        return StructuredOutput.json_schema(None)
    if not isinstance(fmt.json_schema, dict):
        raise RequestError("response_format json_schema needs a `json_schema` object",
                           param="response_format.json_schema")
    schema = fmt.json_schema.get("schema", {"type": "object"})
    param = "response_format.json_schema.schema"
    return StructuredOutput.json_schema(_schema_object(schema, param))


def _schema_object(schema, param: str) -> dict:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise RequestError(f"{param} is not valid JSON: {exc}", param=param) from None
    if not isinstance(schema, (dict, bool)):
        raise RequestError(f"{param} must be a JSON schema object", param=param)
    return schema


# --------------------------------------------------------------------------- tools

def check_tool_choice(body: ChatCompletionRequest) -> None:
    """OpenAI's rules: a named or required choice needs tools, and a named tool must exist."""
    choice = body.tool_choice
    if choice in (None, "none", "auto"):
        return
    if not body.tools:
        raise RequestError("tool_choice requires `tools`", param="tool_choice")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in tool_names(body):
        raise RequestError(f"tool_choice names {choice.function.name!r}, which is not in `tools`",
                           param="tool_choice")


def tool_names(body: ChatCompletionRequest) -> list[str]:
    return [t.function.name for t in body.tools or []]


def forced_tools(body: ChatCompletionRequest) -> list | None:
    """The tools a call must go to (required: any; named: that one); None when not forced."""
    choice = body.tool_choice
    if not body.tools or choice in (None, "none", "auto"):
        return None
    if isinstance(choice, NamedToolChoice):
        return [t for t in body.tools if t.function.name == choice.function.name]
    return list(body.tools)


def tool_constraint(body: ChatCompletionRequest, fmt: ToolFormat) -> StructuredOutput | None:
    tools = forced_tools(body)
    if tools is None:
        return None
    single = isinstance(body.tool_choice, NamedToolChoice) or body.parallel_tool_calls is False
    return StructuredOutput("structural_tag", json.dumps(forced_calls_tag(fmt, tools, single)))


def chat_constraint(body: ChatCompletionRequest, fmt: ToolFormat | None) -> StructuredOutput | None:
    if fmt is not None and (forced := tool_constraint(body, fmt)) is not None:
        return forced
    return request_constraint(body)
