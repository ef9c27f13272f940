"""Gated activations over a fused gate/up projection (gate rows first, then up), and the plain
ones of ungated MLPs."""
import torch
import torch.nn.functional as F
from torch import nn


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU with the tanh approximation (Gemma's gelu_pytorch_tanh)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def gated_activation(name: str):
    return {"silu": silu_and_mul, "gelu_tanh": gelu_tanh_and_mul}[name]


def plain_activation(name: str):
    return {"gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu, "relu": F.relu,
            "relu2": lambda x: torch.square(F.relu(x))}[name]


class XIELU(nn.Module):
    """Apertus's xIELU (arXiv 2411.13010) as transformers' Python path computes it: each layer's
    learned alpha_p and alpha_n (through softplus) and its stored beta and eps (checkpoint
    tensors, so a bf16 release's eps is its bf16 value)."""

    def __init__(self):
        super().__init__()
        for name in ("alpha_p", "alpha_n", "beta", "eps"):  # (all four read from the checkpoint)
            setattr(self, name, nn.Parameter(torch.empty(1), requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha_p = F.softplus(self.alpha_p)
        alpha_n = self.beta + F.softplus(self.alpha_n)
        return torch.where(x > 0, alpha_p * x * x + self.beta * x,
                           (torch.expm1(torch.min(x, self.eps)) - x) * alpha_n + self.beta * x)
