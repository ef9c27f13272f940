"""Engine output -> Responses API bodies: the whole `response` object, or its stream of events.

Output items in order: a `reasoning` item (when the model's reasoning parser split some off),
the assistant `message` with its `output_text`, then one `function_call` item per tool call.
Both paths split the text with the same ChoiceParser as chat (app/protocol/chat_output.py),
so a stream's items add up to the whole response's. Event and field names follow
`openai.types.responses`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from actors.outputs import RequestOutput
from app.protocol.chat_output import OutputPlan, ParsedText
from app.protocol.models import random_id
from app.protocol.responses import StreamCounter
from app.protocol.responses_api import ResponsesRequest


# --------------------------------------------------------------------------- items

def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    content = [{"type": "reasoning_text", "text": text}] if text or status == "completed" else []
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    content = [output_text(text)] if status != "in_progress" else []
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": content}


def function_call_item(item_id: str, call, status: str = "completed") -> dict:
    return {"id": item_id, "type": "function_call", "call_id": random_id("call_"),
            "name": call.name, "arguments": call.arguments if status == "completed" else "",
            "status": status}


def output_items(parsed: ParsedText, status: str) -> list[dict]:
    items = []
    if parsed.reasoning:
        items.append(reasoning_item(random_id("rs_"), parsed.reasoning))
    if parsed.content or not parsed.calls:  # a message, unless the output is only calls
        items.append(message_item(random_id("msg_"), parsed.content, status))
    items += [function_call_item(random_id("fc_"), call) for call in parsed.calls]
    return items


# --------------------------------------------------------------------------- the response object

def response_usage(counter: StreamCounter, cached_tokens: int, reasoning_tokens: int) -> dict:
    u = counter.usage()
    return {"input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": u.total_tokens}


@dataclass
class ResponseShell:
    """What every snapshot of one response carries: the request's settings echoed back."""
    request: ResponsesRequest
    model: str
    response_id: str = field(default_factory=lambda: random_id("resp_"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    def body(self, status: str, output: list[dict], usage: dict | None = None,
             finish_reason: str | None = None) -> dict:
        r = self.request
        incomplete = status == "incomplete"
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at,
            "status": status, "model": self.model, "output": output, "usage": usage,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            "temperature": r.temperature, "top_p": r.top_p,
            "tools": [t.model_dump(exclude_none=True) for t in r.tools or []],
            "tool_choice": tool_choice(r), "parallel_tool_calls": r.parallel_tool_calls,
            "text": {"format": r.format().model_dump(by_alias=True, exclude_none=True)},
            "reasoning": r.reasoning, "store": False,  # stateless: nothing is kept
            "previous_response_id": None, "background": False, "truncation": "disabled",
            "metadata": r.metadata or {}, "user": r.user,
        }


def tool_choice(r: ResponsesRequest):
    if r.tool_choice is None:
        return "auto" if r.tools else "none"
    return r.tool_choice if isinstance(r.tool_choice, str) else r.tool_choice.model_dump()


def status_of(finish_reason: str | None, parsed: ParsedText) -> str:
    """Cut by max_output_tokens: incomplete (a finished tool call still completes it)."""
    return "incomplete" if finish_reason == "length" and not parsed.calls else "completed"


def whole_response(shell: ResponseShell, output: RequestOutput, plan: OutputPlan,
                   tokenizer) -> dict:
    out = output.outputs[0]
    parsed = plan.parser().feed(out.text, final=True)
    status = status_of(out.finish_reason, parsed)
    counter = StreamCounter()
    counter.add(output)
    usage = response_usage(counter, output.num_cached_tokens or 0,
                           reasoning_tokens(tokenizer, parsed.reasoning))
    return shell.body(status, output_items(parsed, status), usage)


def reasoning_tokens(tokenizer, reasoning: str) -> int:
    # The split is made on text, so the count is the reasoning text's own token count.
    return len(tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0


# --------------------------------------------------------------------------- the event stream

@dataclass
class ResponsesStream:
    """The Responses event sequence of one streamed response.

    response.created, response.in_progress; per item output_item.added, content_part.added,
    the text deltas (reasoning_text / output_text), their .done, content_part.done,
    output_item.done (function calls: function_call_arguments.delta/.done instead of parts);
    then response.completed (response.incomplete when cut by max_output_tokens).
    """
    shell: ResponseShell
    plan: OutputPlan
    tokenizer: object
    counter: StreamCounter = field(default_factory=StreamCounter)
    sequence_number: int = 0
    output: list[dict] = field(default_factory=list)  # finished items
    open_item: dict | None = None  # the reasoning or message item receiving text
    open_text: str = ""
    reasoning_text: str = ""
    cached_tokens: int = 0
    parser: object = None
    any_calls: bool = False

    def __post_init__(self):
        self.parser = self.plan.parser()

    def event(self, kind: str, **fields) -> dict:
        self.sequence_number += 1
        return {"type": kind, "sequence_number": self.sequence_number - 1, **fields}

    def opening(self) -> list[dict]:
        snapshot = self.shell.body("in_progress", [])
        return [self.event("response.created", response=snapshot),
                self.event("response.in_progress", response=snapshot)]

    def chunks(self, delta: RequestOutput) -> list[dict]:
        self.counter.add(delta)
        self.cached_tokens = max(self.cached_tokens, delta.num_cached_tokens or 0)
        events = []
        for out in delta.outputs:
            finished = out.finish_reason is not None
            parsed = self.parser.feed(out.text, final=finished)
            events += self.text_events("reasoning", parsed.reasoning)
            events += self.text_events("message", parsed.content)
            for call in parsed.calls:
                events += self.close_item() + self.call_events(call)
            if finished:
                events += self.finish(out.finish_reason)
        return events

    # ---- text items -------------------------------------------------------------------
    def text_events(self, kind: str, text: str) -> list[dict]:
        if not text:
            return []
        events = []
        if self.open_item is None or self.open_item["type"] != kind:
            events += self.close_item() + self.open_text_item(kind)
        self.open_text += text
        delta_type = "response.reasoning_text.delta" if kind == "reasoning" \
            else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        events.append(self.event(delta_type, **self.where(), content_index=0, delta=text, **extra))
        return events

    def open_text_item(self, kind: str) -> list[dict]:
        if kind == "reasoning":
            item, part = reasoning_item(random_id("rs_"), "", "in_progress"), \
                {"type": "reasoning_text", "text": ""}
        else:
            item, part = message_item(random_id("msg_"), "", "in_progress"), output_text("")
        self.open_item, self.open_text = item, ""
        return [self.event("response.output_item.added", output_index=len(self.output), item=item),
                self.event("response.content_part.added", **self.where(), content_index=0,
                           part=part)]

    def close_item(self, status: str = "completed") -> list[dict]:
        if self.open_item is None:
            return []
        where, text, kind = self.where(), self.open_text, self.open_item["type"]
        if kind == "reasoning":
            self.reasoning_text += text
            item, part = reasoning_item(where["item_id"], text), \
                {"type": "reasoning_text", "text": text}
            done = self.event("response.reasoning_text.done", **where, content_index=0, text=text)
        else:
            item, part = message_item(where["item_id"], text, status), output_text(text)
            done = self.event("response.output_text.done", **where, content_index=0, text=text,
                              logprobs=[])
        self.open_item = None
        self.output.append(item)
        return [done, self.event("response.content_part.done", **where, content_index=0, part=part),
                self.event("response.output_item.done", output_index=where["output_index"],
                           item=item)]

    def where(self) -> dict:
        return {"item_id": self.open_item["id"], "output_index": len(self.output)}

    # ---- function calls ---------------------------------------------------------------
    def call_events(self, call) -> list[dict]:
        self.any_calls = True
        item = function_call_item(random_id("fc_"), call, "in_progress")
        index, where = len(self.output), {"item_id": item["id"], "output_index": len(self.output)}
        done = {**item, "arguments": call.arguments, "status": "completed"}
        self.output.append(done)
        return [self.event("response.output_item.added", output_index=index, item=item),
                self.event("response.function_call_arguments.delta", **where, delta=call.arguments),
                self.event("response.function_call_arguments.done", **where, name=call.name,
                           arguments=call.arguments),
                self.event("response.output_item.done", output_index=index, item=done)]

    # ---- the end ----------------------------------------------------------------------
    def finish(self, finish_reason: str) -> list[dict]:
        status = "incomplete" if finish_reason == "length" and not self.any_calls else "completed"
        events = []
        if not self.any_calls and not any(i["type"] == "message" for i in self.output) \
                and (self.open_item is None or self.open_item["type"] != "message"):
            events += self.close_item() + self.open_text_item("message")  # always a message
        events += self.close_item(status)
        usage = response_usage(self.counter, self.cached_tokens,
                               reasoning_tokens(self.tokenizer, self.reasoning_text))
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return events + [self.event(kind, response=self.shell.body(status, self.output, usage))]
