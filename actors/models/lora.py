"""LoRA adapters in fixed slots of the linear layers, applied per row in batched form.

`attach_lora` gives every adaptable projection (qkv_proj, o_proj, gate_up_proj, down_proj)
stacked A and B matrices for `slots` adapters of rank up to `rank`, allocated once. A fused
projection stacks its parts' ranks: qkv_proj's A is [slots, in, 3 * rank] (q, k, v side by
side) and its B block-diagonal, so one matmul pair serves all parts.

Each step the runner sets a `LoraBatch`: the token rows grouped by adapter slot (padded to
the largest group). A projection then adds, for all groups at once,
    y[rows] += (x[rows] @ A[slot]) @ B[slot]        (B pre-multiplied by the scaling)
as two torch.bmm calls and one index_add_: no loop over requests or adapters.

Tensor parallelism: A and B are split the way their projection is. Column-parallel (qkv,
gate_up): B keeps this rank's output rows, A is whole. Row-parallel (o, down): A keeps this
rank's input columns, B is whole, and the delta joins the partial product before the
all-reduce (the sum over ranks of x_r A_r is x A). Which slice a rank keeps comes from the
model's `weight_rule` for the base weight, so the base and its adapter are always cut alike.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from actors.lora_adapter import TARGETS, adapter_tensors
from actors.models.layers import ColumnParallelLinear, RowParallelLinear

PARTS = {"qkv_proj": 3, "gate_up_proj": 2, "o_proj": 1, "down_proj": 1}  # fused parts per layer


@dataclass
class LoraBatch:
    """One forward's token rows grouped by adapter slot (rows without an adapter are in no group)."""
    slots: torch.Tensor | None  # [G] slot of each group; None: every slot in order (no gather)
    rows: torch.Tensor  # [G, L] token row of each group member, padded with row 0
    valid: torch.Tensor  # [G, L, 1] 1 for members, 0 for padding (in the model dtype)


class LoraState:
    """Shared by every LoRA layer of a model: the current forward's LoraBatch (None: no adapter)."""

    def __init__(self):
        self.batch: LoraBatch | None = None


class LoraWeights:
    """The adapter slots of one linear layer. A: [slots, in, parts * rank]; B: [slots, parts * rank, out]."""

    def __init__(self, linear, parts: int, slots: int, rank: int, state: LoraState):
        out_features, in_features = linear.weight.shape
        kw = dict(dtype=linear.weight.dtype, device=linear.weight.device)
        self.a = torch.zeros(slots, in_features, parts * rank, **kw)
        self.b = torch.zeros(slots, parts * rank, out_features, **kw)
        self.rank, self.state = rank, state

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base layer's [tokens, out]) plus each token row's adapter delta, in place."""
        batch = self.state.batch
        if batch is None:
            return y
        a = self.a if batch.slots is None else self.a[batch.slots]
        b = self.b if batch.slots is None else self.b[batch.slots]
        delta = torch.bmm(torch.bmm(x[batch.rows], a), b) * batch.valid  # [G, L, out]
        return y.index_add_(0, batch.rows.flatten(), delta.flatten(0, 1))

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()

    def put(self, slot: int, part: int, kind: str, tensor: torch.Tensor, rule) -> None:
        """One LoRA matrix into `slot`, cut by the base weight's rule (target, row offset, dim, start, size)."""
        _, offset, dim, start, size = rule[:5]
        cols = slice(part * self.rank, part * self.rank + (tensor.shape[0] if kind == "A" else tensor.shape[1]))
        with torch.no_grad():
            if kind == "A":  # [r, in]: a row-parallel layer keeps its input columns
                src = tensor[:, start:start + size] if dim == 1 else tensor
                self.a[slot, :, cols] = src.T.to(self.a.dtype)
            else:  # [out, r]: a column-parallel layer keeps its output rows, at the part's offset
                src = tensor[start:start + size] if dim == 0 else tensor
                self.b[slot, cols, offset:offset + src.shape[0]] = src.T.to(self.b.dtype)


def attach_lora(model, slots: int, rank: int) -> dict[str, LoraWeights]:
    """Give every adaptable projection of `model` its adapter slots; returns them by module name."""
    state = LoraState()
    model.lora_state = state  # the runner sets state.batch before each forward
    layers = {}
    for name, module in model.named_modules():
        kind = name.rsplit(".", 1)[-1]
        if kind in PARTS and isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            module.lora = LoraWeights(module, PARTS[kind], slots, rank, state)
            layers[name] = module.lora
    return layers


def load_adapter(model, layers: dict[str, LoraWeights], slot: int, path: str) -> None:
    """Read an adapter (checked at registration) into `slot` of this rank's layers."""
    for weights in layers.values():
        weights.clear(slot)
    for t, tensor in adapter_tensors(path):
        rule = model.weight_rule(t.base_name)
        if rule is None:  # a layer of another pipeline stage
            continue
        if t.part == "B":
            tensor = tensor * t.scaling  # scale once here, not per token
        layers[rule[0].removesuffix(".weight")].put(slot, TARGETS[t.proj], t.part, tensor, rule)


def lora_batch(token_slots: list[int], num_slots: int, dtype: torch.dtype,
               device: torch.device) -> LoraBatch | None:
    """Group token rows by slot (-1: no adapter); None when no row has one."""
    groups: dict[int, list[int]] = {}
    for row, slot in enumerate(token_slots):
        if slot >= 0:
            groups.setdefault(slot, []).append(row)
    if not groups:
        return None
    present = sorted(groups)
    width = max(len(g) for g in groups.values())
    rows = torch.zeros(len(present), width, dtype=torch.long)
    valid = torch.zeros(len(present), width, 1, dtype=dtype)
    for i, slot in enumerate(present):
        members = torch.tensor(groups[slot])
        rows[i, :len(members)] = members
        valid[i, :len(members)] = 1
    slots = None if present == list(range(num_slots)) else torch.tensor(present, device=device)
    return LoraBatch(slots, rows.to(device), valid.to(device))
