"""The model's settings, worked out once by rank 0 and handed to every rank as they are."""
from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from actors.config import EngineConfig
from actors.loader import eos_token_ids, read_config, resolve_dtype, resolve_model_path
from actors.models.args import ModelArgs
from actors.parallel import parse_layer_split

log = logging.getLogger("shoal.engine")


@dataclass(frozen=True)
class ModelSpec:
    path: Path  # the checkpoint directory (the same path on every node)
    hf_config: dict
    args: ModelArgs
    dtype: torch.dtype  # what the model computes and caches in
    max_model_len: int
    eos_ids: frozenset[int]
    layer_split: list[int]  # first layer of each pipeline stage, then the end
    attn_backend: str  # native | flash: what runs here (--attn-backend resolved)
    # The weights' precision when it is narrower than `dtype`: bfloat16/float16 asked for on a
    # CPU without matmul units for it computes in float32 on weights rounded to it (below).
    weight_dtype: torch.dtype | None = None


def resolve_model(config: EngineConfig, tokenizer) -> ModelSpec:
    """Raises ValueError for settings the checkpoint can't honour."""
    path = resolve_model_path(config.model_path)
    hf = read_config(path)
    limit = hf.get("max_position_embeddings", 2048)
    if config.max_model_len and config.max_model_len > limit:
        raise ValueError(f"--max-model-len {config.max_model_len} is over the model's "
                         f"max_position_embeddings {limit}")
    dtype, weight_dtype = compute_dtype(resolve_dtype(config.dtype, hf), config.device)
    return ModelSpec(
        path=path, hf_config=hf, args=ModelArgs.from_hf(hf), dtype=dtype, weight_dtype=weight_dtype,
        max_model_len=config.max_model_len or limit,
        eos_ids=frozenset(eos_token_ids(path, hf, tokenizer)),
        layer_split=parse_layer_split(config.pp_layer_split, hf["num_hidden_layers"], config.pp_size),
        attn_backend=attn_backend(config))


def compute_dtype(dtype: torch.dtype, device: str) -> tuple[torch.dtype, torch.dtype | None]:
    """(compute dtype, weight dtype or None). A CPU without bfloat16 (AVX512-BF16 / AMX) or
    float16 (AVX512-FP16 / AMX-FP16) matmul instructions runs 16-bit matmuls several times
    slower than float32 (7x for bf16 on an AVX2 EPYC, docs/benchmarks.md): there the model
    computes in float32 on weights rounded to the 16-bit dtype, so outputs are those of the
    16-bit weights, computed more precisely, at float32 speed and memory."""
    on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    if dtype == torch.float32 or not on_cpu or cpu_has_matmul(dtype):
        return dtype, None
    log.warning("this CPU has no %s matmul instructions: computing in float32 on weights rounded "
                "to %s", dtype, dtype)
    return torch.float32, dtype


def cpu_has_matmul(dtype: torch.dtype) -> bool:
    """Whether oneDNN has fast 16-bit matmul kernels for `dtype` on this CPU."""
    mkldnn = torch.ops.mkldnn
    if dtype == torch.bfloat16:
        return bool(mkldnn._is_mkldnn_bf16_supported())
    return bool(mkldnn._is_mkldnn_fp16_supported())


def attn_backend(config: EngineConfig) -> str:
    """flash needs CUDA and flash-attn or vllm-flash-attn: auto picks it where it runs; an
    explicit flash that can't run falls back to native with one warning."""
    if config.attn_backend == "native":
        return "native"
    if config.device != "cpu" and torch.cuda.is_available() and \
            any(importlib.util.find_spec(m) for m in ("flash_attn", "vllm_flash_attn")):
        return "flash"
    if config.attn_backend == "flash":
        log.warning("--attn-backend flash can't run here (it needs CUDA and flash-attn); using native")
    return "native"
