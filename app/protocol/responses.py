"""Engine outputs -> OpenAI response bodies (plain dicts, ready for json.dumps).

Whole responses take cumulative RequestOutputs; the stream classes take deltas and keep
only what a stream needs across chunks (which choices got their role, token counts).
"""
from __future__ import annotations

import codecs
import math
import re
from dataclasses import dataclass, field

from actors.outputs import RequestOutput
from app.protocol.chat_output import OutputPlan
from app.protocol.models import (
    ChatChoice, ChatCompletionRequest, ChatCompletionResponse, ChatCompletionStreamResponse,
    ChatStreamChoice, ChoiceLogprobs, CompletionChoice, CompletionLogprobs, CompletionRequest,
    CompletionResponse, CompletionStreamResponse, DeltaMessage, FunctionCall, ResponseMessage, TokenLogprob,
    ToolCall, TopLogprob, UsageInfo, now, random_id,
)

# --------------------------------------------------------------------------- token text

def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = (b for b in range(256) if b not in table)
    table.update({b: chr(256 + i) for i, b in enumerate(extra)})
    return table


BYTE_DECODER = {char: byte for byte, char in _bytes_to_unicode().items()}
BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece byte tokens


def raw_token_bytes(tokenizer, token_id: int) -> bytes | None:
    """The exact bytes behind one vocabulary entry, when the vocabulary spells them out."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if piece is None:
        return None
    if match := BYTE_FALLBACK.fullmatch(piece):
        return bytes([int(match[1], 16)])
    if piece and all(c in BYTE_DECODER for c in piece):
        return bytes(BYTE_DECODER[c] for c in piece)
    return None


def token_text(tokenizer, token_id: int) -> tuple[str, list[int]]:
    """(text, UTF-8 bytes) of one token as OpenAI shows it in logprobs.

    A token holding part of a multi-byte character decodes to U+FFFD; OpenAI shows such a
    token as escaped bytes ("\\xe4\\xbd") and gives the real bytes, so we do the same.
    """
    text = tokenizer.decode([token_id])
    piece = tokenizer.convert_ids_to_tokens(token_id) or ""
    if piece.startswith("\u2581") and not text.startswith(" "):
        text = " " + text  # sentencepiece decoders strip the word-start space of a lone token
    if "\ufffd" in text and (raw := raw_token_bytes(tokenizer, token_id)) is not None:
        return raw.decode("utf-8", errors="backslashreplace"), list(raw)
    return text, list(text.encode("utf-8"))


def safe_logprob(value: float) -> float:
    # JSON has no -inf; vLLM and OpenAI clients expect a large negative number instead.
    return -9999.0 if math.isnan(value) or value < -9999.0 else value


def top_k(position: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The k most likely tokens at one position (the chosen token only if it is among them)."""
    return sorted(position.items(), key=lambda item: -item[1])[:k]


# --------------------------------------------------------------------------- logprobs

def top_entries(tokenizer, position: dict[int, float], k: int) -> list[TopLogprob]:
    entries = []
    for token_id, logprob in top_k(position, k):
        text, raw = token_text(tokenizer, token_id)
        entries.append(TopLogprob(token=text, logprob=safe_logprob(logprob), bytes=raw))
    return entries


def chat_logprobs(tokenizer, token_ids: list[int], logprobs, k: int) -> ChoiceLogprobs:
    content = []
    for token_id, position in zip(token_ids, logprobs or []):
        text, raw = token_text(tokenizer, token_id)
        content.append(TokenLogprob(token=text, logprob=safe_logprob(position[token_id]),
                                    bytes=raw, top_logprobs=top_entries(tokenizer, position, k)))
    return ChoiceLogprobs(content=content)


def completion_logprobs(tokenizer, token_ids: list[int], logprobs, k: int,
                        offset: int = 0) -> CompletionLogprobs:
    """Legacy logprobs; a None position (the first prompt token) has no log-prob.

    text_offset counts characters of the decoded text, so a token holding half a character
    adds nothing until the token that completes it.
    """
    result, chars = CompletionLogprobs(), codecs.getincrementaldecoder("utf-8")("replace")
    for token_id, position in zip(token_ids, logprobs):
        text, raw = token_text(tokenizer, token_id)
        result.tokens.append(text)
        result.text_offset.append(offset)
        offset += len(chars.decode(bytes(raw)))
        if position is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            continue
        result.token_logprobs.append(safe_logprob(position[token_id]))
        result.top_logprobs.append({token_text(tokenizer, tid)[0]: safe_logprob(lp)
                                    for tid, lp in top_k(position, k)})
    return result


