"""The model's matmuls on CPU: float32 through shoal's own AVX-512 kernel where the CPU has
AVX-512 and the weight was packed for it, bfloat16 through shoal's own AVX512-BF16 kernel where
the CPU has that and no AMX, else through oneDNN's inner product (float32, and bf16 where the
CPU has bf16 matmuls); `F.linear` elsewhere.

torch's `F.linear` on a CPU calls MKL's sgemm, which on AMD CPUs does not use AVX-512: on the
Zen 5 EPYC of 2026-11-27 it ran 210-220 GFLOP/s at prefill sizes where oneDNN's inner product
(`torch.ops.mkldnn._linear_pointwise`) ran 450-530. At a decode step's 32 rows oneDNN ran
~330 GFLOP/s, and the panel kernel (csrc/panel_linear.cpp, weights packed in panels of 64
columns) 380-450, 1.1-1.4x faster, and at least as fast at every row count measured
(docs/benchmarks.md). bfloat16 likewise (csrc/bf16_linear.cpp, weights in k-pair panels of 16
columns): on the Zen 4 EPYC of 2026-12-06 it ran a layer's projections 1.3-1.5x faster than
oneDNN's bf16 inner product at 1-8 rows, 1.1x at 32 and level from 64 on, and oneDNN's opaque
layout kept a tied head twice. Their sums run in other orders than MKL's, so results differ in
the last bits (~1e-6 relative), as any other kernel's would; float32 outputs stay token for
token those of transformers (tests/test_engine.py, tests/test_compiled_decode.py).

Packing (`prepack`, which the model runner calls on its weights at start) keeps a copy of each
weight in the layout its kernel reads and frees the weight's own memory unless something else
reads it (a tied embedding does): the weights are in memory once. Unpacked weights go to oneDNN,
which then reorders the whole matrix on every call, and which builds and keeps a kernel for
every row count it meets (~0.6 MB each on the AMX Xeon): eager oneDNN calls pad their rows to
`eager_rows`, compiled decode pads to a few bucket sizes. The panel kernel needs neither.
Inside torch.compile the call is the opaque op `shoal::cpu_linear` (inductor's own lowering of
the oneDNN op only takes weights frozen into the graph as constants).
`SHOAL_ONEDNN_LINEAR=0` turns both off (read once, at import); `SHOAL_NATIVE_KERNELS=0` the
panel kernel alone.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import native, packed_weights
from kernels.env import flag
from kernels.quantization import prepack_w8a8, quantized_linear

ONEDNN = torch.backends.mkldnn.is_available() and flag("SHOAL_ONEDNN_LINEAR", True)


_LINEAR = torch.ops.mkldnn._linear_pointwise.default if ONEDNN else None
# bfloat16 only where oneDNN has bf16 matmuls (elsewhere actors/worker/model_spec.py computes in float32).
_DTYPES = (torch.float32,) + ((torch.bfloat16,) if ONEDNN and torch.ops.mkldnn._is_mkldnn_bf16_supported() else ())


_PANEL_OP = None  # torch.ops.shoal_linear.panel_linear, once a weight is packed for it
_PAIRS_OP = None  # torch.ops.shoal_bf16.bf16_linear, once a weight is packed for it
_NO_BIAS = torch.empty(0)
_NO_BF16_BIAS = torch.empty(0, dtype=torch.bfloat16)
PANEL = 64


def supported(dtype: torch.dtype) -> bool:
    """oneDNN (and, for float32, the panel kernel) can run this dtype's CPU linears."""
    return dtype in _DTYPES


def prepack(weights: list[torch.Tensor], rows: int, keep_plain: list[torch.Tensor] = (),
            embeddings: list[torch.Tensor] = ()) -> int:
    """Keep a packed copy (kernels/packed_weights.py) of each CPU weight the linear layers
    multiply: float32 in panels where the CPU has AVX-512 (and the panel kernel builds),
    bfloat16 in k-pair panels where the CPU has AVX512-BF16 and no AMX (and that kernel builds),
    else oneDNN's layout for `rows` input rows (it serves every row count; float32, or bfloat16
    where the CPU has bf16 matmuls); w8a8_int8's int8 rows in oneDNN's int8 layout. Then release
    each packed weight's plain layout, so each weight is in memory once, but for those in
    `keep_plain`, and those in `embeddings` (a head's weight tied to the embedding, whose lookups
    read rows) unless the copy is panels or pairs, whose rows `embedding` reads as they are.
    Returns the bytes the copies take beyond the weights' own."""
    global _PANEL_OP, _PAIRS_OP
    if not ONEDNN:
        return 0
    kept = 0
    plain, rows_read = {packed_weights.key(w) for w in keep_plain}, {packed_weights.key(w) for w in embeddings}
    for w in {packed_weights.key(w): w for w in weights}.values():
        if w.device.type != "cpu" or w.dim() != 2 or packed_weights.kept(w):
            continue
        if w.dtype == torch.int8:
            kept += prepack_w8a8(w, rows)
        elif w.dtype in _DTYPES:
            if w.dtype == torch.float32 and (op := native.panel_linear_op()) is not None:
                _PANEL_OP, packed = op, pack_panels(w.detach())
            elif w.dtype == torch.bfloat16 and (op := native.bf16_linear_op()) is not None:
                _PAIRS_OP, packed = op, packed_weights.pairs(w.detach())
            else:
                packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), rows)
            packed_weights.keep(w, packed)
            kept += packed.numel() * packed.element_size()
        copy, place = packed_weights.find(w), packed_weights.key(w)
        panels = copy is not None and copy.dim() == 3 and w.dtype != torch.int8  # (panels or pairs; int8 rows: quantized_rows reads them)
        if place not in plain and (place not in rows_read or panels):
            kept -= packed_weights.release(w)
    return kept


