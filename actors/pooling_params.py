"""Per-request embedding settings: how a prompt's final hidden states become one vector.

An embedding request (EngineRequest.pooling set) runs its prompt through prefill and finishes
with the pooled vector instead of generating. The API sets `dimensions`; `method` and
`normalize` left None take the model's own (actors/worker/pooling_config.py reads them from
the checkpoint's sentence-transformers files).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

METHODS = ("last", "mean")


@dataclass(frozen=True)
class PoolingParams:
    dimensions: int | None = None  # keep the first N (Matryoshka), normalized again if `normalize`
    method: str | None = None  # "last": the last prompt token's hidden state; "mean": all of them
    normalize: bool | None = None  # L2-normalize the vector

    def __post_init__(self):
        if self.method is not None and self.method not in METHODS:
            raise ValueError(f"pooling method must be one of {METHODS}, got {self.method!r}")

    def resolved(self, model: PoolingParams) -> PoolingParams:
        """These settings with the model's in place of the ones left None."""
        return dataclasses.replace(
            self, method=self.method or model.method,
            normalize=model.normalize if self.normalize is None else self.normalize)

    @property
    def needs_every_prompt_token(self) -> bool:
        """Every prompt token's hidden state is pooled: none may come from the prefix cache."""
        return self.method == "mean"

    def rows(self, start: int, num_tokens: int, prompt_len: int) -> tuple[int, int] | None:
        """Which of a prompt chunk's rows (first, end), counted from the chunk's first token,
        the pooling sums; None: none of them."""
        if self.method == "mean":
            return 0, num_tokens
        if start + num_tokens == prompt_len:  # the chunk that holds the prompt's last token
            return num_tokens - 1, num_tokens
        return None
