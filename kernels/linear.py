"""The model's matmuls: on CPU, the float32 linear layers of compiled decode steps go through
oneDNN.

torch's `F.linear` on a CPU calls MKL's sgemm. On the AMD EPYC these machines run on, oneDNN's
inner product (`torch.ops.mkldnn._linear_pointwise`) computes the same product 1.2-1.85x
faster at decode batch sizes, most for the LM head (`tests/bench/bench_cpu.py linear`,
docs/benchmarks.md). Its sums run in another order, so results differ from MKL's in the last
bits (~1e-6 relative), as any other kernel's would; float32 outputs stay token for token those
of transformers (tests/test_compiled_decode.py).

oneDNN builds and keeps a kernel (~0.6 MB, even with its primitive cache off) for every row
count it meets. Compiled decode (actors/compiled_decode.py) pads its rows to a few bucket
sizes, so there the kernels stay few; eager steps (prefill chunks of any length) keep MKL,
whose speed at those sizes is within ~15% of oneDNN's. Inside torch.compile the call is the
opaque op `shoal::onednn_linear`: inductor's own lowering of the oneDNN op only takes weights
frozen into the graph as constants.

CUDA and 16-bit dtypes keep `F.linear`. `SHOAL_ONEDNN_LINEAR=0` turns the oneDNN path off
(read once, at import).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

ONEDNN = torch.backends.mkldnn.is_available() and \
    os.environ.get("SHOAL_ONEDNN_LINEAR", "1").strip().lower() not in ("0", "false", "no", "off")


_LINEAR = torch.ops.mkldnn._linear_pointwise.default if ONEDNN else None


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _LINEAR(x, weight, bias, "none", [], "")


# Registered through torch.library rather than @custom_op: ~20 us less per call (32 calls a
# compiled decode step).
_library = torch.library.Library("shoal", "FRAGMENT")
_library.define("onednn_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_library.impl("onednn_linear", _onednn, "CPU")


@torch.library.register_fake("shoal::onednn_linear")
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """oneDNN inside torch.compile (compiled decode), MKL everywhere else (module docstring)."""
    if (ONEDNN and torch.compiler.is_compiling() and x.dtype == torch.float32
            and weight.dtype == torch.float32 and x.device.type == "cpu"):
        return torch.ops.shoal.onednn_linear(x, weight, bias)
    return F.linear(x, weight, bias)
