"""The OpenAI Responses API request (`POST /v1/responses`), and its translation into the chat
request the rest of the server already serves.

Stateless: nothing is stored, so `previous_response_id`, `conversation` and `background`
(which need stored responses) are refused by name; the client sends the whole conversation
as `input` items each time. Field names follow `openai.types.responses`.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import ConfigDict, Field, ValidationError, field_validator

from app.protocol.models import ChatCompletionRequest, OpenAIModel, RequestError

# vLLM's extra sampling fields, passed on to the chat request as they are (vLLM takes them
# on /v1/responses too); other unknown fields are ignored, as on every endpoint.
PASSTHROUGH = ("seed", "stop", "top_k", "min_p", "repetition_penalty", "presence_penalty",
               "frequency_penalty", "priority", "cache_salt", "chat_template_kwargs",
               "guided_json", "guided_regex", "guided_choice", "guided_grammar")
STATEFUL = ("previous_response_id", "conversation")  # refused: they need stored responses


class InputText(OpenAIModel):
    type: Literal["input_text", "output_text", "text"] = "input_text"
    text: str


class MessageItem(OpenAIModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class FunctionCallItem(OpenAIModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(OpenAIModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]


class ReasoningItem(OpenAIModel):
    type: Literal["reasoning"]  # earlier reasoning: accepted, not shown to the model again


InputItem = Annotated[Union[MessageItem, FunctionCallItem, FunctionCallOutputItem, ReasoningItem],
                      Field(discriminator="type")]


class FunctionTool(OpenAIModel):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(OpenAIModel):
    type: Literal["function"]
    name: str


class TextFormat(OpenAIModel):
    type: Literal["text", "json_schema", "json_object"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(OpenAIModel):
    format: TextFormat = Field(default_factory=TextFormat)


class ResponsesRequest(OpenAIModel):
    model_config = ConfigDict(extra="allow")  # vLLM's PASSTHROUGH fields land in model_extra
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: dict[str, Any] | None = None  # effort: the chat's reasoning_effort; summary: accepted
    stream: bool = False
    store: bool = False  # accepted either way: nothing is stored (the response says store false)
    background: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _typed_items(cls, items):
        # EasyInputMessage ({"role", "content"}) has no `type`: it is a message.
        if isinstance(items, list):
            return [{"type": "message", **i} if isinstance(i, dict) and "type" not in i else i
                    for i in items]
        return items

    @field_validator("input")
    @classmethod
    def _not_empty(cls, items):
        if not items:
            raise ValueError("input must not be empty")
        return items

    @field_validator(*STATEFUL, "background")
    @classmethod
    def _stateless(cls, value):
        if value:
            raise ValueError("not supported: this server does not store responses (store is "
                             "always false); send the whole conversation as `input`")
        return value

    def format(self) -> TextFormat:
        return self.text.format if self.text else TextFormat()


def to_chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request with the same prompt, tools, format and sampling settings."""
    chat = dict(messages=chat_messages(body), max_completion_tokens=body.max_output_tokens,
                temperature=body.temperature, top_p=body.top_p,
                parallel_tool_calls=body.parallel_tool_calls, user=body.user,
                reasoning_effort=(body.reasoning or {}).get("effort"),
                **{k: v for k, v in (body.model_extra or {}).items() if k in PASSTHROUGH})
    if body.tools:
        chat["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"})}
                         for t in body.tools]
    if isinstance(body.tool_choice, FunctionChoice):
        chat["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
    elif body.tool_choice is not None:
        chat["tool_choice"] = body.tool_choice
    fmt = body.format()
    if fmt.type == "json_schema":
        schema = fmt.schema_ if fmt.schema_ is not None else {"type": "object"}
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name, "schema": schema, "strict": fmt.strict}}
    elif fmt.type == "json_object":
        chat["response_format"] = {"type": "json_object"}
    try:
        return ChatCompletionRequest(**{k: v for k, v in chat.items() if v is not None})
    except ValidationError as exc:  # a passed-through field with a bad value
        error = exc.errors()[0]
        param = ".".join(str(p) for p in error["loc"]) or None
        raise RequestError(f"{param}: {error['msg']}", param=param) from None


def chat_messages(body: ResponsesRequest) -> list[dict]:
    """instructions -> system; items -> chat turns (consecutive calls join one assistant turn)."""
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    if isinstance(body.input, str):
        return messages + [{"role": "user", "content": body.input}]
    for item in body.input:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            output = item.output if isinstance(item.output, str) else \
                "\n".join(p.text for p in item.output)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
    return messages
