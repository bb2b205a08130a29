"""One image on two GPUs (NCCL, torchrun): CFG-parallel and Ulysses with CUDA graphs over calls in a row, each
call's latents equal bit for bit to the same call on one GPU (parallel_gpu_worker.py). The combinations with
`parallel` that FastConfig refuses (FP8 attention or a step cache with Ulysses) say why: test_parallel.py and
test_fp8_attention.py test those refusals on the CPU."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qwen_image_fast.pipelines.core.model.fp8_attention import installed

WORKER = Path(__file__).parents[1] / "parallel_gpu_worker.py"


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["cfg", "ulysses", "cfg-fp8-attention", "cfg-step-cache"])
def test_two_gpus_equal_one_over_calls_in_a_row(tmp_path, mode):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs of one host")
    if mode == "cfg-fp8-attention" and not installed("cudnn"):
        pytest.skip("FP8 attention needs nvidia-cudnn-frontend")
    if mode == "ulysses" and importlib.util.find_spec("flash_attn") is None:
        pytest.skip("Ulysses is bit-equal to one GPU on FlashAttention-4 (flash-attn-4), not installed")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKER),
               str(tmp_path), mode]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0,1")})
    assert done.returncode == 0, done.stderr[-4000:]
    result = torch.load(tmp_path / "result.pt")
    assert result["graphs"] > 0, "no CUDA graph was kept"
    for i, (got, want, applied) in enumerate(zip(result["got"], result["want"], result["applied"])):
        assert "cuda_graphs" in applied and "parallel:" + ("ulysses2" if mode == "ulysses" else "cfg2") in applied, (
            i, applied)
        assert torch.equal(got, want), (mode, i, (got.float() - want.float()).abs().max().item())
    labels = {label.split(":")[0] for label in result["applied"][0]}
    if mode == "cfg-fp8-attention":
        assert "fp8_attention" in labels, result["applied"][0]
    if mode == "cfg-step-cache":
        assert "step_cache" in labels, result["applied"][0]
