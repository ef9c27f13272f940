"""Per-request sampling settings (vLLM's names, so request bodies map one to one)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

KINDS = ("json", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match. `spec` by kind: json: a JSON schema as JSON text ("" is any
    JSON object); regex: a pattern; choice: a JSON list of strings; grammar: EBNF (GBNF);
    structural_tag: xgrammar's structural-tag JSON (tool calls use it)."""
    kind: str
    spec: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {KINDS}, got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise ValueError("structured output spec must be a string")

    @classmethod
    def json_schema(cls, schema: dict | str | None = None) -> StructuredOutput:
        if not isinstance(schema, str) and schema is not None:
            schema = json.dumps(schema, sort_keys=True)  # one cache entry whatever the key order
        return cls("json", schema or "")

    @classmethod
    def choice(cls, choices: list[str]) -> StructuredOutput:
        return cls("choice", json.dumps(list(choices)))


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16  # None: up to the model length
    min_tokens: int = 0
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k: chosen token plus k alternatives
    prompt_logprobs: int | None = None  # None: off; k: prompt token plus k alternatives
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Grammar constraint (structured outputs, forced tool calls): plain data, so it crosses Ray.
    structured: StructuredOutput | None = None
    # vLLM's cache_salt: prefix-cache blocks are shared only between requests with the same
    # salt (and none with none), so tenants can't probe each other's prompts by timing.
    cache_salt: str | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    @property
    def penalizes_output(self) -> bool:
        """Its next token depends on the tokens so far through penalties, not only the model."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def validate(self) -> None:
        """Raise ValueError naming the field for values no sampler can honour."""
        checks = [
            ("n", self.n >= 1, "must be at least 1"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 0, "must be non-negative"),
            ("min_tokens", self.min_tokens >= 0, "must be non-negative"),
            ("min_tokens", self.max_tokens is None or self.min_tokens <= self.max_tokens,
             f"must be at most max_tokens ({self.max_tokens})"),
            ("temperature", 0 <= self.temperature < math.inf, "must be non-negative and finite"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", self.top_k >= 0, "must be -1, 0 or positive"),
            ("seed", self.seed is None or -2**63 <= self.seed <= 2**64 - self.n,  # torch's range
             "must fit in 64 bits"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            ("repetition_penalty", 0 < self.repetition_penalty < math.inf, "must be positive and finite"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "must be in [0, 20]"),
            ("prompt_logprobs", self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
             "must be in [0, 20]"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")
