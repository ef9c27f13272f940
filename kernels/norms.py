"""RMSNorm, computed in float32 exactly as Hugging Face Llama/Qwen (or Gemma) do; Cohere's LayerNorm."""
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


class LayerNorm(nn.Module):
    """Cohere's LayerNorm: mean-centred, a weight and no bias, in float32. A 2-D weight
    [heads, head_dim] (Cohere's q/k norms) gives each head its own."""

    def __init__(self, size, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.float32)
        centred = xf - xf.mean(-1, keepdim=True)
        xf = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.to(torch.float32) * xf).to(x.dtype)


class LayerNorm1P(nn.LayerNorm):
    """Nemotron's: torch's LayerNorm (with bias) scaling by 1 + weight."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.layer_norm(x, self.normalized_shape, self.weight + 1.0, self.bias, self.eps)


class PlainLayerNorm(nn.Module):
    """OLMo's: LayerNorm without weight or bias, in float32."""

    def __init__(self, size: int, eps: float = 1e-5):
        super().__init__()
        self.size, self.eps = size, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.layer_norm(x.float(), (self.size,), None, None, self.eps).to(x.dtype)
