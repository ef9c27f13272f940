"""How one chat request's output text is split into reasoning, content and tool calls.

`plan_output` decides once per request (from the server's parsers, the request's tools and
the rendered prompt); each choice then gets its own `ChoiceParser`, fed the whole text for a
response or each delta for a stream. Reasoning comes first (calls inside `<think>` are
thoughts, not calls), then tool calls are cut out of the content. Harmony output (gpt-oss)
is split by its channels in one pass instead (app/protocol/harmony.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from app.protocol.harmony import Channels, HarmonyScanner
from app.protocol.models import ChatCompletionRequest
from app.protocol.reasoning import (
    HARMONY, MARKERS, THINK, Markers, ReasoningScanner, initial_state, reasoning_parser_name,
)
from app.protocol.structured_outputs import (
    chat_constraint, check_tool_choice, forced_tools, request_constraint, tool_names,
)
from app.protocol.tool_parsers import FORMATS, JSON_FORMAT, ParsedCall, ToolCallScanner, ToolFormat, tool_format
from app.protocol.tool_parsers.calls import parameters_schema

HARMONY_STOPS = ("<|return|>", "<|call|>")  # harmony's end of a turn and of a call


@dataclass
class ParsedText:
    content: str = ""
    reasoning: str = ""
    calls: list[ParsedCall] = field(default_factory=list)


@dataclass
class OutputPlan:
    reasoning: tuple[str, bool] | None = None  # the scanner's start (state, implied_open)
    reasoning_markers: Markers = THINK  # <think>, or Gemma 4's thinking channel
    tool_format: ToolFormat | None = None
    tool_names: list[str] = field(default_factory=list)
    tool_schemas: dict = field(default_factory=dict)  # name -> parameters, for formats typed by them
    max_calls: int | None = None  # parallel_tool_calls false: 1 (later calls dropped, as vLLM)
    channels: Channels | None = None  # harmony output: split by channel, not by the above
    stop_token_ids: list[int] = field(default_factory=list)  # ends of output the model's eos may miss

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.tool_format is not None or self.channels is not None

    def parser(self) -> ChoiceParser:
        if self.channels is not None:
            return ChoiceParser(None, None, self.max_calls, HarmonyScanner(self.channels))
        reasoning = ReasoningScanner(*self.reasoning, self.reasoning_markers) if self.reasoning else None
        tools = (ToolCallScanner(self.tool_format, self.tool_names, self.tool_schemas)
                 if self.tool_format else None)
        return ChoiceParser(reasoning, tools, self.max_calls)


class ChoiceParser:
    def __init__(self, reasoning: ReasoningScanner | None, tools: ToolCallScanner | None,
                 max_calls: int | None = None, channels: HarmonyScanner | None = None):
        self.reasoning, self.tools, self.channels = reasoning, tools, channels
        self.calls_left = max_calls

    def feed(self, text: str, final: bool = False) -> ParsedText:
        parsed = self._split(text, final)
        if self.calls_left is not None:
            calls = parsed.calls
            parsed.calls, self.calls_left = calls[:self.calls_left], max(0, self.calls_left - len(calls))
        return parsed

    def _split(self, text: str, final: bool) -> ParsedText:
        if self.channels is not None:
            split = self.channels.feed(text, final)
            return ParsedText(split.content, split.reasoning, split.calls)
        reasoning, content = self.reasoning.feed(text, final) if self.reasoning else ("", text)
        if self.tools is None:
            return ParsedText(content, reasoning)
        found = self.tools.feed(content, final)
        return ParsedText(found.content, reasoning, found.calls)


def tools_in_use(body: ChatCompletionRequest) -> bool:
    """`tool_choice: none` hides the tools: not shown to the model, not parsed."""
    return bool(body.tools) and body.tool_choice != "none"


def thinking_disabled(settings, body: ChatCompletionRequest) -> bool:
    kwargs = body.chat_template_kwargs or {}
    if "enable_thinking" in kwargs:
        return kwargs["enable_thinking"] is False
    return settings.disable_thinking


def plan_output(settings, tokenizer, body: ChatCompletionRequest,
                prompt_text: str) -> OutputPlan:
    """ValueError for an unknown parser name (a server misconfiguration). Of `settings` only
    reasoning_parser, tool_call_parser and disable_thinking are read: the server passes its
    ServerSettings (app/api/settings.py), run-batch its BatchOptions."""
    plan = OutputPlan()
    parser = reasoning_parser_name(settings.reasoning_parser)
    fmt = tool_format(settings.tool_call_parser, tokenizer) if tools_in_use(body) else None
    if parser == HARMONY or (fmt is not None and fmt.channels):
        plan.channels = Channels(reasoning=parser == HARMONY, calls=fmt is not None)
        plan.stop_token_ids = single_token_ids(tokenizer, HARMONY_STOPS)
        fmt = FORMATS[HARMONY] if fmt is not None else None  # forced calls spelled as harmony's
    elif parser:
        plan.reasoning = initial_state(parser, prompt_text, thinking_disabled(settings, body))
        plan.reasoning_markers = MARKERS[parser]
    if fmt is not None:
        if forced_tools(body) is not None and fmt.call_begin is None:
            fmt = JSON_FORMAT  # forced calls need a JSON spelling; the parser reads it back
        plan.tool_format, plan.tool_names = fmt, tool_names(body)
        plan.tool_schemas = {t.function.name: parameters_schema(t) for t in body.tools or []}
        plan.max_calls = 1 if body.parallel_tool_calls is False else None
    return plan


def single_token_ids(tokenizer, markers) -> list[int]:
    """The ids of those markers that are one token in this vocabulary."""
    ids = []
    for marker in markers:
        found = tokenizer.encode(marker, add_special_tokens=False) if tokenizer is not None else []
        if len(found) == 1:
            ids.append(found[0])
    return ids


def constraint(body, plan: OutputPlan | None = None) -> dict:
    """The SamplingParams fields a request's output plan sets: its grammar (structured outputs;
    forced tool calls for chat, which has a `plan`) and keeping markup tokens in the text the
    parsers read. RequestError when the request's constraints are invalid."""
    if plan is None:
        return {"structured": request_constraint(body)}
    check_tool_choice(body)
    fields = {"structured": chat_constraint(body, plan.tool_format)}
    if plan.active:
        fields["skip_special_tokens"] = False  # markup such as <tool_call> may be special tokens
    if plan.stop_token_ids:
        fields["stop_token_ids"] = list(body.stop_token_ids or []) + plan.stop_token_ids
    return fields
