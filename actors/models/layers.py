"""Tensor-parallel building blocks. With tp_size 1 each is exactly its plain torch layer.

Column-parallel layers are plain nn.Linear with this rank's share of the output rows; the
row-parallel one sums the partial products of all ranks before adding its bias; the vocab is
split across ranks for the embedding and the LM head. Both linear layers take an optional
`lora` (actors/models/lora.py: adapter slots), whose per-row delta joins the product before
the all-reduce.
"""
from __future__ import annotations

import torch
from torch import nn

from actors.distributed.parallel import Parallel
from kernels.int4_linear import int4_linear
from kernels.linear import embedding, linear
from kernels.quantization import quantized_rows


class ColumnParallelLinear(nn.Linear):
    """This rank's share of the output rows (the loader slices them: weight_rule)."""

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__(in_features, out_features, bias=bias)
        self.lora = None  # LoraWeights when adapters are enabled
        self.register_buffer("weight_scale", None)  # 8-bit weights' scales (kernels/quantization.py)
        self.int4 = None  # a packed checkpoint's weight kept packed (actors/worker/loader.py _keep_packed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = product(self, x, self.bias)
        return y if self.lora is None else self.lora.add_delta(x, y)


class RowParallelLinear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool, p: Parallel):
        super().__init__(in_features, out_features, bias=bias)
        self.p = p
        self.lora = None  # LoraWeights when adapters are enabled
        self.register_buffer("weight_scale", None)  # 8-bit weights' scales (kernels/quantization.py)
        self.int4 = None  # a packed checkpoint's weight kept packed (actors/worker/loader.py _keep_packed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.p.tp_size == 1:
            y = product(self, x, self.bias)
            return y if self.lora is None else self.lora.add_delta(x, y)
        y = product(self, x, None)
        if self.lora is not None:  # this rank's share of the delta, summed with the product
            y = self.lora.add_delta(x, y)
        y = self.p.all_reduce(y)
        return y if self.bias is None else y + self.bias


def product(layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x times a linear layer's weight (+ bias): float, 8-bit (weight_scale) or packed int4."""
    if layer.int4 is not None:
        return int4_linear(x, **layer.int4, bias=bias)
    return linear(x, layer.weight, bias, layer.weight_scale)


def vocab_shard(vocab: int, p: Parallel) -> tuple[int, int]:
    """(first id, rows) of this rank's slice of a vocab padded to a multiple of tp_size."""
    rows = -(-vocab // p.tp_size)
    return p.tp_rank * rows, rows


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab: int, hidden: int, p: Parallel):
        super().__init__()
        self.p = p
        self.start, rows = vocab_shard(vocab, p)
        self.rows = rows
        self.weight = nn.Parameter(torch.empty(rows, hidden))
        self.register_buffer("weight_scale", None)  # 8-bit weights' scales (kernels/quantization.py)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.weight_scale is None:
            return embedding(ids, self.weight)
        return quantized_rows(ids, self.weight, self.weight_scale, self.out_dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.p.tp_size == 1:
            return self.lookup(ids)
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        x = self.lookup(local.masked_fill(outside, 0))
        return self.p.all_reduce(x.masked_fill(outside[:, None], 0.0))


class ParallelLMHead(nn.Module):
    def __init__(self, vocab: int, hidden: int, p: Parallel, bias: bool = False):
        super().__init__()
        self.p, self.vocab = p, vocab
        _, rows = vocab_shard(vocab, p)
        self.weight = nn.Parameter(torch.empty(rows, hidden))
        self.bias = nn.Parameter(torch.empty(rows)) if bias else None  # Phi-2's
        self.register_buffer("weight_scale", None)  # 8-bit weights' scales (kernels/quantization.py)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.p.all_gather_last_dim(linear(hidden, self.weight, self.bias, scale=self.weight_scale))
        return logits[..., :self.vocab]
