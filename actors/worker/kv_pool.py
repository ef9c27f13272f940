"""Every layer's KV cache as views of one pool tensor [layers, planes, blocks x block size, KV
heads, head dim]: allocated once per rank (actors/worker/model_runner.py), and small for the
decode compile job (actors/worker/compile_job.py). Planes: K and V, or MLA's one latent plane
(ModelArgs.kv_planes), which a layer sees as both its K and its V cache.

`dtype` is the pool's: the model's, or float8 e4m3 with --kv-cache-dtype fp8 (one byte an
element; the layers' k_scale / v_scale say what a stored 1.0 means, kernels/kv_quant.py).

Linear-attention layers (actors/models/hybrid.py) have no place in the pool: each keeps a state
per input-batch row instead (`bind_states`)."""
from __future__ import annotations

import math
import mmap

import torch


def bind_kv_cache(model, blocks: int | None, block_size: int, dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor | None:
    """A zeroed pool of `blocks` blocks as every layer's cache (None: drop it); returns it.
    On CPU its pages come from an anonymous mapping, zero until written: the process's memory
    grows with the blocks in use, not with the pool's size."""
    layers = kv_layers(model)
    pool = None
    if blocks is not None:
        shape = (len(layers), model.args.kv_planes, blocks * block_size, local_kv_heads(model), model.args.head_dim)
        pool = zeroed(shape, dtype, device)
    for i, attn in enumerate(layers):
        attn.k_cache, attn.v_cache = (None, None) if pool is None else (pool[i, 0], pool[i, -1])
    return pool


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor; on CPU its pages come from an anonymous mapping, zero until written."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = dtype.itemsize * math.prod(shape)
    pages = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=torch.uint8)[:nbytes].view(dtype).view(shape)


def kv_layers(model) -> list:
    """The attention modules of this stage's layers that keep K/V in the pool."""
    return [layer.self_attn for layer in model.model.layers if getattr(layer.self_attn, "caches_kv", True)]


def local_kv_heads(model) -> int:
    layers = kv_layers(model)
    return layers[0].kvh if layers else 0


def bind_states(model, rows: int, dtype: torch.dtype, device: torch.device) -> int:
    """Each linear-attention layer's state for `rows` input-batch rows: its convolution's last
    inputs (in `dtype`) and its float32 recurrent state. Returns their bytes (0: no such layer)."""
    total = 0
    for attn in state_layers(model):
        attn.conv_state = zeroed((rows, *attn.conv_state_shape), dtype, device)
        attn.state = zeroed((rows, *attn.state_shape), torch.float32, device)
        total += attn.conv_state.numel() * dtype.itemsize + attn.state.numel() * 4
    return total


def state_bytes(model, rows: int, dtype: torch.dtype) -> int:
    """What bind_states allocates."""
    return rows * sum(math.prod(a.conv_state_shape) * dtype.itemsize + math.prod(a.state_shape) * 4
                      for a in state_layers(model))


def state_layers(model) -> list:
    return [layer.self_attn for layer in model.model.layers if not getattr(layer.self_attn, "caches_kv", True)]
