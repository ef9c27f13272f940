"""compressed-tensors `int-quantized` (and its older name `naive-quantized`) checkpoints: LLM
Compressor's W8A8 int8 releases (`*-quantized.w8a8`), and W8A16 ones written unpacked.

Each quantized linear layer stores `W.weight` as int8 codes [N, K] and `W.weight_scale`, one
per output channel ([N, 1]) or one for the tensor; `W.weight_zero_point` only where the weights
are asymmetric (refused here: the int8 x int8 product takes symmetric weights), `W.input_scale`
where the activations have a static scale. The weight is q * scale.

They load as the 8-bit layers they are (no option needed): `scheme` picks w8a8_int8 when the
checkpoint quantizes activations to int8 (kernels/quantization.py: each row over its own scale
as it arrives, which is the checkpoint's dynamic per-token scheme; a static `input_scale` is
not used, the per-row scale is never coarser), else int8 weight-only. Only the layers the
checkpoint quantized are 8-bit (its `ignore` list, `lm_head` say, stays float), and they hold
the checkpoint's own codes and scales: the loader reads each weight as float (q * scale, exact
in float32) and keeps each output row's scale (`row_scales`), from which
kernels/quantization.py takes the codes back, round(w / scale), exactly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from actors.worker.quantization_config import INT8_FORMATS, compressed_formats, settings
PARTS = (".weight_scale", ".weight_zero_point", ".input_scale", ".input_zero_point")


@dataclass(frozen=True)
class Int8Scheme:
    kind: str  # what the layers run as: w8a8_int8 (int8 activations too) | int8 (weight-only)
    static_activations: bool = False  # the checkpoint has an input_scale (not used)


def scheme(config: dict) -> Int8Scheme | None:
    """The checkpoint's int8 scheme from config.json's `quantization_config`, None when it is not
    an int-quantized compressed-tensors checkpoint; ValueError (one line) for one shoal can't
    run as it says."""
    q = settings(config)
    if q.get("quant_method") != "compressed-tensors":
        return None
    groups, formats = list((q.get("config_groups") or {}).values()), compressed_formats(q)
    if not formats & set(INT8_FORMATS) or _float_weights(groups):
        return None  # (naive-quantized float8 weights: early FP8 releases, read by fp8_checkpoint.py)
    if len(formats) > 1 or len(groups) != 1:
        raise ValueError("compressed-tensors int-quantized checkpoint with several schemes: shoal reads "
                         "one scheme for every quantized layer")
    weights, inputs = groups[0].get("weights") or {}, groups[0].get("input_activations")
    if weights.get("num_bits") != 8 or weights.get("type", "int") != "int":
        raise ValueError(f"compressed-tensors int-quantized weights of {weights.get('num_bits')} bits, type "
                         f"{weights.get('type')!r}: shoal reads 8-bit int weights")
    if weights.get("strategy") not in ("channel", "tensor"):
        raise ValueError(f"compressed-tensors int-quantized weights with strategy {weights.get('strategy')!r}: "
                         "shoal reads per-channel and per-tensor scales")
    if not weights.get("symmetric", True):
        raise ValueError("compressed-tensors int-quantized checkpoint with asymmetric weights: shoal reads "
                         "symmetric int8 weights")
    if not inputs:
        return Int8Scheme("int8")
    if inputs.get("num_bits") != 8 or inputs.get("type", "int") != "int":
        raise ValueError(f"compressed-tensors int-quantized activations of {inputs.get('num_bits')} bits, type "
                         f"{inputs.get('type')!r}: shoal runs int8 activations")
    return Int8Scheme("w8a8_int8", static_activations=not inputs.get("dynamic", False))


def _float_weights(groups: list[dict]) -> bool:
    """Every group's weights are floats: the first LLM Compressor FP8 releases wrote them as
    `naive-quantized` (float8 weights, not int8 codes)."""
    return bool(groups) and all((g.get("weights") or {}).get("type") == "float" for g in groups)


def is_part(name: str) -> bool:
    """A tensor that goes with a quantized weight (its scale, an activation scale)."""
    return name.endswith(PARTS)


def row_scales(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """One float32 scale per output row [rows] from a per-channel or per-tensor scale."""
    s = scale.float().reshape(-1)
    if s.numel() == 1:
        return s.expand(rows).contiguous()
    if s.numel() != rows:
        raise ValueError(f"an int8 weight of {rows} rows has {s.numel()} scales: expected one per row or one")
    return s


class Int8Weight:
    """One int-quantized weight, read from disk only when a rule slices it: slices come as float
    (q * scale), and `row_scales` gives the scales of the rows a slice holds."""

    def __init__(self, read_codes, read_scale):
        self._read_codes, self._read_scale = read_codes, read_scale
        self._codes = self._scales = None

    def _read(self) -> None:
        if self._codes is None:
            self._codes = self._read_codes()
            self._scales = row_scales(self._read_scale(), self._codes.shape[0])

    def __getitem__(self, key) -> torch.Tensor:
        self._read()
        codes = self._codes[key]
        rows = self._scales[key[0] if isinstance(key, tuple) else key]
        return codes.float() * rows.reshape(-1, *([1] * (codes.dim() - 1)))

    def row_scales(self, dim, start: int, size: int) -> torch.Tensor:
        """The scales of a slice's rows: its rows' own where the slice cuts rows (dim 0), every
        row's where it cuts columns (a row-parallel shard) or nothing."""
        self._read()
        return self._scales[start:start + size] if dim == 0 else self._scales
