"""The model's settings, worked out once by rank 0 and handed to every rank as they are."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from actors.config import CHECKPOINT_FORMATS, EngineConfig
from actors.distributed.parallel import parse_layer_split
from actors.models.args import CONTEXT_CAPS, ModelArgs
from actors.pooling_params import PoolingParams
from actors.worker.kernel_choice import attention_backend, device_type
from actors.worker import int8_checkpoint
from actors.worker.checkpoint_files import eos_token_ids, read_config, resolve_model_path
from actors.worker.loader import check_quantization, resolve_dtype
from actors.worker.pooling_config import DEFAULT as DEFAULT_POOLING
from actors.worker.pooling_config import read_pooling
from kernels import flash_attention, kv_quant

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
    block_size: int = 16  # tokens per KV block (--block-size, or the backend's default)
    flash_library: str | None = None  # with flash: the module it imports (kernels/flash_attention.py)
    # The weights' precision when it is narrower than `dtype`: bfloat16/float16 asked for on a
    # CPU without matmul units for it computes in float32 on weights rounded to it (below).
    weight_dtype: torch.dtype | None = None
    pooling: PoolingParams = DEFAULT_POOLING  # embedding requests' defaults (actors/worker/pooling_config.py)
    # --quantization: int8 | fp8 | w8a8_int8 linear layers (kernels/quantization.py), or an int8
    # checkpoint's own scheme (actors/worker/int8_checkpoint.py) for only the layers it quantized
    quantization: str | None = None
    checkpoint_layers_only: bool = False
    kv_cache_dtype: torch.dtype | None = None  # the KV pool's (--kv-cache-dtype fp8: float8 e4m3); None: dtype

    @property
    def kv_dtype(self) -> torch.dtype:
        """What the KV pool holds: --kv-cache-dtype's, or the compute dtype."""
        return self.kv_cache_dtype or self.dtype


def resolve_model(config: EngineConfig, tokenizer_eos_id: int | None) -> ModelSpec:
    """Raises ValueError for settings the checkpoint can't honour. `tokenizer_eos_id`: the
    tokenizer's eos token id (joins the checkpoint's own)."""
    path = resolve_model_path(config.model_path)
    hf = read_config(path)
    args = ModelArgs.from_hf(hf)
    limit = args.max_position_embeddings  # (the config's, or the family's default)
    if config.max_model_len and config.max_model_len > limit:
        raise ValueError(f"--max-model-len {config.max_model_len} is over the model's "
                         f"max_position_embeddings {limit}")
    if args.max_context and args.max_context < (config.max_model_len or limit):
        missing = CONTEXT_CAPS[args.architecture]
        if config.max_model_len:
            raise ValueError(f"--max-model-len {config.max_model_len} is over the {args.max_context} tokens "
                             f"{args.architecture} is served for ({missing} is not implemented)")
        log.info("%s: contexts up to %d tokens (%s beyond that is not implemented)",
                 args.architecture, args.max_context, missing)
        limit = args.max_context
    if hf.get("image_text_architecture"):
        log.info("%s: its language model (%s) serves text; the vision tower is not loaded",
                 hf["image_text_architecture"], args.architecture)
    check_quantization(hf, config.quantization)
    quantization, checkpoint_layers_only = checkpoint_quantization(config.quantization, hf)
    cuda = device_type(config) == "cuda"
    dtype = resolve_dtype(config.dtype, hf) if config.dtype != "auto" or not cuda else gpu_auto_dtype(hf)
    dtype, weight_dtype = compute_dtype(dtype, on_cpu=device_type(config) == "cpu")
    if config.enable_lora and args.mla:
        raise ValueError(f"LoRA adapters are not supported for {args.architecture} (latent attention) yet")
    if args.linear_attn is not None:  # a state per sequence, which neither can roll back or skip ahead
        if config.enable_lora:
            raise ValueError(f"LoRA adapters are not supported for {args.architecture} (linear attention) yet")
        if config.speculative is not None:
            raise ValueError(f"speculative decoding is not supported for {args.architecture}: its linear-attention "
                             "layers' state cannot be rolled back to a rejected draft")
    kv_dtype = kv_quant.kv_cache_dtype(config.kv_cache_dtype, dtype)
    head_dim = max(args.gemma4.head_dims) if args.gemma4 else args.head_dim  # (Gemma 4's widest, its global heads)
    backend, library = attention_backend(config, dtype, head_dim, sinks=args.attn_sinks,
                                         fp8_kv=kv_dtype == kv_quant.FP8)
    if cuda:
        log.info("attention backend %s%s, dtype %s, KV cache %s", backend, f" ({library})" if library else "",
                 str(dtype).removeprefix("torch."), str(kv_dtype).removeprefix("torch."))
    return ModelSpec(
        path=path, hf_config=hf, args=args, dtype=dtype, weight_dtype=weight_dtype,
        max_model_len=config.max_model_len or limit,
        eos_ids=frozenset(eos_token_ids(path, hf, tokenizer_eos_id)),
        layer_split=parse_layer_split(config.pp_layer_split, args.num_layers, config.pp_size),
        attn_backend=backend, flash_library=library,
        block_size=config.block_size or (flash_attention.block_multiple(library) if library else 16),
        pooling=read_pooling(path), quantization=quantization, checkpoint_layers_only=checkpoint_layers_only,
        kv_cache_dtype=kv_dtype if kv_dtype != dtype else None)


def checkpoint_quantization(asked: str | None, hf: dict) -> tuple[str | None, bool]:
    """(what the linear layers run as, whether only the checkpoint's int8 layers do): --quantization
    where given (every linear layer; an int8 checkpoint's keep their codes), else an int8
    checkpoint's own scheme. A --quantization that names the checkpoint's format (gptq, awq, ...;
    check_quantization made sure it is the checkpoint's) asks for nothing more."""
    if asked in CHECKPOINT_FORMATS:
        asked = None
    int8 = int8_checkpoint.scheme(hf)
    if int8 is None or asked is not None:
        return asked, False
    if int8.static_activations:
        log.warning("this int8 checkpoint has static activation scales: shoal quantizes each row of activations "
                    "over its own scale instead (docs/quantization.md)")
    log.info("int8 checkpoint: its quantized layers run as %s", int8.kind)
    return int8.kind, True


def gpu_auto_dtype(hf: dict) -> torch.dtype:
    """--dtype auto on CUDA: the checkpoint's 16-bit dtype, else bfloat16 (float16 on GPUs
    without bfloat16). float32 stays the CPU default."""
    saved = hf.get("dtype") or hf.get("torch_dtype")
    if saved == "float16":
        return torch.float16
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def compute_dtype(dtype: torch.dtype, on_cpu: bool) -> tuple[torch.dtype, torch.dtype | None]:
    """(compute dtype, weight dtype or None). A CPU without bfloat16 (AVX512-BF16 / AMX) or
    float16 (AVX512-FP16 / AMX-FP16) matmul instructions runs 16-bit matmuls several times
    slower than float32 (7x for bf16 on an AVX2 EPYC, docs/benchmarks.md): there the model
    computes in float32 on weights rounded to the 16-bit dtype, so outputs are those of the
    16-bit weights, computed more precisely, at float32 speed and memory."""
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