def pack_panels(w: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N / 64), K, 64]: panel p holds output columns 64p.. (zeros past N), each
    k's 64 weights contiguous, as csrc/panel_linear.cpp reads them."""
    return packed_weights.panels(w, PANEL)


def _embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of `weight`: read from its panels or pairs where packing released it (an
    embedding tied to the head; column n of panel n // 64 is row n), else the weight's own rows."""
    packed = packed_weights.find(weight)
    if packed is not None and packed.dim() == 3 and weight.untyped_storage().nbytes() == 0:
        if packed.dtype == torch.bfloat16:
            return packed_weights.pair_rows(packed, ids, weight.shape[1])
        flat = ids.reshape(-1)
        return packed[flat // PANEL, :, flat % PANEL].view(*ids.shape, weight.shape[1])
    return F.embedding(ids, weight)


def _cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    packed = packed_weights.find(weight)
    if packed is not None and packed.dim() == 3:
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        out = flat.new_empty((flat.shape[0], weight.shape[0]))
        if packed.dtype == torch.bfloat16:
            _PAIRS_OP(out, flat, packed, _NO_BF16_BIAS if bias is None else bias.contiguous())
        else:
            _PANEL_OP(out, flat, packed, _NO_BIAS if bias is None else bias.contiguous())
        return out.view(*x.shape[:-1], weight.shape[0])
    return _LINEAR(x, weight if packed is None else packed, bias, "none", [], "")


# Registered through torch.library rather than @custom_op: ~20 us less per call (32 calls a
# compiled decode step).
_library = torch.library.Library("shoal", "FRAGMENT")
_library.define("cpu_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_library.impl("cpu_linear", _cpu_linear, "CPU")


@torch.library.register_fake("shoal::cpu_linear")
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


# Opaque inside torch.compile: the step is traced where nothing is packed (the compile job) and
# runs where the weight may be released, so the graph must not read the weight itself.
_library.define("embedding(Tensor ids, Tensor weight) -> Tensor")
_library.impl("embedding", _embedding, "CPU")


@torch.library.register_fake("shoal::embedding")
def _(ids, weight):
    return weight.new_empty((*ids.shape, weight.shape[1]))


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """An embedding's lookup: on CPU where the weights may be packed, from the weight or its
    panels (`_embedding`; opaque inside torch.compile), else F.embedding."""
    if ONEDNN and weight.device.type == "cpu" and weight.dtype in _DTYPES:
        if torch.compiler.is_compiling():
            return torch.ops.shoal.embedding(ids, weight)
        return _embedding(ids, weight)
    return F.embedding(ids, weight)


def _rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return x.index_select(0, index)


# Opaque inside torch.compile, so inductor computes x (a final norm) for every row as the eager
# step does: fused into the gather, its bfloat16 rounding moved and compiled log-probs left
# eager's by ~4e-3 (tests/test_compiled_decode.py).
_library.define("rows(Tensor x, Tensor index) -> Tensor")
_library.impl("rows", _rows, "CPU")


@torch.library.register_fake("shoal::rows")
def _(x, index):
    return x.new_empty((index.shape[0], *x.shape[1:]))


def rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[index] along the first dimension; under torch.compile on CPU an opaque op."""
    if torch.compiler.is_compiling() and x.device.type == "cpu":
        return torch.ops.shoal.rows(x, index)
    return x.index_select(0, index)


def eager_rows(n: int) -> int:
    """The row count an eager oneDNN call is padded to: n up to 8, then four sizes per octave
    (5, 6, 7 and 8 eighths of the next power of two). oneDNN keeps a kernel per row count it
    meets; these keep them to 8 + 4 per doubling of the step's tokens (40 per weight shape up
    to 2,048 rows), and pad by less than a quarter."""
    if n <= 8:
        return max(n, 1)
    step = 1 << (n - 1).bit_length() - 3
    return -(-n // step) * step


def _eager(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    packed = packed_weights.find(weight)
    if packed is not None and packed.dim() == 3:  # panels and pairs take any row count as it is
        return _cpu_linear(x, weight, bias)
    flat = x.reshape(-1, x.shape[-1])
    n = flat.shape[0]
    rows = eager_rows(n)
    if rows != n:  # zero rows, which the result drops (F.pad copies even when it pads nothing)
        flat = F.pad(flat, (0, 0, 0, rows - n))
    return _cpu_linear(flat, weight, bias)[:n].view(*x.shape[:-1], weight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           scale: torch.Tensor | None = None) -> torch.Tensor:
    """The panel kernel or oneDNN on CPU (opaque inside torch.compile), F.linear elsewhere
    (module docstring); with `scale`, `weight` is 8-bit (kernels/quantization.py)."""
    if scale is not None:
        return quantized_linear(x, weight, scale, bias)
    if ONEDNN and x.dtype in _DTYPES and weight.dtype == x.dtype and x.device.type == "cpu":
        if torch.compiler.is_compiling():
            return torch.ops.shoal.cpu_linear(x, weight, bias)
        return _eager(x, weight, bias)
    return F.linear(x, weight, bias)
