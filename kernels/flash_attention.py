"""Flash attention on the paged KV cache (CUDA only): vllm-flash-attn or flash-attn.

The pool is the same one the native kernels use: per layer [num_slots, kv_heads, head_dim],
num_slots = num_blocks * block_size, which is [num_blocks, block_size, kv_heads, head_dim]
viewed block by block: the layout both libraries read through a block table.

- vllm-flash-attn (`vllm_flash_attn`, or the copy inside vLLM): one `flash_attn_varlen_func`
  call for the whole step, decodes and prefill chunks alike: packed queries (`cu_seqlens_q`),
  each row's key count (`seqused_k`; older releases take `cu_seqlens_k`), `block_table`.
  Block size: a multiple of 16.
- flash-attn (Dao-AILab): decodes through `flash_attn_with_kvcache` (`cache_seqlens`,
  `block_table`), prefill chunks through `flash_attn_varlen_func` with `cu_seqlens_k` and
  `block_table`. Its paged path needs a block size that is a multiple of 256.

Both take GQA as is (fewer KV heads than query heads) and align the causal mask to the bottom
right, so query i of an n-token chunk whose row has K keys sees keys 0 .. K - n + i: exactly
the chunk's own positions. Nothing here imports either library until `load` is called, so
this module imports on any machine.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
from dataclasses import dataclass
from functools import lru_cache

import torch

from kernels.host_copies import to_device

# Import names in order of preference, and the block-size multiple each one's paged path needs.
LIBRARIES = {"vllm_flash_attn": 16, "vllm.vllm_flash_attn": 16, "flash_attn": 256}
DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


def installed() -> str | None:
    """The first flash library that can be imported here (not imported yet), or None."""
    for name in LIBRARIES:
        parent = name.split(".")[0]
        if importlib.util.find_spec(parent) is None:
            continue
        if name == parent or _find_submodule(name):
            return name
    return None


def _find_submodule(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # finding a submodule imports its parent, which may fail
        return False


def block_multiple(library: str) -> int:
    return LIBRARIES[library]


def unavailable_reason(device_type: str, dtype: torch.dtype, head_dim: int,
                       library: str | None, capability: tuple[int, int] | None = None) -> str | None:
    """Why flash can't run with these settings (one phrase), or None when it can."""
    if device_type != "cuda":
        return "it needs a CUDA device"
    if capability is not None and capability < (8, 0):
        return f"it needs an Ampere or newer GPU (compute capability 8.0+, this one is {capability[0]}.{capability[1]})"
    if dtype not in DTYPES:
        return f"it runs in float16 or bfloat16, not {str(dtype).removeprefix('torch.')}"
    if head_dim % 8 or head_dim > MAX_HEAD_DIM:
        return f"it needs a head size that is a multiple of 8 up to {MAX_HEAD_DIM}, not {head_dim}"
    if library is None:
        return "neither vllm-flash-attn nor flash-attn is installed"
    return None


@dataclass(frozen=True)
class FlashOps:
    library: str
    varlen: object  # flash_attn_varlen_func
    with_kvcache: object  # flash_attn_with_kvcache
    seqused_k: bool  # varlen takes seqused_k (newer vllm-flash-attn); else cu_seqlens_k
    takes_out: bool = True  # varlen writes into a given `out` (vllm-flash-attn)


@lru_cache(maxsize=None)
def load(library: str) -> FlashOps:
    module = importlib.import_module(library)
    varlen = module.flash_attn_varlen_func
    params = inspect.signature(varlen).parameters
    return FlashOps(library, varlen, module.flash_attn_with_kvcache,
                    "seqused_k" in params and library != "flash_attn", "out" in params)


@dataclass
class FlashMetadata:
    """One step's rows for the flash kernels: decodes (one query each) first, then chunks."""
    ops: FlashOps | None
    block_size: int
    num_decodes: int
    cu_seqlens_q: torch.Tensor  # [B + 1] int32: row r's queries are q[cu[r]:cu[r + 1]]
    seqused_k: torch.Tensor  # [B] int32: keys of each row (its context, this step's tokens included)
    cu_seqlens_k: torch.Tensor  # [B + 1] int32: running sum of seqused_k
    block_tables: torch.Tensor  # [B, W] int32 (padding points at a real block; never read)
    max_seqlen_q: int
    max_seqlen_k: int


