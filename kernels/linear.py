"""The model's matmuls: float32 linear layers on CPU go through oneDNN.

torch's `F.linear` on a CPU calls MKL's sgemm. On the AMD EPYC these machines run on, oneDNN's
inner product (`torch.ops.mkldnn._linear_pointwise`) computes the same product 1.05-1.8x
faster, most at decode batch sizes (`tests/bench/bench_cpu.py linear`, docs/benchmarks.md).
Its sums run in another order, so results differ from MKL's in the last bits (~1e-6
relative), as any other kernel's would; float32 outputs stay token for token those of
transformers (the suite checks).

Inside torch.compile (compiled decode) the call goes through the opaque custom op
`shoal::onednn_linear`: inductor's own lowering of the oneDNN op only takes weights frozen
into the graph as constants.

Everything else (CUDA, 16-bit dtypes, autograd) keeps `F.linear`. `SHOAL_ONEDNN_LINEAR=0`
turns the oneDNN path off (read once, at import).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

ONEDNN = torch.backends.mkldnn.is_available() and \
    os.environ.get("SHOAL_ONEDNN_LINEAR", "1").strip().lower() not in ("0", "false", "no", "off")


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@torch.library.custom_op("shoal::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _onednn(x, weight, bias)


@onednn_linear.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if (ONEDNN and x.dtype == torch.float32 and weight.dtype == torch.float32 and x.device.type == "cpu"
            and not (torch.is_grad_enabled() and weight.requires_grad)):
        return onednn_linear(x, weight, bias) if torch.compiler.is_compiling() else _onednn(x, weight, bias)
    return F.linear(x, weight, bias)