def echo_logprobs(output: RequestOutput) -> list:
    """Prompt positions' log-probs, padded with None where the engine sent none."""
    given = list(output.prompt_logprobs or [])
    return given + [None] * (len(output.prompt_token_ids) - len(given))


# --------------------------------------------------------------------------- whole responses

def usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


def chat_response(request: ChatCompletionRequest, output: RequestOutput, tokenizer,
                  model: str, response_id: str, created: int | None = None,
                  plan: OutputPlan | None = None) -> dict:
    choices = []
    for out in sorted(output.outputs, key=lambda o: o.index):
        logprobs = None
        if request.logprobs:
            logprobs = chat_logprobs(tokenizer, out.token_ids, out.logprobs,
                                     request.top_logprobs or 0)
        message, finish_reason = chat_message(out, plan)
        choices.append(ChatChoice(index=out.index, message=message, logprobs=logprobs,
                                  finish_reason=finish_reason, stop_reason=out.stop_reason))
    completion_tokens = sum(len(o.token_ids) for o in output.outputs)
    return ChatCompletionResponse(
        id=response_id, created=created or now(), model=model, choices=choices,
        usage=usage(len(output.prompt_token_ids), completion_tokens)).model_dump()


def chat_message(out, plan: OutputPlan | None) -> tuple[ResponseMessage, str | None]:
    """The message and finish reason of one choice, split by the request's parsers."""
    if plan is None or not plan.active:
        return ResponseMessage(content=out.text), out.finish_reason
    parsed = plan.parser().feed(out.text, final=True)
    calls = [ToolCall(id=random_id("call_"),
                      function=FunctionCall(name=c.name, arguments=c.arguments))
             for c in parsed.calls]
    # No content: null beside calls, and for harmony when no final message came (as vLLM).
    absent = None if calls or plan.channels is not None else ""
    message = ResponseMessage(content=parsed.content or absent,
                              reasoning_content=parsed.reasoning or None, tool_calls=calls or None)
    return message, ("tool_calls" if calls else out.finish_reason)


def prompt_text(tokenizer, prompt: str | list[int], output: RequestOutput) -> str:
    if isinstance(prompt, str):
        return prompt
    return output.prompt if output.prompt is not None else tokenizer.decode(prompt)


def completion_choice(request: CompletionRequest, prompt: str | list[int],
                      output: RequestOutput, out, index: int, tokenizer) -> CompletionChoice:
    """One choice; with echo the prompt (and its log-probs) comes first."""
    text, token_ids, positions = out.text, list(out.token_ids), list(out.logprobs or [])
    if request.echo:
        text = prompt_text(tokenizer, prompt, output) + text
        token_ids = list(output.prompt_token_ids) + token_ids
        positions = echo_logprobs(output) + positions
    logprobs = None
    if request.logprobs is not None:
        logprobs = completion_logprobs(tokenizer, token_ids, positions, request.logprobs)
    ids = request.return_token_ids
    return CompletionChoice(index=index, text=text, logprobs=logprobs,
                            finish_reason=out.finish_reason, stop_reason=out.stop_reason,
                            prompt_token_ids=list(output.prompt_token_ids) if ids else None,
                            token_ids=list(out.token_ids) if ids else None)


def completion_response(request: CompletionRequest, outputs: list[RequestOutput], tokenizer,
                        model: str, response_id: str, created: int | None = None) -> dict:
    """`outputs` holds one cumulative output per prompt, in `request.prompts()` order."""
    choices, prompt_tokens, completion_tokens = [], 0, 0
    for prompt_i, (prompt, output) in enumerate(zip(request.prompts(), outputs)):
        prompt_tokens += len(output.prompt_token_ids)
        for out in sorted(output.outputs, key=lambda o: o.index):
            index = prompt_i * request.n + out.index
            choices.append(completion_choice(request, prompt, output, out, index, tokenizer))
            completion_tokens += len(out.token_ids)
    return CompletionResponse(
        id=response_id, created=created or now(), model=model, choices=choices,
        usage=usage(prompt_tokens, completion_tokens)).model_dump()


