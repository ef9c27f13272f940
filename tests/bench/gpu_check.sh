#!/usr/bin/env bash
# The GPU session's one prepared run (under 8 minutes on an H100 / H200): what the machine is,
# the CUDA tests, the Triton kernel's own figures, a decode step against the bandwidth floor, and
# the engine's throughput on the workloads of issue 44 and on a small MoE, every figure printed
# with the GPU's name. Each part has its own time limit, so one that fails or hangs leaves the
# others' figures.
#
#   bash tests/bench/gpu_check.sh            # from the repository root, on the GPU machine
#   PARTS=tests,moe VARIANTS=triton-graphs bash tests/bench/gpu_check.sh    # some parts only
#   PARTS=spec bash tests/bench/gpu_check.sh     # speculative decoding (issue 48), not in the default
#   PARTS=quant bash tests/bench/gpu_check.sh    # quantized weights and KV on CUDA, fp8 / int8 against bf16 (issue 49)
#
# The device tool's machine has torch, triton and transformers but no Ray, FastAPI or
# xgrammar: only the offline engine runs here. Everything also goes to $OUT/gpu_check.log,
# each part's whole output to its own $OUT/gpu_*.log.
set -u
cd "$(dirname "$0")/../.."
DIR="${OUT:-/tmp}"
LOG="$DIR/gpu_check.log"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY="${PYTHON:-python3}"
PARTS="${PARTS:-tests,attention,step,nano,llama,moe}"
# Which engine variants (tests/bench/bench_gpu.py's VARIANTS) to compare, each set in one process.
VARIANTS="${VARIANTS:-triton-graphs-held,triton-graphs}"
STEP_VARIANTS="${STEP_VARIANTS:-triton-graphs-held,triton-graphs}"
MOE_VARIANTS="${MOE_VARIANTS:-triton-eager-unfused,triton-eager,triton-graphs}"
part() { [[ ",$PARTS," == *",$1,"* ]]; }
{
  echo "== machine"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  if part tests; then
    echo "== tests (CUDA)"
    timeout 120 "$PY" -m pytest -q -p no:cacheprovider --tb=short tests/test_triton_fused.py 2>&1 | tee "$DIR/gpu_fused_tests.log" | tail -5
    timeout 150 "$PY" -m pytest -q -p no:cacheprovider -m gpu --tb=short tests/test_gpu.py 2>&1 | tee "$DIR/gpu_tests.log" | tail -25
  fi
  if part attention; then
    echo "== paged attention kernels"
    timeout 45 "$PY" tests/bench/bench_gpu_attention.py 2>&1 | tee "$DIR/gpu_attention.log" | tail -12
  fi
  if part moe; then
    echo "== a small Qwen3-MoE (32 experts, 4 per token), the Llama workload's requests"
    timeout 150 "$PY" tests/bench/bench_gpu.py --workload moe --variants "$MOE_VARIANTS" 2>&1 | tee "$DIR/gpu_moe.log" | tail -7
  fi
  if part step; then
    echo "== a decode step at batch 256 against the memory-bandwidth floor, Qwen3-0.6B shape"
    timeout 120 "$PY" tests/bench/bench_gpu.py --workload nano-vllm --step-profile --variants "$STEP_VARIANTS" 2>&1 | tee "$DIR/gpu_step.log" | grep -v -i warn | tail -45
  fi
  if part nano; then
    echo "== nano-vllm's workload, Qwen3-0.6B shape (target >= 12,000 output tok/s)"
    timeout 200 "$PY" tests/bench/bench_gpu.py --workload nano-vllm --variants "$VARIANTS" 2>&1 | tee "$DIR/gpu_nano.log" | tail -7
  fi
  if part llama; then
    echo "== bench_gpu.py's 0.5B Llama, 256 requests (target >= 20,000 output tok/s); -lazy: graphs captured in the run as sizes recur (issue 46)"
    timeout 190 "$PY" tests/bench/bench_gpu.py --variants "$VARIANTS,triton-graphs-lazy" 2>&1 | tee "$DIR/gpu_llama.log" | tail -10
  fi
  if part quant; then
    echo "== quantization: the CUDA tests (8-bit weights, int4 kept packed, the fp8 KV cache), then fp8 / int8 against bf16 on nano-vllm's workload (target fp8 >= 1.3x)"
    timeout 200 "$PY" -m pytest -q -p no:cacheprovider -m gpu --tb=short tests/test_fp8_kv_cache.py \
      tests/test_gpu.py -k "8_bit or int4 or fp8_kv or compiled_on_cuda or engine_on_cuda" 2>&1 | tee "$DIR/gpu_quant_tests.log" | tail -8
    timeout 300 "$PY" tests/bench/bench_gpu.py --workload nano-vllm --variants triton-graphs,triton-graphs-fp8,triton-graphs-int8 2>&1 \
      | tee "$DIR/gpu_quant.log" | tail -7
  fi
  if part spec; then
    echo "== n-gram speculative decoding, the bundled model's copying tasks (no SmolLM2 without a network)"
    timeout 180 "$PY" tests/bench/bench_speculative.py --demo --concurrency 1 32 --k 6 --lookup-min 1 2>&1 \
      | tee "$DIR/gpu_spec.log" | grep -v "^ *---\|^    " | tail -8
  fi
} 2>&1 | tee "$LOG"
