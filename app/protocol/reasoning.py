"""Reasoning output: `<think>...</think>` goes to `reasoning_content`, the rest to `content`.
Gemma 4 marks it `<|channel>thought\n...<channel|>` instead (its channel's name, `thought\n`,
is no part of the reasoning); the rest below holds for either marking.

Where the output starts is read off the rendered prompt, so one scanner covers every template:
- the prompt closes a think block (`enable_thinking=false` pre-fills `<think></think>`, Gemma 4's
  `<|channel>thought\n<channel|>`): the output is all content;
- the prompt opens one (DeepSeek-R1, Qwen3 thinking-only templates): the output starts inside
  the reasoning; deepseek_r1 assumes so even when the prompt says nothing;
- otherwise the output may open with `<think>` (Qwen3).
Unterminated reasoning (cut by max_tokens) stays reasoning. Like the tool-call scanner, it
gives the same split whatever the chunking.
"""
from __future__ import annotations

from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"
HARMONY = "harmony"  # gpt-oss's analysis channel: read by app/protocol/harmony.py, not here
PARSERS = ("qwen3", "deepseek_r1", "gemma4", HARMONY)
# vLLM's names: openai_gptoss; glm45 (GLM-4.5's <think> blocks, as Qwen3's); minimax_m2 (its prompt
# opens the block, the output closes it, as R1's)
ALIASES = {"openai_gptoss": HARMONY, "gpt_oss": HARMONY, "openai": HARMONY, "glm45": "qwen3",
           "minimax_m2": "deepseek_r1"}


@dataclass(frozen=True)
class Markers:
    open: str
    close: str
    label: str = ""  # what the model writes right after `open` that is not reasoning


THINK = Markers(OPEN, CLOSE)
MARKERS = {"qwen3": THINK, "deepseek_r1": THINK,  # parser -> how its models mark reasoning
           "gemma4": Markers("<|channel>", "<channel|>", "thought\n")}

START, REASONING, CONTENT = "start", "reasoning", "content"


def reasoning_parser_name(name: str | None) -> str | None:
    """The canonical parser name (deepseek-r1 -> deepseek_r1, openai_gptoss -> harmony);
    ValueError for unknown ones."""
    if not name or name.lower() == "none":  # none: off, even for a model that declares one
        return None
    key = name.lower().replace("-", "_")
    key = ALIASES.get(key, key)
    if key not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose from {', '.join(PARSERS)}")
    return key


def initial_state(parser: str, prompt_text: str, thinking_disabled: bool) -> tuple[str, bool]:
    """(state, implied_open): how the output of this prompt starts."""
    marks = MARKERS.get(parser, THINK)
    tail = prompt_text.rstrip()
    if tail.endswith(marks.close):
        return CONTENT, False
    if tail.endswith(marks.open) or (marks.label and tail.endswith(marks.open + marks.label.rstrip())):
        return START, True
    return START, parser == "deepseek_r1" and not thinking_disabled


class ReasoningScanner:
    def __init__(self, state: str = START, implied_open: bool = False, markers: Markers = THINK):
        self.state, self.implied_open, self.markers = state, implied_open, markers
        self.text = ""
        self.pos = 0
        self.pending_ws = ""  # reasoning's trailing blanks: dropped if `</think>` follows
        self.started = False  # reasoning text released (its leading blanks are dropped)
        self.trim_lead = False  # drop the blanks between `</think>` and the answer
        self.label_pending = bool(markers.label)  # the label may still open the reasoning

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) released by this delta."""
        self.text += delta
        reasoning = ""
        if self.state == START:
            self._open(final)
        if self.state == REASONING:
            reasoning = self._reasoning(final)
        if self.state != CONTENT:
            return reasoning, ""
        content = self.text[self.pos:]
        self.pos = len(self.text)
        if self.trim_lead:
            content = content.lstrip()
            self.trim_lead = not content
        return reasoning, content

    def _open(self, final: bool) -> None:
        rest = self.text[self.pos:]
        stripped = rest.lstrip()
        opener = self.markers.open
        if stripped.startswith(opener):
            self.pos += len(rest) - len(stripped) + len(opener)
            self.state = REASONING
        elif opener.startswith(stripped) and not final:
            return  # blank, or the start of the opener: wait
        else:
            self.state = REASONING if self.implied_open else CONTENT

    def _reasoning(self, final: bool) -> str:
        rest = self.text[self.pos:]
        if self.label_pending:
            label = self.markers.label
            if label.startswith(rest) and len(rest) < len(label) and not final:
                return ""  # the start of the label, or of something else: wait
            self.label_pending = False
            if rest.startswith(label):
                self.pos += len(label)
                rest = rest[len(label):]
        close = self.markers.close
        at = rest.find(close)
        if at >= 0:
            piece = self._release(rest[:at], closing=True)
            self.pos += at + len(close)
            self.state = CONTENT
            self.trim_lead = True  # the answer starts after the blank line that follows
            return piece
        keep = len(rest) if final else len(rest) - _held(rest, close)
        self.pos += keep
        return self._release(rest[:keep], closing=final)

    def _release(self, piece: str, closing: bool) -> str:
        if not self.started:
            piece = piece.lstrip()
        body = piece.rstrip()
        if not body:
            self.pending_ws = "" if closing else self.pending_ws + piece
            return ""
        out = self.pending_ws + body
        self.pending_ws = "" if closing else piece[len(body):]
        self.started = True
        return out


def _held(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
