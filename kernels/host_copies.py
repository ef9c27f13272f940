"""Host tensors onto the device without waiting for the GPU.

A copy from pageable host memory synchronises with the stream, so it waits for every kernel
already queued: the step the GPU is running. Under async scheduling the next step's inputs go
up while the current step runs, so they go through pinned memory with a non-blocking copy
(torch's caching host allocator keeps the pinned block until the copy has run).
"""
from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`t` (a host tensor) as `dtype` on `device`, without waiting for the GPU's queued work."""
    device = torch.device(device)
    if dtype is not None:
        t = t.to(dtype)
    return staged(t, device).to(device, non_blocking=True)


def staged(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` ready for a non-blocking copy to `device`: pinned when that is a GPU."""
    return t.pin_memory() if device.type == "cuda" else t
