"""Every layer's KV cache as views of one pool tensor [layers, planes, blocks x block size, KV
heads, head dim]: allocated once per rank (actors/worker/model_runner.py), and small for the
decode compile job (actors/worker/compile_job.py). Planes: K and V, or MLA's one latent plane
(ModelArgs.kv_planes), which a layer sees as both its K and its V cache.

`dtype` is the pool's: the model's, or float8 e4m3 with --kv-cache-dtype fp8 (one byte an
element; the layers' k_scale / v_scale say what a stored 1.0 means, kernels/kv_quant.py)."""
from __future__ import annotations

import mmap

import torch


def bind_kv_cache(model, blocks: int | None, block_size: int, dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor | None:
    """A zeroed pool of `blocks` blocks as every layer's cache (None: drop it); returns it.
    On CPU its pages come from an anonymous mapping, zero until written: the process's memory
    grows with the blocks in use, not with the pool's size."""
    layers = model.model.layers
    pool = None
    if blocks is not None:
        shape = (len(layers), model.args.kv_planes, blocks * block_size, local_kv_heads(model), model.args.head_dim)
        if device.type == "cpu":
            nbytes = dtype.itemsize * shape[0] * shape[1] * shape[2] * shape[3] * shape[4]
            pages = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            pool = torch.frombuffer(pages, dtype=torch.uint8)[:nbytes].view(dtype).view(shape)
        else:
            pool = torch.zeros(shape, dtype=dtype, device=device)
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        attn.k_cache, attn.v_cache = (None, None) if pool is None else (pool[i, 0], pool[i, -1])
    return pool


def local_kv_heads(model) -> int:
    return model.model.layers[0].self_attn.kvh if len(model.model.layers) else 0