# --------------------------------------------------------------------------- streams

@dataclass
class StreamCounter:
    """Token counts over a stream of deltas (prompt counted once per engine request)."""
    prompt_tokens: dict[str, int] = field(default_factory=dict)
    completion_tokens: int = 0

    def add(self, delta: RequestOutput) -> None:
        if delta.prompt_token_ids is not None:  # a request's first output carries them
            self.prompt_tokens.setdefault(delta.request_id, len(delta.prompt_token_ids))
        self.completion_tokens += sum(len(o.token_ids) for o in delta.outputs)

    def usage(self, known_prompt_tokens: int = 0) -> UsageInfo:
        """`known_prompt_tokens`: the route's count, for chunks sent before any engine output."""
        return usage(max(sum(self.prompt_tokens.values()), known_prompt_tokens),
                     self.completion_tokens)


def dump_chunk(chunk, include_usage: bool) -> dict:
    # OpenAI sends `"usage": null` on every chunk only when the client asked for usage.
    body = chunk.model_dump()
    if not include_usage:
        body.pop("usage")
    return body


@dataclass
class ChatStream:
    """Chunks of one streamed chat completion: role chunks, deltas, then the usage chunk.

    The first chunk of each choice carries the role, whether the caller sends
    `role_chunks()` up front (as OpenAI does) or goes straight to `chunks()`.
    """
    request: ChatCompletionRequest
    tokenizer: object
    model: str
    response_id: str
    created: int = field(default_factory=now)
    counter: StreamCounter = field(default_factory=StreamCounter)
    role_sent: set[int] = field(default_factory=set)
    plan: OutputPlan | None = None  # reasoning / tool-call parsing, when the request has any
    prompt_tokens: int = 0  # for continuous usage before the first output
    parsers: dict = field(default_factory=dict)  # choice index -> its ChoiceParser
    num_calls: dict[int, int] = field(default_factory=dict)  # choice index -> calls sent

    def chunk(self, choices: list[ChatStreamChoice], usage_info=None) -> dict:
        if usage_info is None and self.request.continuous_usage:
            usage_info = self.counter.usage(self.prompt_tokens)
        return dump_chunk(ChatCompletionStreamResponse(
            id=self.response_id, created=self.created, model=self.model, choices=choices,
            usage=usage_info), self.request.include_usage)

    def role_chunks(self) -> list[dict]:
        """One chunk per choice with the role and empty content."""
        self.role_sent.update(range(self.request.n))
        return [self.chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant",
                                                                         content=""))])
                for i in range(self.request.n)]

    def chunks(self, delta: RequestOutput) -> list[dict]:
        self.counter.add(delta)
        if self.plan is not None and self.plan.active:
            return [self.chunk([c]) for out in delta.outputs for c in self.parsed_choices(out)]
        return [self.chunk([choice]) for out in delta.outputs
                if (choice := self.choice(out)) is not None]

    def parsed_choices(self, out) -> list[ChatStreamChoice]:
        """Content and reasoning first, then per completed call a header delta (index, id,
        type, name) and its arguments; the last chunk carries the finish reason."""
        parser = self.parsers.setdefault(out.index, self.plan.parser())
        parsed = parser.feed(out.text, final=out.finish_reason is not None)
        logprobs = None
        if self.request.logprobs and out.token_ids:
            logprobs = chat_logprobs(self.tokenizer, out.token_ids, out.logprobs,
                                     self.request.top_logprobs or 0)
        first = out.index not in self.role_sent
        self.role_sent.add(out.index)
        choices = []
        if parsed.content or parsed.reasoning or first or logprobs:
            message = DeltaMessage(role="assistant" if first else None,
                                   content=parsed.content or ("" if first else None),
                                   reasoning_content=parsed.reasoning or None)
            choices.append(ChatStreamChoice(index=out.index, delta=message, logprobs=logprobs))
        for call in parsed.calls:
            choices.extend(ChatStreamChoice(index=out.index, delta=DeltaMessage(tool_calls=[d]))
                           for d in self.call_deltas(out.index, call))
        if out.finish_reason is not None:
            if not choices:
                choices.append(ChatStreamChoice(index=out.index, delta=DeltaMessage()))
            called = self.num_calls.get(out.index, 0) > 0
            choices[-1].finish_reason = "tool_calls" if called else out.finish_reason
            choices[-1].stop_reason = out.stop_reason
        return choices

    def call_deltas(self, index: int, call) -> list[dict]:
        n = self.num_calls.get(index, 0)
        self.num_calls[index] = n + 1
        return [{"index": n, "id": random_id("call_"), "type": "function",
                 "function": {"name": call.name, "arguments": ""}},
                {"index": n, "function": {"arguments": call.arguments}}]

    def choice(self, out) -> ChatStreamChoice | None:
        logprobs = None
        if self.request.logprobs and out.token_ids:
            logprobs = chat_logprobs(self.tokenizer, out.token_ids, out.logprobs,
                                     self.request.top_logprobs or 0)
        first = out.index not in self.role_sent
        if not (out.text or first or out.finish_reason or logprobs):
            return None  # nothing new to show (text held back at a possible stop string)
        self.role_sent.add(out.index)
        message = DeltaMessage(role="assistant" if first else None,
                               content=out.text if out.text or first else None)
        return ChatStreamChoice(index=out.index, delta=message, logprobs=logprobs,
                                finish_reason=out.finish_reason, stop_reason=out.stop_reason)

    def usage_chunk(self) -> dict | None:
        """The final `choices: []` chunk with usage, if the client asked for it."""
        if not self.request.include_usage:
            return None
        return self.chunk([], self.counter.usage())


