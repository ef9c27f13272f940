"""The model's matmuls: on CPU, linear layers go through oneDNN's inner product, float32 and
bf16 where the CPU has bf16 matmuls (AVX512-BF16 or AMX); compiled decode on weights packed
once into its blocked layout.

torch's `F.linear` on a CPU calls MKL's sgemm, which on AMD CPUs does not use AVX-512: on the
Zen 5 EPYC of 2026-11-27 it ran 210-220 GFLOP/s at prefill sizes where oneDNN's inner product
(`torch.ops.mkldnn._linear_pointwise`) ran 450-530, and at decode batch sizes oneDNN was
1.2-1.85x faster on the earlier AVX2 EPYC (`tests/bench/bench_cpu.py linear`,
docs/benchmarks.md). Its sums run in another order, so results differ from MKL's in the last
bits (~1e-6 relative), as any other kernel's would; float32 outputs stay token for token those
of transformers (tests/test_engine.py, tests/test_compiled_decode.py).

oneDNN builds and keeps a kernel for every row count it meets (~0.6 MB each on the AMX Xeon,
even with its primitive cache off). Compiled decode (actors/compiled_decode.py) pads its rows
to a few bucket sizes; eager calls (prefill chunks of any length) pad theirs to `eager_rows`.
Inside torch.compile the call is the opaque op `shoal::onednn_linear`: inductor's own lowering
of the oneDNN op only takes weights frozen into the graph as constants.

Packed weights (`prepack`) spare oneDNN a reorder of the whole matrix on every call: 1.1x
(float32) to 1.4x (bf16) on the linears of a decode step, for the linear weights' size again
in memory. CUDA, float16 and bf16 without bf16 matmuls keep `F.linear`.
`SHOAL_ONEDNN_LINEAR=0` turns the oneDNN path off (read once, at import).
"""
from __future__ import annotations

import os
import weakref

import torch
import torch.nn.functional as F

ONEDNN = torch.backends.mkldnn.is_available() and \
    os.environ.get("SHOAL_ONEDNN_LINEAR", "1").strip().lower() not in ("0", "false", "no", "off")


_LINEAR = torch.ops.mkldnn._linear_pointwise.default if ONEDNN else None
# bfloat16 only where oneDNN has bf16 matmuls (elsewhere actors/model_spec.py computes in float32).
_DTYPES = (torch.float32,) + ((torch.bfloat16,) if ONEDNN and torch.ops.mkldnn._is_mkldnn_bf16_supported() else ())


# oneDNN wants its weights in a blocked layout (for AMX, bf16 pairs interleaved) and, given a
# plain one, reorders the whole matrix on every call. Compiled decode packs them once:
# weight.data_ptr() -> (the weight's version when packed, the packed copy). An entry goes when
# its weight is freed, so a later tensor at the same address never meets it.
_PACKED: dict[int, tuple[int, torch.Tensor]] = {}


def prepack(weights: list[torch.Tensor], rows: int) -> int:
    """Keep a oneDNN-blocked copy of each CPU weight that compiled decode multiplies (float32,
    or bfloat16 where the CPU has bf16 matmuls), laid out for `rows` input rows (it serves
    every row count). Returns the bytes the copies take: the weights' size again."""
    if not ONEDNN:
        return 0
    kept = 0
    for w in {w.data_ptr(): w for w in weights}.values():
        if w.device.type == "cpu" and w.dtype in _DTYPES and w.dim() == 2 and w.data_ptr() not in _PACKED:
            _PACKED[w.data_ptr()] = (w._version, torch.ops.mkldnn._reorder_linear_weight(w.detach(), rows))
            weakref.finalize(w, _PACKED.pop, w.data_ptr(), None)
            kept += w.numel() * w.element_size()
    return kept


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    version, packed = _PACKED.get(weight.data_ptr(), (None, None))
    if packed is not None and version == weight._version:  # not changed in place since packed
        weight = packed
    return _LINEAR(x, weight, bias, "none", [], "")


# Registered through torch.library rather than @custom_op: ~20 us less per call (32 calls a
# compiled decode step).
_library = torch.library.Library("shoal", "FRAGMENT")
_library.define("onednn_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_library.impl("onednn_linear", _onednn, "CPU")


@torch.library.register_fake("shoal::onednn_linear")
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def eager_rows(n: int) -> int:
    """The row count an eager oneDNN call is padded to: n up to 8, then four sizes per octave
    (5, 6, 7 and 8 eighths of the next power of two). oneDNN keeps a kernel per row count it
    meets; these keep them to 8 + 4 per doubling of the step's tokens (40 per weight shape up
    to 2,048 rows), and pad by less than a quarter."""
    if n <= 8:
        return max(n, 1)
    step = 1 << (n - 1).bit_length() - 3
    return -(-n // step) * step


def _eager_onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    n = flat.shape[0]
    rows = eager_rows(n)
    if rows != n:  # zero rows, which the result drops (F.pad copies even when it pads nothing)
        flat = F.pad(flat, (0, 0, 0, rows - n))
    return _onednn(flat, weight, bias)[:n].view(*x.shape[:-1], weight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """oneDNN on CPU (opaque inside torch.compile, row counts bucketed outside it), F.linear
    elsewhere (module docstring)."""
    if ONEDNN and x.dtype in _DTYPES and weight.dtype == x.dtype and x.device.type == "cpu":
        if torch.compiler.is_compiling():
            return torch.ops.shoal.onednn_linear(x, weight, bias)
        return _eager_onednn(x, weight, bias)
    return F.linear(x, weight, bias)
