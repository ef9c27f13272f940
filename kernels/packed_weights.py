"""Packed copies of CPU weights, kept beside the weights: each in the layout its kernel reads
(kernels/linear.py: panels or oneDNN's blocked float layout; kernels/quantization.py: oneDNN's
int8 layout). A kernel is handed the weight itself (a plain tensor torch.compile can take as an
input) and reads the copy found for it here.

An entry is keyed by the weight's address and holds the weight's version when packed: an
in-place change sends the kernel back to the weight, and the entry goes when the weight is
freed, so a later tensor at the same address never meets it."""
from __future__ import annotations

import weakref

import torch

_COPIES: dict[int, tuple[int, torch.Tensor]] = {}  # weight.data_ptr() -> (its version when packed, the copy)


def _version(w: torch.Tensor) -> int:
    """The weight's in-place change count; an inference tensor (made under inference_mode)
    keeps none, and nothing changes a model's weights in place there."""
    return -1 if w.is_inference() else w._version


def keep(weight: torch.Tensor, copy: torch.Tensor) -> None:
    _COPIES[weight.data_ptr()] = (_version(weight), copy)
    weakref.finalize(weight, _COPIES.pop, weight.data_ptr(), None)


def kept(weight: torch.Tensor) -> bool:
    return weight.data_ptr() in _COPIES


def find(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight's packed copy, unless there is none or the weight changed since."""
    version, copy = _COPIES.get(weight.data_ptr(), (None, None))
    return copy if copy is not None and version == _version(weight) else None
