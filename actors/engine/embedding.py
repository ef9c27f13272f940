"""An embedding request's vector, built up as its prompt's chunks run.

Each step that computes part of the prompt hands back the float32 sum of the final hidden
states the pooling takes from that chunk (SchedulerOutput.pool_spans): every row for mean
pooling, the prompt's last row for last-token pooling. The sums add up here; the finished
vector is their mean (or the last row), cut to `dimensions`, then L2-normalized if asked.
"""
from __future__ import annotations

import torch

from actors.pooling_params import PoolingParams


class PooledPrompt:
    def __init__(self, params: PoolingParams, prompt_len: int):
        """params: resolved (method and normalize set)."""
        self.params, self.prompt_len = params, prompt_len
        self.total: torch.Tensor | None = None  # float64: many chunks' sums add without rounding

    def add(self, start: int, chunk_sum: list[float]) -> None:
        """The sum of a chunk that starts at prompt position `start`. A chunk at 0 starts over:
        a preempted prompt is computed again from its start (mean pooling takes no cache hits)."""
        chunk = torch.tensor(chunk_sum, dtype=torch.float64)
        self.total = chunk if start == 0 or self.total is None else self.total + chunk

    def embedding(self) -> list[float]:
        p = self.params
        vector = self.total / self.prompt_len if p.method == "mean" else self.total
        vector = vector[:p.dimensions]  # Matryoshka: the leading dimensions (all for None)
        if p.normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        return vector.float().tolist()