@dataclass
class CompletionStream:
    """Chunks of one streamed completion; `prompt_index` says which prompt a delta is for."""
    request: CompletionRequest
    tokenizer: object
    model: str
    response_id: str
    created: int = field(default_factory=now)
    counter: StreamCounter = field(default_factory=StreamCounter)
    offsets: dict[int, int] = field(default_factory=dict)  # choice index -> text offset so far
    prompt_tokens: int = 0  # for continuous usage
    firsts: dict[int, RequestOutput] = field(default_factory=dict)  # prompt index -> its first output

    def chunks(self, delta: RequestOutput, prompt_index: int = 0) -> list[dict]:
        self.counter.add(delta)
        first = self.firsts.setdefault(prompt_index, delta)  # the one with the prompt's ids and log-probs
        prompt = self.request.prompts()[prompt_index]
        choices = [self.choice(first, out, prompt, prompt_index * self.request.n + out.index)
                   for out in delta.outputs]
        return [self.chunk([c]) for c in choices if c is not None]

    def choice(self, first: RequestOutput, out, prompt, index: int) -> CompletionChoice | None:
        """`out`: a sequence's news; `first`: its request's first output (a choice first seen
        later, one of n samples, echoes the prompt from there)."""
        echoing = self.request.echo and index not in self.offsets
        text = (prompt_text(self.tokenizer, prompt, first) if echoing else "") + out.text
        token_ids = (list(first.prompt_token_ids) if echoing else []) + list(out.token_ids)
        positions = (echo_logprobs(first) if echoing else []) + list(out.logprobs or [])
        if not text and out.finish_reason is None and not token_ids:
            return None
        logprobs = None
        if self.request.logprobs is not None:
            logprobs = completion_logprobs(self.tokenizer, token_ids, positions,
                                           self.request.logprobs, self.offsets.get(index, 0))
        self.offsets[index] = self.offsets.get(index, 0) + len(text)
        return CompletionChoice(index=index, text=text, logprobs=logprobs,
                                finish_reason=out.finish_reason, stop_reason=out.stop_reason)

    def chunk(self, choices: list[CompletionChoice], usage_info=None) -> dict:
        if usage_info is None and self.request.continuous_usage:
            usage_info = self.counter.usage(self.prompt_tokens)
        return dump_chunk(CompletionStreamResponse(
            id=self.response_id, created=self.created, model=self.model, choices=choices,
            usage=usage_info), self.request.include_usage)

    def usage_chunk(self) -> dict | None:
        if not self.request.include_usage:
            return None
        return self.chunk([], self.counter.usage())
