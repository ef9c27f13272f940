"""`shoal collect-env`: what to paste into a bug report. Versions, the machine, the
accelerators torch sees, and the Ray cluster's resources when one is reachable.

It never starts a Ray cluster: app/cli/ray_probe.py connects in a child process, under a time
limit (a stale address can make Ray retry for a long time), and leaves this process free of
Ray's threads.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
from importlib import metadata

PACKAGES = ("shoal", "torch", "transformers", "tokenizers", "safetensors", "gguf", "ray", "fastapi",
            "pydantic", "uvicorn", "openai", "xgrammar", "numpy", "triton", "flash-attn",
            "vllm-flash-attn", "matplotlib")
ENV_VARS = ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "RAY_ADDRESS", "RAY_AUTH_MODE", "HF_HOME",
            "HF_HUB_OFFLINE", "SHOAL_MODEL_PATH")


def add_collect_env_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "collect-env", allow_abbrev=False, help="print versions, devices and Ray resources",
        description="Collect environment information for bug reports.")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument("--ray-address", default=None, metavar="ADDR",
                        help="Ray cluster to ask (default: $RAY_ADDRESS, then the cluster on this "
                             "machine if any; 'none' skips the probe)")
    parser.add_argument("--ray-timeout", type=float, default=20.0, metavar="S",
                        help="give up on the Ray probe after S seconds (default 20)")
    parser.set_defaults(handler=collect_env_command)


def collect_env_command(args: argparse.Namespace) -> int:
    report = collect(args.ray_address, args.ray_timeout)
    print(json.dumps(report, indent=2) if args.json else format_text(report))
    return 0


def collect(ray_address: str | None = None, ray_timeout: float = 20.0) -> dict:
    env = {k: os.environ[k] for k in ENV_VARS if k in os.environ}
    return {"versions": versions(), "system": system(), "torch": torch_info(), "cpu_linear": cpu_linear(),
            "quantization": quantization(), "nvidia_smi": nvidia_smi(), "env": env,
            "ray_cluster": ray_cluster(ray_address, ray_timeout)}


def versions() -> dict:
    found = {"python": sys.version.split()[0]}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def system() -> dict:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {"platform": platform.platform(), "cpu": cpu_model(), "logical_cores": os.cpu_count(),
            "usable_cores": usable,
            **memory_gib()}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_gib() -> dict:
    """Total and available memory from /proc/meminfo (Linux); empty elsewhere."""
    fields = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, value = line.split(":", 1)
                fields[key] = int(value.split()[0]) / 2**20  # kB -> GiB
    except (OSError, ValueError, IndexError):
        return {}
    return {"memory_total_gib": round(fields.get("MemTotal", 0), 2),
            "memory_available_gib": round(fields.get("MemAvailable", 0), 2)}


def torch_info() -> dict:
    try:
        import torch
    except ImportError:
        return {"installed": False}
    info = {"version": torch.__version__, "cuda_build": torch.version.cuda,
            "cuda_available": torch.cuda.is_available(), "threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    if info["cuda_available"]:
        info["devices"] = [{"name": torch.cuda.get_device_name(i),
                            "memory_gib": round(torch.cuda.get_device_properties(i).total_memory
                                                / 2**30, 2)}
                           for i in range(torch.cuda.device_count())]
    return info


LINEAR_KERNELS = {"panel": "shoal's AVX-512 panel kernel (kernels/csrc/panel_linear.cpp)",
                  "bf16-pairs": "shoal's AVX512-BF16 pairs kernel (kernels/csrc/bf16_linear.cpp)",
                  "onednn": "oneDNN's inner product", "torch": "torch (F.linear)"}


def cpu_linear() -> dict:
    """The kernel a float32 and a bfloat16 model's linear layers run through on this CPU
    (actors/worker/kernel_choice.py)."""
    try:
        import torch

        from actors.worker.kernel_choice import linear_kernel
        from actors.worker.model_spec import cpu_has_matmul
    except ImportError:
        return {}
    cpu = torch.device("cpu")
    f32 = LINEAR_KERNELS[linear_kernel(torch.float32, cpu)]
    bf16 = LINEAR_KERNELS[linear_kernel(torch.bfloat16, cpu)] if cpu_has_matmul(torch.bfloat16) else \
        f"float32 on weights rounded to bf16 (no bf16 matmuls here): {f32}"
    return {"float32": f32, "bfloat16": bf16}


def quantization() -> dict:
    """Each weight format of docs/quantization.md and how this machine would run it."""
    try:
        import torch

        from actors.worker import gguf_checkpoint
        from kernels.quantization import bf16_dot, w8a8_cpu_kernel
    except ImportError:
        return {}
    wide = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    cpu = f"CPU, {'the AVX2 kernel' if wide else 'the portable loop'} (kernels/csrc/int8_linear.cpp)"
    if wide and bf16_dot():
        cpu += ", bf16 activations through AVX512-BF16"
    fp8_gpu = any(torch.cuda.get_device_capability(i) >= (8, 9) for i in range(torch.cuda.device_count()))
    return {"int8": f"{cpu}; CUDA, shoal's Triton weight-only kernel",
            "w8a8_int8": "int8 x int8 (activations quantized per token): CPU, "
                         + {"onednn-packed": "oneDNN's int8 linear on weights packed at start",
                            "vnni": "shoal's AVX512-VNNI kernel (kernels/csrc/int8_linear.cpp), weights in memory once",
                            "avx2": "shoal's AVX2 kernel (kernels/csrc/int8_linear.cpp; oneDNN's is slow or saturates "
                                    "here: no VNNI)",
                            "onednn": "oneDNN's gemm (torch._int_mm)",
                            "onednn-split": "oneDNN's gemm (torch._int_mm) on weights split in halves (no VNNI: "
                                            "--quantization int8 is faster)"}[w8a8_cpu_kernel()]
                         + "; CUDA, torch._int_mm's cuBLASLt (not yet run on a GPU)",
            "fp8 online": f"{cpu}, weight-only; CUDA, "
                          + ("FP8 matmuls (torch._scaled_mm)" if fp8_gpu else "FP8 matmuls on compute capability 8.9+, "
                             "else shoal's Triton weight-only kernel"),
            "fp8 checkpoints": "transformers' fine-grained fp8, fbgemm_fp8, ModelOpt FP8, compressed-tensors "
                               "float-quantized: loaded as float (dequantised as they load); FP8 matmuls with "
                               "--quantization fp8",
            "int8 checkpoints (compressed-tensors int-quantized)":
                "their int8 layers on the checkpoint's codes and scales: W8A8 as w8a8_int8, W8A16 as int8 (above)",
            "mxfp4 checkpoints": "loaded as float (dequantised expert by expert); no MXFP4 matmuls yet",
            "gguf files": f"llama.cpp's {' / '.join(sorted(gguf_checkpoint.SUPPORTED))} files (Mixtral as llama), "
                          "loaded as float (dequantised by gguf-py as they load); --quantization int8 / "
                          "w8a8_int8 / fp8 on top",
            "nvfp4 checkpoints": "compressed-tensors nvfp4-pack-quantized, ModelOpt NVFP4 / W4A16_NVFP4: loaded "
                                 "as float (dequantised as they load); no FP4 matmuls",
            "gptq / awq / compressed-tensors int4 checkpoints":
                "loaded as float (dequantised as they load); SHOAL_INT4_KERNEL=1 keeps them packed "
                "for the Triton w4a16 kernel (kernels/int4_linear.py; not yet run on a GPU)",
            "fp8 KV cache": "--kv-cache-dtype fp8 (e4m3, per-layer scales): CPU through "
                            f"{'the C++ kernel' if wide else 'the C++ portable loop'} or torch, CUDA through Triton "
                            "(not flash-attn)"}


def nvidia_smi() -> str | None:
    if not shutil.which("nvidia-smi"):
        return None
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"failed: {exc}"


def ray_cluster(address: str | None, timeout: float) -> dict:
    address = address or os.environ.get("RAY_ADDRESS") or "auto"
    if address.lower() == "none":
        return {"status": "skipped"}
    try:
        done = subprocess.run([sys.executable, "-m", "app.cli.ray_probe", address],
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": "timed out", "address": address}
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        return {"status": "not connected", "address": address, "reason": last[:300]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def format_text(report: dict) -> str:
    lines = []
    for section, values in report.items():
        lines.append(f"== {section}")
        if isinstance(values, dict):
            lines += [f"{key:<23} {format_value(value)}" for key, value in values.items()]
        else:
            lines.append(format_value(values))
    return "\n".join(lines)


def format_value(value) -> str:
    if value is None:
        return "-"
    return json.dumps(value) if isinstance(value, (dict, list)) else str(value)
