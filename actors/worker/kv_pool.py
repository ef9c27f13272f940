"""Every layer's KV cache as views of one pool tensor [layers, planes, blocks x block size, KV
heads, head dim]: allocated once per rank (actors/worker/model_runner.py), and small for the
decode compile job (actors/worker/compile_job.py). Planes: K and V, or MLA's one latent plane
(ModelArgs.kv_planes), which a layer sees as both its K and its V cache.

`dtype` is the pool's: the model's, or float8 e4m3 with --kv-cache-dtype fp8 (one byte an
element; the layers' k_scale / v_scale say what a stored 1.0 means, kernels/kv_quant.py).

Linear-attention and convolution layers (actors/models/hybrid.py) have no place in the pool: each
keeps a state per input-batch row instead (`bind_states`)."""
from __future__ import annotations

import math
import mmap

import torch


def bind_kv_cache(model, blocks: int | None, block_size: int, dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor | None:
    """A zeroed pool of `blocks` blocks as every layer's cache (None: drop it); returns it.
    On CPU its pages come from an anonymous mapping, zero until written: the process's memory
    grows with the blocks in use, not with the pool's size. Layers of different shapes (Gemma 4's
    wider global heads) get their slices of one flat pool; a layer that reads another's cache
    (Gemma 4's KV sharing) gets that layer's slices."""
    layers = kv_layers(model)
    pool, caches = None, [(None, None)] * len(layers)
    if blocks is not None:
        planes, slots = model.args.kv_planes, blocks * block_size
        shapes = [(planes, slots, attn.kvh, attn.d) for attn in layers]
        if len(set(shapes)) <= 1:
            pool = zeroed((len(layers), *(shapes[0] if shapes else (planes, slots, 0, 0))), dtype, device)
            caches = [(pool[i, 0], pool[i, -1]) for i in range(len(layers))]
        else:
            pool = zeroed((sum(math.prod(shape) for shape in shapes),), dtype, device)
            offset = 0
            for i, shape in enumerate(shapes):
                view = pool[offset:offset + math.prod(shape)].view(shape)
                caches[i], offset = (view[0], view[-1]), offset + math.prod(shape)
    for attn, (k, v) in zip(layers, caches):
        attn.k_cache, attn.v_cache = k, v
    first = getattr(model, "first_layer", 0)
    for layer in model.model.layers:  # readers of another layer's cache (on this stage)
        source = getattr(layer.self_attn, "kv_source", None)
        if source is not None:
            owner = model.model.layers[source - first].self_attn
            layer.self_attn.k_cache, layer.self_attn.v_cache = owner.k_cache, owner.v_cache
    return pool


def kv_bytes_per_token(model, dtype: torch.dtype) -> int:
    """What one token's K/V costs in this stage's pool, over its layers' shapes."""
    return sum(model.args.kv_planes * attn.kvh * attn.d for attn in kv_layers(model)) * dtype.itemsize


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor; on CPU its pages come from an anonymous mapping, zero until written."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = dtype.itemsize * math.prod(shape)
    pages = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=torch.uint8)[:nbytes].view(dtype).view(shape)


def kv_layers(model) -> list:
    """The attention modules of this stage's layers that keep K/V of their own in the pool."""
    return [layer.self_attn for layer in model.model.layers if getattr(layer.self_attn, "caches_kv", True)]


def bind_states(model, rows: int, dtypes: dict, device: torch.device) -> int:
    """Each state layer's states for `rows` input-batch rows (`state_shapes`: name -> (shape of one
    row, "conv" | "ssm")), in `dtypes`' dtype for their kind: a convolution's last inputs, a
    recurrent state. Returns their bytes (0: no such layer)."""
    for attn in state_layers(model):
        for name, (shape, kind) in attn.state_shapes.items():
            setattr(attn, name, zeroed((rows, *shape), dtypes[kind], device))
    return state_bytes(model, rows, dtypes)


def state_bytes(model, rows: int, dtypes: dict) -> int:
    """What bind_states allocates."""
    return rows * sum(math.prod(shape) * dtypes[kind].itemsize
                      for a in state_layers(model) for shape, kind in a.state_shapes.values())


def state_dtypes(config, dtype: torch.dtype, hf_config: dict) -> dict:
    """{"conv": dtype, "ssm": dtype} of the states, by vLLM's options: --mamba-cache-dtype for both
    (auto: the model's for the convolutions), --mamba-ssm-cache-dtype for the recurrent states
    (auto: --mamba-cache-dtype's if set, else the checkpoint's mamba_ssm_cache_dtype, else float32,
    which the states accumulate in)."""
    named = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    both = named.get(config.mamba_cache_dtype)
    ssm = (named.get(config.mamba_ssm_cache_dtype) or both or named.get(hf_config.get("mamba_ssm_cache_dtype"))
           or torch.float32)
    return {"conv": both or dtype, "ssm": ssm}


def state_layers(model) -> list:
    return [layer.self_attn for layer in model.model.layers if hasattr(layer.self_attn, "state_shapes")]
