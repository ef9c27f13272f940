"""Split a growing model output into content text and tool calls.

One scanner serves both modes: a whole response feeds the full text once (final=True); a
stream feeds each delta. Text before a block opener is released at once, except a tail that
could still become an opener and trailing whitespace; a block is read only when complete,
so a malformed one can still fall back to text and no markup ever reaches content. Whatever
the chunking, the pieces add up to the same content and calls as the one-shot parse.
Blanks next to a call are dropped, except one run that still separates text before a call
from text after it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from app.protocol.tool_parsers.calls import ParsedCall, ToolFormat
from app.protocol.tool_parsers.xml_args import typed


@dataclass
class ScanResult:
    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)


class ToolCallScanner:
    def __init__(self, fmt: ToolFormat, tool_names=None, schemas: dict | None = None):
        """schemas: each tool's parameters (a JSON schema) by name, for formats whose
        arguments are typed by them."""
        self.fmt = fmt
        self.names = set(tool_names or [])
        self.schemas = schemas or {}
        self.text = ""
        self.pos = 0  # everything before it has been released or resolved
        self.pending_ws = ""  # trailing whitespace held until we know what follows
        self.after_call = False
        self.opened = False  # anything but blanks seen: bare-JSON formats can't open a call now
        self.has_content = False  # non-blank content released

    def feed(self, delta: str, final: bool = False) -> ScanResult:
        self.text += delta
        out = ScanResult()
        while self.pos < len(self.text):
            start, marker = self._find_start()
            if start is None:
                safe = len(self.text) if final else self._safe_end()
                self._emit_text(self.text[self.pos:safe], out)
                self.pos = safe
                break
            self._emit_text(self.text[self.pos:start], out)
            self.pos = start
            end = self._block_end(start, marker, final)
            if end is None:
                break  # wait for the rest of the block
            self._emit_block(self.text[start:end], out)
            self.pos = end
        if final and not self.after_call:
            out.content += self.pending_ws
            self.pending_ws = ""
        return out

    # ---- finding blocks -----------------------------------------------------------------
    def _find_start(self) -> tuple[int | None, str]:
        rest = self.text[self.pos:]
        if not self.fmt.anywhere:
            if self.opened:
                return None, ""
            stripped = rest.lstrip()
            for marker in self.fmt.starts:
                if stripped.startswith(marker):
                    return self.pos + len(rest) - len(stripped), marker
            return None, ""
        found = [(i, m) for m in self.fmt.starts if (i := rest.find(m)) >= 0]
        if not found:
            return None, ""
        i, marker = min(found)
        return self.pos + i, marker

    def _safe_end(self) -> int:
        """Where releasable text ends: before a tail that may still grow into an opener."""
        rest = self.text[self.pos:]
        if not self.fmt.anywhere:
            stripped = rest.lstrip()
            if self.opened or not any(m.startswith(stripped) for m in self.fmt.starts):
                return len(self.text)
            return self.pos  # blank, or a prefix of an opener: nothing is decided yet
        held = 0
        for marker in self.fmt.starts:
            for n in range(min(len(marker) - 1, len(rest)), held, -1):
                if rest.endswith(marker[:n]):
                    held = n
                    break
        return len(self.text) - held

    def _block_end(self, start: int, marker: str, final: bool) -> int | None:
        if self.fmt.end is None:
            return len(self.text) if final else None
        at = self.text.find(self.fmt.end, start + len(marker))
        if at >= 0:
            return at + len(self.fmt.end)
        return len(self.text) if final else None  # unterminated at the end: try it as it is

    # ---- releasing ----------------------------------------------------------------------
    def _emit_text(self, text: str, out: ScanResult) -> None:
        if self.after_call and not self.has_content:
            text = text.lstrip()  # content never starts with the blank after a call
        if not text:
            return
        body = text.rstrip()
        if not body:
            self.pending_ws += text
            return
        out.content += self.pending_ws + body
        self.pending_ws = text[len(body):]
        self.after_call, self.opened, self.has_content = False, True, True

    def _emit_block(self, block: str, out: ScanResult) -> None:
        calls = self._parse(block)
        if calls is None:
            self._emit_text(block, out)
            self.opened = True
            return
        out.calls.extend(calls)
        self.pending_ws = ""  # the blank before a call goes; the one after it may separate text
        self.after_call = self.opened = True

    def _parse(self, block: str) -> list[ParsedCall] | None:
        try:
            calls = self.fmt.parse_block(block)
            if calls and self.fmt.typed_by_schema:
                calls = [typed(c, self.schemas.get(c.name)) for c in calls]
                calls = None if None in calls else calls
        except Exception:  # a parser bug must not cost the response: the block stays text
            return None
        if calls and self.fmt.known_names_only and self.names:
            if any(c.name not in self.names for c in calls):
                return None
        return calls or None
