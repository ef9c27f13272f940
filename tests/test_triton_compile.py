"""Every Triton program shoal launches compiles for an H100 (sm_90), here, without a GPU: the
interpreter runs in the rest of the suite check the programs' arithmetic, this checks that the
GPU compiler takes them, on the branches the wrappers take on a GPU (tests/triton_compile_check.py)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kernels import triton_programs

SCRIPT = Path(__file__).with_name("triton_compile_check.py")


def _ptxas() -> bool:
    if not triton_programs.available():
        return False
    import triton
    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


@pytest.mark.skipif(not _ptxas(), reason="Triton with its CUDA backend (ptxas) is not installed")
def test_every_program_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--arch", "90"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    compiled = {line.split(":")[0].split()[-1] for line in run.stdout.splitlines() if line.startswith("sm_90 ")}
    assert compiled >= {"attention", "decode_split", "rms_norm", "qk_rope_write", "silu_and_mul",
                        "expert_gate_up", "expert_down", "w4a16_matmul", "weight_only_matmul"}, run.stdout
    assert re.search(r"sm_90: \d+ programs compiled", run.stdout), run.stdout


def test_a_program_the_gpu_compiler_refuses_fails_the_check(tmp_path):
    """The check is not vacuous: a program that only the interpreter takes (a loop-carried sum
    that starts as an integer and becomes a float) makes it fail."""
    if not _ptxas():
        pytest.skip("Triton with its CUDA backend (ptxas) is not installed")
    bad = tmp_path / "bad_check.py"
    bad.write_text(f"""
import sys
sys.path.insert(0, {str(SCRIPT.parent)!r})
import torch, triton, triton.language as tl
import triton_compile_check as check

@triton.jit
def running_sum(a_ptr, out_ptr, n):
    total = 0
    for i in range(n):
        total += tl.load(a_ptr + i)
    tl.store(out_ptr, total)

def cases(quick):
    a = torch.zeros(8)
    running_sum[(1,)](a, a.clone(), 8)

check.CASES = dict(bad=cases)
sys.exit(check.main(["--arch", "90"]))
""")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(bad)], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "FAILED sm_90 bad" in run.stdout
