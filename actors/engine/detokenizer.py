"""Incremental detokenization and stop strings, per sequence.

Text is released only when it is final: never half of a multi-byte character (the decoded
tail still ends in U+FFFD) and never a piece that could turn out to start a stop string. When
the sequence ends, everything held is released, a cut character as U+FFFD, so the whole text
equals `tokenizer.decode(token_ids)` (up to a stop string).
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial

from tokenizers import Tokenizer

REPLACEMENT = "\ufffd"


def decoder(tokenizer, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """`ids -> tokenizer.decode(ids, skip_special_tokens=...)`. For a fast tokenizer that does not
    clean up tokenization spaces, that is its Rust tokenizer's own decode: transformers' wrapper
    only converts the arguments, at ~3x the cost, and a decode step makes two calls per sequence
    (docs/benchmarks.md)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if isinstance(backend, Tokenizer) and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return partial(backend.decode, skip_special_tokens=skip_special_tokens)
    return partial(tokenizer.decode, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str],
                 skip_special_tokens: bool = True, include_stop: bool = False):
        self._decode = decoder(tokenizer, skip_special_tokens)
        self.stop = stop
        self.include_stop = include_stop
        # A few prompt tokens give the decoder context (e.g. leading-space handling).
        self.ids = list(prompt_ids[-4:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # output text decoded so far
        self.sent = 0  # characters of self.text already released

    def add(self, token_id: int, check_stop: bool = True) -> str | None:
        """Add one token. Returns the stop string that matched, if any (text is then final)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if full.endswith(REPLACEMENT) or len(full) <= len(prefix):
            return None  # an unfinished character: wait for the next token
        search_from = max(0, len(self.text) - max((len(s) for s in self.stop), default=0) + 1)
        self.text += full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._find_stop(search_from) if check_stop else None

    def _find_stop(self, search_from: int) -> str | None:
        for s in self.stop:
            at = self.text.find(s, search_from)
            if at != -1:
                self.text = self.text[:at + len(s)] if self.include_stop else self.text[:at]
                return s
        return None

    def release(self, final: bool) -> str:
        """New text that is safe to show; everything left when the sequence is final."""
        if final:
            self._flush()
        end = len(self.text) if final else len(self.text) - self._held_back()
        piece = self.text[self.sent:end]
        self.sent = max(self.sent, end)
        return piece

    def _flush(self) -> None:
        """Decode the tokens still held for an unfinished character, as decode() would."""
        if self.read_offset < len(self.ids):
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            self.text += self._decode(self.ids[self.prefix_offset:])[len(prefix):]
            self.prefix_offset = self.read_offset = len(self.ids)

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        held = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), held, -1):
                if self.text.endswith(s[:n]):
                    held = n
                    break
        return held
