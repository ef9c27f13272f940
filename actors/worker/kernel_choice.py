"""Which kernels a rank runs: decided once at start for this device and model, logged in one
line, and the only place that knows the rules.

- attention: flash (flash-attn / vllm-flash-attn, CUDA, where installed and applicable), else
  on CUDA shoal's Triton kernel (kernels/triton_attention.py: one launch per layer over the
  paged pool); on CPU shoal's C++ paged kernel (kernels/csrc/paged_attention.cpp: AVX-512,
  AVX2 or a portable loop, whichever the CPU has), else plain torch (SDPA over gathered
  blocks);
- linear: on CPU float32 through shoal's panel kernel on AVX-512 CPUs
  (kernels/csrc/panel_linear.cpp), bf16 through shoal's pairs kernel on CPUs with AVX512-BF16
  and no AMX (kernels/csrc/bf16_linear.cpp), else oneDNN's inner product (float32, or bf16 where
  the CPU has bf16 matmuls), all on weights packed once here, whatever the decode mode or layout;
  torch (cuBLAS) on CUDA; with --quantization int8 / fp8 on CPU shoal's 8-bit kernel
  (kernels/csrc/int8_linear.cpp: AVX2 or a portable loop), on CUDA FP8 matmuls
  (`torch._scaled_mm`, fp8 on compute capability 8.9+) or shoal's Triton weight-only kernel;
  with --quantization w8a8_int8 int8 x int8 matmuls (on CPU oneDNN's int8 linear on weights
  packed once here where the CPU has VNNI / AMX, else shoal's AVX2 kernel on weights packed as
  they are quantized, else `torch._int_mm`; cuBLASLt on CUDA);
- decode: CUDA graphs on a GPU, torch.compile on CPU (actors/worker/compiled_decode.py), or
  eager, with the reason.

The kernels themselves (kernels/) still check, per call, that a tensor is one they can take
(a device, a dtype, a stride), and `SHOAL_NATIVE_KERNELS=0` / `SHOAL_ONEDNN_LINEAR=0` switch
the native kernels off in kernels/ itself.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from actors.config import EngineConfig
from actors.models.llama import fused_block
from kernels import flash_attention, linear, native, triton_programs
from kernels.env import flag
from kernels.quantization import bf16_dot, fp8_matmuls, w8a8_cpu_kernel

log = logging.getLogger("shoal.runner")


@dataclass(frozen=True)
class KernelChoice:
    attention: str  # flash_attn | vllm_flash_attn | cpp-avx512 | cpp-avx2 | cpp-portable | torch
    linear: str  # panel | bf16-pairs | onednn | torch | {int8,fp8}-{avx2,portable,dequantised,triton} | fp8-scaled-mm | w8a8_int8-{onednn-packed,vnni,avx2,onednn,onednn-split,cublas}
    decode: str  # cuda-graphs | compiled | eager
    decode_off: str | None = None  # why decode is eager

    @property
    def packs_weights(self) -> bool:
        """The linear layers read weights packed once at start (in place of the weights, but for a tied head)."""
        return self.linear in ("panel", "bf16-pairs", "onednn", "w8a8_int8-onednn-packed")

    def describe(self) -> str:
        why = f" ({self.decode_off})" if self.decode_off else ""
        return f"kernels: attention {self.attention}, linear {self.linear}, decode {self.decode}{why}"


def choose(config: EngineConfig, spec, device: torch.device, world_size: int, lora: bool) -> KernelChoice:
    """This rank's kernels (`spec`: the ModelSpec, whose attention backend rank 0 resolved)."""
    # MoE layers wait for the GPU to split tokens by expert, except on the Triton backend's
    # fused path (kernels/triton_moe.py).
    moe = spec.args.moe is not None and not (spec.attn_backend == "triton" and fused_block(spec.args))
    moe = moe or bool(spec.args.gemma4 and spec.args.gemma4.experts)  # (Gemma 4's MoE block: no fused path)
    off = graphs_off_reason(device_type=device.type, eager_decode=config.eager_decode or eager_by_environment(),
                            world_size=world_size, lora=lora, moe=moe)
    if off is None and spec.args.linear_attn is not None:
        off = "linear-attention layers (a recurrent state per sequence, kept by the eager step)"
    if off is None and device.type == "cpu" and spec.attn_backend == "triton":
        off = "Triton interpreted on CPU"  # torch.compile can't trace the interpreter
    decode = "eager" if off else ("cuda-graphs" if device.type == "cuda" else "compiled")
    return KernelChoice(attention_kernel(spec, device), linear_kernel(spec.dtype, device, spec.quantization),
                        decode, off)


def attention_kernel(spec, device: torch.device) -> str:
    if spec.attn_backend == "flash":
        return spec.flash_library
    if spec.attn_backend == "triton":
        return "triton" + ("-interpreted" if device.type == "cpu" else "")
    if device.type == "cpu" and native.paged_decode_attention_op() is not None:  # builds it now
        paths = ["portable", "avx2", "avx512"]  # narrowest first
        cpu = {"AVX512": 2, "AVX2": 1}.get(torch.backends.cpu.get_cpu_capability(), 0)
        held = {"portable": 0, "avx2": 1, "best": 2}[native.attention_path()]  # SHOAL_CPU_ATTENTION
        return "cpp-" + paths[min(cpu, held)]
    return "torch"


