#!/usr/bin/env bash
# The GPU session's one prepared run (under 8 minutes on an H100 / H200): what the machine is,
# the CUDA tests, the Triton kernel's own figures, and the engine's decode throughput on the
# two workloads of issue 44, every figure printed with the GPU's name. Each part has its own
# time limit, so one that fails or hangs leaves the others' figures.
#
#   bash tests/bench/gpu_check.sh            # from the repository root, on the GPU machine
#
# The device tool's machine has torch, triton and transformers but no Ray, FastAPI or
# xgrammar: only the offline engine runs here. Everything also goes to $OUT/gpu_check.log.
set -u
cd "$(dirname "$0")/../.."
LOG="${OUT:-/tmp}/gpu_check.log"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY="${PYTHON:-python3}"
{
  echo "== machine"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  echo "== tests (CUDA)"
  timeout 180 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py 2>&1 | tail -25
  echo "== paged attention kernels"
  timeout 60 "$PY" tests/bench/bench_gpu_attention.py 2>&1 | tail -12
  echo "== nano-vllm's workload, Qwen3-0.6B shape (target >= 12,000 output tok/s)"
  timeout 120 "$PY" tests/bench/bench_gpu.py --workload nano-vllm --variants triton-graphs 2>&1 | tail -6
  echo "== bench_gpu.py's 0.5B Llama, 256 requests (target >= 20,000 output tok/s)"
  timeout 120 "$PY" tests/bench/bench_gpu.py --variants triton-graphs,native-graphs 2>&1 | tail -8
} 2>&1 | tee "$LOG"
