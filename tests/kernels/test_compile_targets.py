"""Our Triton kernels on GPUs they were not measured on (issue: an honest map of what runs where): each wrapper's
launch at the models' real widths (compile_for_target.py), compiled for Ada (sm_89), Blackwell datacenter (sm_100)
and consumer Blackwell (sm_120), fits the capability's shared memory a block; on Ampere (sm_80) the FP8 kernels do
not compile (its PTX has no e4m3 conversion), which is why the plan runs BF16 GEMMs below compute capability 8.9
(gpu_support.FP8_MIN), and the BF16 ones do. Compiled only: their results and speed on those GPUs are not
measured (Hopper's are: the GPU suite, benchmarks/)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qwen_image_fast.pipelines.core.gpu_support import FP8_MIN

SCRIPT = Path(__file__).with_name("compile_for_target.py")
# the most shared memory a block may use (the CUDA C programming guide's table of compute capabilities)
SHARED_PER_BLOCK = {80: 163 * 1024, 89: 99 * 1024, 100: 227 * 1024, 120: 99 * 1024}
FP8_CASES = ("_fp8", "gelu_fp8", "quantize_fp8_heads")


def compile_for(capability: int, tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, str(SCRIPT), str(capability)], capture_output=True, text=True, env=env,
                          timeout=600, cwd=SCRIPT.parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    return {row["case"]: row for row in map(json.loads, done.stdout.splitlines())}


@pytest.mark.parametrize("capability", [89, 100, 120])
def test_every_kernel_compiles_within_the_shared_memory_of(capability, tmp_path):
    results = compile_for(capability, tmp_path)
    assert len(results) >= 20, sorted(results)
    for case, row in results.items():
        assert "error" not in row, (case, row)
        assert row["kernels"], f"{case}: no kernel was launched"
        for name, shared, _ in row["kernels"]:
            assert shared <= SHARED_PER_BLOCK[capability], (case, name, shared)


def test_ampere_compiles_the_bf16_kernels_and_not_the_fp8_ones(tmp_path):
    assert (8, 0) < FP8_MIN  # the plan keeps FP8 off there
    results = compile_for(80, tmp_path)
    fp8 = {case for case in results if any(tag in case for tag in FP8_CASES)}
    assert len(fp8) >= 5 and len(results) - len(fp8) >= 10, sorted(results)
    for case, row in results.items():
        if case in fp8:
            assert "fp8e4nv not supported" in row.get("error", ""), (case, row)
        else:
            assert "error" not in row and all(s <= SHARED_PER_BLOCK[80] for _, s, _ in row["kernels"]), (case, row)
