"""LoRA adapters in fixed slots of the linear layers, applied per row in batched form.

`attach_lora` gives every adaptable projection (qkv_proj, o_proj, gate_up_proj, down_proj)
stacked A and B matrices for `slots` adapters of rank up to `rank`, allocated once. A fused
projection stacks its parts' ranks in A: qkv_proj's A is [slots, in, 3 * rank] (q, k, v side
by side: one shrink matmul), and keeps one B per part (no block-diagonal zeros to read).

Each step the runner sets a `LoraBatch`: the token rows grouped by adapter slot (padded to
the largest group). A projection then adds, for all groups at once,
    y[rows] += (x[rows] @ A[slot]) @ B[slot]        (B pre-multiplied by the scaling)
as one torch.bmm to shrink, one per fused part to expand, and gathers (index_select) in and
back out: no loop over requests or adapters.

Tensor parallelism: A and B are split the way their projection is. Column-parallel (qkv,
gate_up): B keeps this rank's output rows, A is whole. Row-parallel (o, down): A keeps this
rank's input columns, B is whole, and the delta joins the partial product before the
all-reduce (the sum over ranks of x_r A_r is x A). Which slice a rank keeps comes from the
model's `weight_rule` for the base weight, so the base and its adapter are always cut alike.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from actors.models.layers import ColumnParallelLinear, RowParallelLinear
from actors.models.lora_adapter import TARGETS, adapter_tensors

# The Hugging Face projections fused into each adaptable layer, in their order inside it.
PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
         "o_proj": ("o_proj",), "down_proj": ("down_proj",)}


@dataclass
class LoraBatch:
    """One forward's token rows grouped by adapter slot (rows without an adapter are in no group)."""
    slots: torch.Tensor | None  # [G] slot of each group; None: every slot in order (no gather)
    rows: torch.Tensor  # [G * L] token row of each group member, groups padded to L with row 0
    back: torch.Tensor  # [tokens] where each token's delta is among the G * L (0 for base rows)
    mask: torch.Tensor | None  # [tokens, 1] 0 for rows without an adapter; None: every row has one


class LoraState:
    """Shared by every LoRA layer of a model: the current forward's LoraBatch (None: no adapter)."""

    def __init__(self):
        self.batch: LoraBatch | None = None


class LoraWeights:
    """The adapter slots of one linear layer: A [slots, in, parts * rank] (the parts' ranks
    side by side: one shrink matmul) and per part B [slots, rank, part width]."""

    def __init__(self, linear, spans: list[tuple[int, int]], slots: int, rank: int, state: LoraState):
        in_features = linear.in_features
        # An 8-bit layer's adapters take the dtype its weight had (kernels/quantization.py).
        kw = dict(dtype=getattr(linear, "out_dtype", linear.weight.dtype), device=linear.weight.device)
        self.a = torch.zeros(slots, in_features, len(spans) * rank, **kw)
        self.b = [torch.zeros(slots, rank, width, **kw) for _, width in spans]
        self.spans, self.rank, self.state = spans, rank, state

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base layer's [tokens, out]) plus each token row's adapter delta, in place.

        Gathers and gathers back (index_select), never scatters: scatter-add is several times
        slower on CPU."""
        batch = self.state.batch
        if batch is None:
            return y
        a = self.a if batch.slots is None else self.a[batch.slots]
        groups = a.shape[0]
        shrunk = torch.bmm(x.index_select(0, batch.rows).view(groups, -1, x.shape[1]), a)
        parts = [torch.bmm(shrunk[..., i * self.rank:(i + 1) * self.rank],
                           b if batch.slots is None else b[batch.slots]) for i, b in enumerate(self.b)]
        delta = (parts[0] if len(parts) == 1 else torch.cat(parts, -1)).view(-1, y.shape[1])
        delta = delta.index_select(0, batch.back)
        return y.add_(delta if batch.mask is None else delta * batch.mask)

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        for b in self.b:
            b[slot].zero_()

    def put(self, slot: int, part: int, kind: str, tensor: torch.Tensor, rule) -> None:
        """One LoRA matrix into `slot`, cut by the base weight's rule (target, row offset, dim, start, size)."""
        _, _, dim, start, size = rule[:5]
        r = tensor.shape[0] if kind == "A" else tensor.shape[1]
        with torch.no_grad():
            if kind == "A":  # [r, in]: a row-parallel layer keeps its input columns
                src = tensor[:, start:start + size] if dim == 1 else tensor
                self.a[slot, :, part * self.rank:part * self.rank + r] = src.T.to(self.a.dtype)
            else:  # [out, r]: a column-parallel layer keeps its output rows
                src = tensor[start:start + size] if dim == 0 else tensor
                self.b[part][slot, :r] = src.T.to(self.b[part].dtype)


def attach_lora(model, slots: int, rank: int) -> dict[str, LoraWeights]:
    """Give every adaptable projection of `model` its adapter slots; returns them by module name."""
    state = LoraState()
    model.lora_state = state  # the runner sets state.batch before each forward
    layers = {}
    for name, module in model.named_modules():
        kind = name.rsplit(".", 1)[-1]
        if kind in PARTS and isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            module.lora = LoraWeights(module, part_spans(model, name, module), slots, rank, state)
            layers[name] = module.lora
    return layers


def part_spans(model, name: str, module) -> list[tuple[int, int]]:
    """(first output row, rows) of each fused part on this rank, from the base weights' rules."""
    if isinstance(module, RowParallelLinear):  # one part, every output row
        return [(0, module.out_features)]
    layer, block, kind = re.match(r"model\.layers\.(\d+)\.(\w+)\.(\w+)$", name).groups()
    prefix = f"model.layers.{int(layer) + model.first_layer}.{block}"  # the checkpoint's (global) layer
    spans = []
    for hf in PARTS[kind]:
        _, offset, _, _, size = model.weight_rule(f"{prefix}.{hf}.weight")[:5]
        spans.append((offset, size))
    return spans


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
    rows, back = [0] * (len(present) * width), [0] * len(token_slots)
    for i, slot in enumerate(present):
        for j, row in enumerate(groups[slot]):
            rows[i * width + j] = row
            back[row] = i * width + j
    mask = None
    if any(s < 0 for s in token_slots):
        mask = torch.tensor([[float(s >= 0)] for s in token_slots], dtype=dtype, device=device)
    slots = None if present == list(range(num_slots)) else torch.tensor(present, device=device)
    return LoraBatch(slots, torch.tensor(rows, device=device), torch.tensor(back, device=device), mask)
