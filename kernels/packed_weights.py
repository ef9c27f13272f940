"""Packed copies of CPU weights, kept beside the weights: each in the layout its kernel reads
(kernels/linear.py: float32 panels, bf16 k-pair panels or oneDNN's blocked layout;
kernels/quantization.py: oneDNN's int8 layout). A kernel is handed the weight itself (a plain
tensor torch.compile can take as an input) and reads the copy found for it here.

An entry is keyed by the weight's storage and holds the weight's version when packed: an
in-place change sends the kernel back to the weight, and the entry goes when the weight is
freed, so a later tensor in the same place never meets it.

`release` frees a packed weight's own memory once nothing else reads it in its plain layout
(a tied embedding does): the tensor keeps its shape, strides and dtype, which are all a
compiled step's inputs and the kernels' shapes need, and the packed copy stands alone, so the
weights are in memory once, not twice. Reading a released weight's values raises torch's
"data is not allocated" error; writing them is not allowed (nothing in shoal changes weights
in place after start-up)."""
from __future__ import annotations

import weakref

import torch

# (the weight's storage, its offset there) -> (its version when packed, the copy)
_COPIES: dict[tuple[int, int], tuple[int, torch.Tensor]] = {}


def key(w: torch.Tensor) -> tuple[int, int]:
    """The weight's place: its storage's identity, which outlives `release` (the storage's
    address does not: it is 0 once freed), and its offset there."""
    return w.untyped_storage()._cdata, w.storage_offset()


def _version(w: torch.Tensor) -> int:
    """The weight's in-place change count; an inference tensor (made under inference_mode)
    keeps none, and nothing changes a model's weights in place there."""
    return -1 if w.is_inference() else w._version


def keep(weight: torch.Tensor, copy: torch.Tensor) -> None:
    _COPIES[key(weight)] = (_version(weight), copy)
    weakref.finalize(weight, _COPIES.pop, key(weight), None)


def kept(weight: torch.Tensor) -> bool:
    return key(weight) in _COPIES


def find(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight's packed copy, unless there is none or the weight changed since."""
    version, copy = _COPIES.get(key(weight), (None, None))
    return copy if copy is not None and version == _version(weight) else None


def release(weight: torch.Tensor) -> int:
    """Free the memory of a weight that has a packed copy, where the weight owns its whole
    storage (a view into a larger buffer, or a file mapping, stays). Returns the bytes freed."""
    storage = weight.untyped_storage()
    size = weight.numel() * weight.element_size()
    if not kept(weight) or weight.storage_offset() or storage.nbytes() != size or not storage.resizable():
        return 0
    storage.resize_(0)
    return size


def panels(w: torch.Tensor, width: int) -> torch.Tensor:
    """[N, K] -> [ceil(N / width), K, width]: panel p holds rows width * p.. (zeros past N), each
    k's `width` values contiguous. Written in place: no padded or transposed whole-size copy
    on the way (an embedding-sized head made two, ~1 GB at start-up)."""
    n, k = w.shape
    full, rest = divmod(n, width)
    out = w.new_empty((full + bool(rest), k, width))
    out[:full] = w[:full * width].view(full, width, k).transpose(1, 2)
    if rest:
        out[full].zero_()
        out[full, :, :rest] = w[full * width:].t()
    return out


PAIR_COLUMNS = 16


def pairs(w: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N / 16), ceil(K / 2), 32]: panel p holds rows 16p.. (zeros past N), per
    pair of k's each row's two values side by side (a zero past K), as csrc/bf16_linear.cpp
    reads them. Written in place, as `panels`."""
    if w.shape[1] % 2:
        w = torch.nn.functional.pad(w, (0, 1))  # (an odd K: rare enough for one padded copy)
    n, k = w.shape
    full, rest = divmod(n, PAIR_COLUMNS)
    out = w.new_empty((full + bool(rest), k // 2, PAIR_COLUMNS, 2))
    out[:full] = w[:full * PAIR_COLUMNS].view(full, PAIR_COLUMNS, k // 2, 2).transpose(1, 2)
    if rest:
        out[full].zero_()
        out[full, :, :rest] = w[full * PAIR_COLUMNS:].view(rest, k // 2, 2).transpose(0, 1)
    return out.view(full + bool(rest), k // 2, 2 * PAIR_COLUMNS)


def pair_rows(packed: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """Rows `ids` of the weight `pairs` packed (K = k): an embedding's lookup."""
    flat = ids.reshape(-1)
    four = packed.view(packed.shape[0], packed.shape[1], PAIR_COLUMNS, 2)
    rows = four[flat // PAIR_COLUMNS, :, flat % PAIR_COLUMNS].reshape(flat.shape[0], -1)
    return rows[:, :k].reshape(*ids.shape, k)