def build_metadata(query_lens: list[int], context_lens: list[int],
                   block_tables: list[list[int]] | torch.Tensor, num_decodes: int, block_size: int,
                   device, ops: FlashOps | None = None, width: int | None = None,
                   max_seqlen_k: int | None = None, pad_block: int = 0) -> FlashMetadata:
    """Per-row lists (or a [rows, width] table) -> FlashMetadata. width / max_seqlen_k: fixed
    sizes (CUDA graphs), else the step's own. context_lens count this step's tokens."""
    width = width or max(-(-k // block_size) for k in context_lens)
    if isinstance(block_tables, torch.Tensor):
        table = block_tables[:, :width].to(torch.int32)
    else:
        table = torch.full((len(block_tables), width), pad_block, dtype=torch.int32)
        for r, t in enumerate(block_tables):
            t = t[:width]
            table[r, :len(t)] = torch.tensor(t, dtype=torch.int32)
    q = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    k = torch.tensor(context_lens, dtype=torch.int32)
    cu_k = torch.cat([torch.zeros(1, dtype=torch.int32), k.cumsum(0, dtype=torch.int32)])
    return FlashMetadata(ops, block_size, num_decodes, to_device(q, device), to_device(k, device),
                         to_device(cu_k, device), to_device(table, device), max(query_lens),
                         max_seqlen_k or max(context_lens))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: FlashMetadata, scale: float, window: int | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """q: [T, heads, d] -> [T, heads, d]; this step's K/V already written to the pool. A query
    sees at most its last `window` keys; `softcap` caps scores to softcap * tanh(s / softcap)."""
    k4, v4 = _paged(k_cache, meta.block_size), _paged(v_cache, meta.block_size)
    ops = meta.ops
    extra = {}  # only when used: flash-attn releases before 2.6 have no softcap
    if window:
        extra["window_size"] = (window - 1, 0)  # keys left of the query's own, and none right
    if softcap:
        extra["softcap"] = softcap
    out = torch.empty_like(q)
    if ops.library != "flash_attn":  # vllm-flash-attn: the whole step in one call
        if ops.takes_out:
            _varlen(ops, q, k4, v4, meta, scale, out=out, **extra)
            return out
        return _varlen(ops, q, k4, v4, meta, scale, **extra)
    nd = meta.num_decodes
    if nd:
        out[:nd] = ops.with_kvcache(q[:nd].unsqueeze(1), k4, v4, cache_seqlens=meta.seqused_k[:nd],
                                    block_table=meta.block_tables[:nd], softmax_scale=scale,
                                    causal=True, **extra).squeeze(1)
    if meta.block_tables.shape[0] > nd:
        start = int(meta.cu_seqlens_q[nd])  # = nd: one query per decode
        chunk = _chunks(meta, nd)
        out[start:] = _varlen(ops, q[start:], k4, v4, chunk, scale, **extra)
    return out


def _varlen(ops: FlashOps, q, k4, v4, meta: FlashMetadata, scale: float, out=None, **extra):
    kwargs = dict(q=q, k=k4, v=v4, cu_seqlens_q=meta.cu_seqlens_q, max_seqlen_q=meta.max_seqlen_q,
                  max_seqlen_k=meta.max_seqlen_k, softmax_scale=scale, causal=True,
                  block_table=meta.block_tables, **extra)
    if ops.seqused_k:
        kwargs["seqused_k"] = meta.seqused_k
    else:
        kwargs["cu_seqlens_k"] = meta.cu_seqlens_k
    if out is not None:
        kwargs["out"] = out
    return ops.varlen(**kwargs)


def _chunks(meta: FlashMetadata, first: int) -> FlashMetadata:
    """The rows from `first` on, with their running sums restarted at 0."""
    q, k = meta.cu_seqlens_q[first:], meta.cu_seqlens_k[first:]
    return FlashMetadata(meta.ops, meta.block_size, 0, q - q[0], meta.seqused_k[first:], k - k[0],
                         meta.block_tables[first:], meta.max_seqlen_q, meta.max_seqlen_k)


def _paged(cache: torch.Tensor, block_size: int) -> torch.Tensor:
    """[num_slots, kvh, d] -> [num_blocks, block_size, kvh, d] (a view)."""
    slots, kvh, d = cache.shape
    return cache.view(slots // block_size, block_size, kvh, d)
