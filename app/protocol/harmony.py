"""Harmony output (OpenAI gpt-oss): channel messages -> reasoning, content and tool calls.

The prompt ends in `<|start|>assistant`, so the output is one or more messages such as
    <|channel|>analysis<|message|>thinking<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"a": 1}<|call|>
    <|start|>assistant<|channel|>final<|message|>answer<|return|>
(the recipient may also stand before the channel:
`<|start|>assistant to=functions.x<|channel|>commentary json<|message|>`).
A header (everything up to `<|message|>`) is never shown. The analysis channel is reasoning, a
message to `functions.NAME` is a call to NAME, anything else (final, commentary preambles) is
content; two messages of one kind are joined by a newline. `<|return|>` and `<|call|>` stop
generation (their text is never shown), so a body ends at `<|end|>` or at the end of the output.

Bodies are released as they arrive, except a tail that may still grow into a marker; a call
when its message is complete. Like the other scanners it gives the same split whatever the
chunking. Bad output degrades to content: text with no `<|message|>` near its start (a model
that ignores the format) and calls whose arguments are not a JSON object.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from app.protocol.tool_parsers.calls import ParsedCall, dumps, loads

MESSAGE, START = "<|message|>", "<|start|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>", START)  # START: a message whose <|end|> is missing
MARKERS = ENDS + (MESSAGE, "<|channel|>", "<|constrain|>")
MAX_HEADER = 256  # a longer run without <|message|> is not a header: the output is plain text
FUNCTIONS = "functions."
RECIPIENT = re.compile(r"\bto=([^\s<]+)")
CHANNEL = re.compile(r"<\|channel\|>\s*([\w-]+)")

HEADER, BODY, RAW = "header", "body", "raw"
REASONING, CONTENT, CALL = "reasoning", "content", "call"


def is_harmony_template(template) -> bool:
    """A chat template that writes harmony messages (gpt-oss's)."""
    if isinstance(template, dict):  # several named templates
        template = " ".join(str(t) for t in template.values())
    return isinstance(template, str) and "<|channel|>" in template and "<|message|>" in template


@dataclass(frozen=True)
class Channels:
    """What a request reads from the channels."""
    reasoning: bool = True  # analysis -> reasoning_content (off: it stays content)
    calls: bool = True  # messages to functions.NAME -> tool calls (off: their text is content)


@dataclass
class Split:
    reasoning: str = ""
    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)


class HarmonyScanner:
    def __init__(self, channels: Channels = Channels()):
        self.channels = channels
        self.text = ""
        self.pos = 0  # everything before it has been released or resolved
        self.state = HEADER
        self.kind = CONTENT  # what the current body is
        self.name = ""  # the current call's function
        self.fresh = True  # the current body has released nothing yet
        self.released = {REASONING: False, CONTENT: False}

    def feed(self, delta: str, final: bool = False) -> Split:
        self.text += delta
        out = Split()
        progressing = True
        while progressing:
            if self.state == HEADER:
                progressing = self._header(final, out)
            elif self.state == BODY:
                progressing = self._body(final, out)
            else:
                self._emit(CONTENT, self._take(len(self.text)), out)
                progressing = False
        return out

    # ---- headers --------------------------------------------------------------------------
    def _header(self, final: bool, out: Split) -> bool:
        """True when the state moved on."""
        rest = self.text[self.pos:]
        at = rest.find(MESSAGE)
        if at > MAX_HEADER or (at < 0 and len(rest) >= MAX_HEADER + len(MESSAGE)):
            self.state, self.fresh = RAW, True  # the rest is one more piece of content
            return True
        if at >= 0:
            self._open(rest[:at])
            self.pos += at + len(MESSAGE)
            return True
        if final:
            # Cut short in a header (max_tokens): hidden. Anything else (text of a model that
            # ignores the format, JSON of a response_format): content.
            leftover = self._take(len(self.text))
            if not leftover.lstrip().startswith(("<|", "to=")):
                self._emit(CONTENT, leftover, out)
        return False

    def _open(self, header: str) -> None:
        recipient = RECIPIENT.search(header)
        channel = CHANNEL.search(header)
        to = recipient[1] if recipient else ""
        if to.startswith(FUNCTIONS) and len(to) > len(FUNCTIONS) and self.channels.calls:
            self.kind, self.name = CALL, to[len(FUNCTIONS):]
        elif channel and channel[1] == "analysis" and self.channels.reasoning:
            self.kind = REASONING
        else:
            self.kind = CONTENT
        self.state, self.fresh = BODY, True

    # ---- bodies ---------------------------------------------------------------------------
    def _body(self, final: bool, out: Split) -> bool:
        rest = self.text[self.pos:]
        found = [(i, m) for m in ENDS if (i := rest.find(m)) >= 0]
        if found:
            at, marker = min(found)
            self._close(self._take(self.pos + at), out)
            self.pos += 0 if marker == START else len(marker)  # START belongs to the next header
            self.state = HEADER
            return True
        if self.kind == CALL:
            if final:
                self._close(self._take(len(self.text)), out)
            return False
        self._emit(self.kind, self._take(len(self.text) if final else len(self.text) - _held(rest)), out)
        return False

    def _close(self, body: str, out: Split) -> None:
        if self.kind != CALL:
            self._emit(self.kind, body, out)
            return
        call = _call(self.name, body)
        if call is None:
            self._emit(CONTENT, body, out)  # arguments that are not JSON: shown, not lost
        else:
            out.calls.append(call)

    # ---- releasing ------------------------------------------------------------------------
    def _take(self, end: int) -> str:
        piece = self.text[self.pos:end]
        self.pos = end
        return piece

    def _emit(self, kind: str, piece: str, out: Split) -> None:
        if not piece:
            return
        if self.fresh and self.released[kind]:
            piece = "\n" + piece  # a second message of this kind
        self.fresh, self.released[kind] = False, True
        if kind == REASONING:
            out.reasoning += piece
        else:
            out.content += piece


def _call(name: str, body: str) -> ParsedCall | None:
    try:
        args = loads(body.strip())
    except json.JSONDecodeError:
        return None
    if not isinstance(args, dict):
        return None
    try:
        return ParsedCall(name, dumps(args))
    except ValueError:  # NaN or Infinity: JSON text can't carry them
        return None


def _held(text: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a marker."""
    start = text.rfind("<", max(0, len(text) - max(map(len, MARKERS)) + 1))
    while start >= 0:
        tail = text[start:]
        if any(m.startswith(tail) and m != tail for m in MARKERS):
            return len(tail)
        start = text.find("<", start + 1)
    return 0
