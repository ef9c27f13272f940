"""Gated activations over a fused gate/up projection (gate rows first, then up), and the plain
ones of ungated MLPs."""
import torch
import torch.nn.functional as F


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