def linear_kernel(dtype: torch.dtype, device: torch.device, quantization: str | None = None) -> str:
    if quantization == "w8a8_int8":  # int8 x int8
        if device.type == "cuda":
            return "w8a8_int8-cublas"
        kernel = w8a8_cpu_kernel()  # (kernels/quantization.py)
        if kernel == "onednn-split":
            log.warning("w8a8_int8: this CPU's int8 gemm saturates (no VNNI) and shoal's AVX2 kernel is unavailable, "
                        "so the weights are kept in halves: exact but slower than --quantization int8 here")
        return f"w8a8_int8-{kernel}"
    if quantization:
        if quantization == "fp8" and fp8_matmuls(device):
            return "fp8-scaled-mm"
        if device.type == "cuda":
            return f"{quantization}-triton"
        if native.int8_linear_op() is None:  # builds it now
            return f"{quantization}-dequantised"
        wide = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")  # (fp8 also needs F16C: every such CPU)
        if wide and dtype == torch.bfloat16 and bf16_dot():
            return f"{quantization}-avx512-bf16"  # bf16 activations as they are
        return f"{quantization}-{'avx2' if wide else 'portable'}"
    if device.type != "cpu" or not linear.supported(dtype):
        return "torch"
    if dtype == torch.float32 and native.panel_linear_op() is not None:
        return "panel"
    if dtype == torch.bfloat16 and native.bf16_linear_op() is not None:
        return "bf16-pairs"
    return "onednn"


def eager_by_environment() -> bool:
    """SHOAL_EAGER_DECODE=1 decodes eagerly whatever the engine's options say (read at engine
    start; `shoal serve` also takes it as --eager-decode). The test suite sets it."""
    return flag("SHOAL_EAGER_DECODE", False)


def graphs_off_reason(*, device_type: str, eager_decode: bool, world_size: int, lora: bool,
                      moe: bool) -> str | None:
    """Why this runner decodes eagerly (None: CUDA graphs on a GPU, torch.compile on CPU)."""
    if device_type not in ("cuda", "cpu"):
        return f"{device_type} device"
    if eager_decode:
        return "--eager-decode"
    if world_size > 1:
        return "tp x pp > 1 (not supported yet)"
    if lora:
        return "LoRA adapters (per-step adapter slots)"
    if moe:
        return "mixture-of-experts layers (data-dependent routing; graphs need --attn-backend triton)"
    return None


# --------------------------------------------------------------------------- resolved by rank 0

def device_type(config: EngineConfig) -> str:
    """Where the engine runs: --device, or cuda when auto finds a GPU."""
    if config.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return config.device


def attention_backend(config: EngineConfig, dtype: torch.dtype, head_dim: int,
                      sinks: bool = False, fp8_kv: bool = False) -> tuple[str, str | None]:
    """(backend, flash library), for the ModelSpec every rank shares (the flash library sets
    the block size). auto picks flash where it runs, else triton on CUDA, else native, and
    says nothing; an explicit flash or triton that can't run falls back with one warning
    naming why. sinks: the model has attention sinks (gpt-oss), which flash can't take.
    fp8_kv: --kv-cache-dtype fp8, whose pool flash-attn can't read: auto passes flash over,
    an explicit --attn-backend flash is refused."""
    asked = config.attn_backend
    if asked == "native":
        return "native", None
    if asked == "flash" and fp8_kv:
        raise ValueError("--attn-backend flash can't read an fp8 KV cache (--kv-cache-dtype fp8): "
                         "use --attn-backend triton (GPU) or native, or auto, which picks triton on a GPU")
    if asked in ("auto", "flash"):
        why = ("attention sinks (gpt-oss) are not in its API" if sinks else
               "it can't read an fp8 KV cache" if fp8_kv else flash_unavailable(config, dtype, head_dim))
        if why is None:
            library = flash_attention.installed()
            if not config.block_size or config.block_size % flash_attention.block_multiple(library) == 0:
                return "flash", library
            why = (f"{library} needs a block size that is a multiple of "
                   f"{flash_attention.block_multiple(library)}, not --block-size {config.block_size}")
        if asked == "flash":
            log.warning("--attn-backend flash can't run here (%s); using native", why)
            return "native", None
        if device_type(config) != "cuda":  # on CPU auto means the C++ kernels
            return "native", None
    why = triton_unavailable(config)
    if why is None:
        return "triton", None
    if asked == "triton":
        log.warning("--attn-backend triton can't run here (%s); using native", why)
    return "native", None


def triton_unavailable(config: EngineConfig) -> str | None:
    """Why the Triton kernel can't run (one phrase), or None: it needs Triton, and a CUDA
    device or, for tests on CPU, Triton's interpreter (TRITON_INTERPRET=1)."""
    if not triton_programs.available():
        return "Triton is not installed"
    if device_type(config) != "cuda" and not triton_programs.interpreted():
        return "it needs a CUDA device (or TRITON_INTERPRET=1 on CPU)"
    return None


def flash_unavailable(config: EngineConfig, dtype: torch.dtype, head_dim: int) -> str | None:
    if device_type(config) != "cuda":
        return "it needs a CUDA device"
    return flash_attention.unavailable_reason("cuda", dtype, head_dim, flash_attention.installed(),
                                              torch.cuda.get_device_capability(0))
