"""RMSNorm, computed in float32 exactly as Hugging Face Llama/Qwen (or Gemma) do."""
import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.offset = offset  # Gemma scales by (1 + weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.offset:
            return gemma_rms_norm(x, self.weight, self.eps, self.offset)
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """Gemma's order: the scale (offset + weight) applied in float32, then the cast."""
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (offset + weight.float())).to(x.dtype)
