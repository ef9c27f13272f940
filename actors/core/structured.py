"""Grammar-constrained decoding (structured outputs) with xgrammar.

A request's constraint is plain data, `StructuredOutput` (a kind and a string): it rides in
SamplingParams across Ray from the replica to the scheduler actor and keys the compile
cache. `Grammars` compiles it against this engine's tokenizer (callers run that off the
engine loop: a big schema takes milliseconds to seconds) and makes one matcher per
sequence. Each step the sampler asks `fill_bitmask_after` for the constrained rows' token
masks; the engine advances a matcher with every token it accepts.
"""
from __future__ import annotations

import json
import os
import re
import threading
from collections import OrderedDict
from typing import Any, Callable

from actors.sampling_params import StructuredOutput

XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class Grammars:
    """Compiles StructuredOutputs (thread-safe, LRU-cached by spec) and makes matchers."""

    def __init__(self, tokenizer: Callable[[], Any], vocab_size: int, stop_token_ids: list[int],
                 capacity: int = 256):
        """tokenizer: gives the engine's tokenizer (which may still be loading at start)."""
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.capacity = capacity
        self._compiler = None
        self._cache: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, so: StructuredOutput):
        """The compiled grammar; ValueError (naming the kind) for a spec xgrammar refuses."""
        with self._lock:
            if so in self._cache:
                self._cache.move_to_end(so)
                return self._cache[so]
            compiler = self._get_compiler()
        try:
            compiled = _compile(compiler, so)
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError/pydantic errors
            raise ValueError(f"invalid {so.kind} constraint: {_first_line(exc)}") from None
        with self._lock:
            self._cache[so] = compiled
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, compiled):
        import xgrammar as xgr
        return xgr.GrammarMatcher(compiled)

    def _get_compiler(self):
        # Built on first use (the tokenizer scan costs ~1 s on a 150k vocabulary).
        if self._compiler is None:
            import xgrammar as xgr
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer(), vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=min(8, os.cpu_count() or 1))
        return self._compiler


def _compile(compiler, so: StructuredOutput):
    if so.kind == "json":
        return compiler.compile_grammar(json_ebnf(so.spec or '{"type": "object"}'))
    if so.kind == "regex":
        return compiler.compile_regex(so.spec)
    if so.kind == "choice":
        return compiler.compile_grammar(choice_ebnf(json.loads(so.spec)))
    if so.kind == "grammar":
        return compiler.compile_grammar(so.spec)
    return compiler.compile_structural_tag(json.dumps(strict_json_contents(json.loads(so.spec))))


def strict_json_contents(node):
    """A structural tag with every json_schema part as our JSON grammar (see json_ebnf)."""
    if isinstance(node, list):
        return [strict_json_contents(item) for item in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema" and node.get("style", "json") == "json":
        return {"type": "grammar", "grammar": json_ebnf(json.dumps(node["json_schema"]))}
    return {key: strict_json_contents(value) for key, value in node.items()}


# xgrammar 0.2.8 lets two kinds of invalid JSON text through its string characters: raw
# control characters (a length-bounded string is [^"\\\r\n]) and UTF-16 surrogates, which
# no UTF-8 decoder accepts. Its JSON grammars have exactly these two negated classes.
LOOSE_STRING_CHARS = (r'[^\"\\\r\n]', r'[^\0-\x1f\"\\\r\n]')
STRICT_STRING_CHAR = r'[^\0-\x1f\"\\\uD800-\uDFFF]'


def json_ebnf(schema: str) -> str:
    """The schema as EBNF: compact separators and no free whitespace (a model cannot stall in
    a run of blanks), and strings that any JSON parser reads."""
    import xgrammar as xgr
    ebnf = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False))
    for loose in LOOSE_STRING_CHARS:
        ebnf = ebnf.replace(loose, STRICT_STRING_CHAR)
    return ebnf


def choice_ebnf(choices: list[str]) -> str:
    if not choices or not all(isinstance(c, str) for c in choices):
        raise ValueError("choices must be a non-empty list of strings")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    # xgrammar prefixes "[hh:mm:ss] /project/cpp/file.cc:83: ": the client needs only the rest.
    return XGRAMMAR_PREFIX.sub("", text.splitlines()[0])[:300]


def bitmask_width(vocab_size: int) -> int:
    return -(-vocab_size // 32)


def fill_bitmask_after(matcher, tokens: list[int], out, row: int) -> None:
    """Row `row` of `out` ([B, bitmask_width] int32, CPU) gets the tokens the matcher allows
    after `tokens` (a verified row's drafts before this position, else none; the matcher is
    left as it was). Past a draft the grammar refuses or
    ends at, the row allows every token: the verification stops before it, so none is kept."""
    accepted = 0
    for token in tokens:
        if not matcher.accept_token(token):
            break
        accepted += 1
    if accepted == len(tokens) and not matcher.is_terminated():
        matcher.fill_next_token_bitmask(out, row)
    else:
        out[row] = -1
    if accepted:
        matcher.rollback(accepted)


def grammar_prefix(matcher, draft: list[int]) -> list[int]:
    """The drafts the grammar allows from the matcher's state on, up to the one that
    completes it (the matcher is left as it was)."""
    n = 0
    for token in draft:
        if not matcher.accept_token(token):
            break
        n += 1
        if matcher.is_terminated():
            break
    if n:
        matcher.rollback(n)
    return draft[:n]


def accept(matcher, token: int) -> bool:
    """Advance a matcher by one sampled token; True when the constraint allows nothing more
    (it terminated, or it rejected the token, e.g. logit_bias banned all it allowed)."""
    if not matcher.accept_token(token):
        return True
    return matcher.is_terminated()
