"""What each GPU generation runs (core/gpu_support.py), with its compute capability mocked: the table itself, and
the choices that consult it (FP8 GEMMs, attention "auto", FP8 attention, --dry-run's rows). Only sm_90 (H100,
H200) was measured; the other rows are the libraries' own capability checks, restated."""

from types import SimpleNamespace

import pytest
import torch

from qwen_image_fast.pipelines.core import gpu_support
from qwen_image_fast.pipelines.core.config import FastConfig
from qwen_image_fast.pipelines.core.model import attention, fp8_attention
from qwen_image_fast.pipelines.core.optimizations import plans

CUDA = torch.device("cuda", 0)

# capability: (FP8 GEMMs run, attention "auto" with FA4 installed, FP8 attention "auto" with its packages)
EXPECTED = {
    (7, 5): (False, "sdpa", None),
    (8, 0): (False, "cudnn", None),
    (8, 6): (False, "cudnn", None),
    (8, 9): (True, "cudnn", None),
    (9, 0): (True, "fa4", "cudnn"),
    (10, 0): (True, "fa4", None),
    (12, 0): (True, "cudnn", None),
}


@pytest.fixture
def gpu(monkeypatch):
    """Sets the mocked GPU's capability (and whether a rowwise _scaled_mm runs in this PyTorch build)."""

    def set_gpu(capability, probe_error=None):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        name = f"mocked sm_{capability[0]}{capability[1]}"
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        monkeypatch.setattr(gpu_support, "rowwise_fp8_error", lambda index: probe_error)

    monkeypatch.setattr(attention, "fa4_available", lambda: True)
    monkeypatch.setattr(fp8_attention, "installed", lambda kernel: True)
    return set_gpu


@pytest.mark.parametrize("capability", sorted(EXPECTED))
def test_each_gpu_generation_gets_what_it_can_run(gpu, capability):
    fp8, auto_attention, fp8_kernel = EXPECTED[capability]
    gpu(capability)
    assert (gpu_support.fp8_gemm_why_not(CUDA) is None) == fp8
    assert attention.resolve_backend("auto", CUDA, torch.bfloat16) == auto_attention
    kernel, why = fp8_attention.fp8_attention_kernel("auto", CUDA, torch.bfloat16)
    assert kernel == fp8_kernel and (why is None) == (fp8_kernel is not None)
    if not fp8:
        assert f"compute capability {capability[0]}.{capability[1]}" in gpu_support.fp8_gemm_why_not(CUDA)
    if fp8_kernel is None:
        assert why == f"runs on Hopper (compute capability 9.0) only; this GPU is {capability[0]}.{capability[1]}"
        with pytest.raises(ValueError, match="runs on Hopper"):
            fp8_attention.fp8_attention_kernel("cudnn", CUDA, torch.bfloat16)  # named: refused, never substituted


def test_a_pytorch_build_without_the_rowwise_kernel_runs_bf16_and_says_why(gpu):
    """sm_120's rowwise FP8 GEMM exists only in PyTorch builds with its sm_120a kernel: the probe's error decides."""
    gpu((12, 0), probe_error="Rowwise scaling is not currently supported on your device")
    why = gpu_support.fp8_gemm_why_not(CUDA)
    assert why == ("this PyTorch build has no rowwise FP8 GEMM for this GPU (Rowwise scaling is not currently "
                   "supported on your device); BF16 GEMMs run")


def test_named_attention_kernels_are_refused_below_their_floor(gpu):
    gpu((7, 5))
    for name in ("fa4", "cudnn"):
        with pytest.raises(ValueError, match=f"attention='{name}' needs compute capability 8.0 or newer, this GPU "
                                             "is 7.5"):
            attention.resolve_backend(name, CUDA, torch.bfloat16)
    gpu((12, 0))
    assert attention.resolve_backend("fa4", CUDA, torch.bfloat16) == "fa4"  # named: the user's choice, it exists


@pytest.mark.parametrize("capability", [(8, 0), (8, 9), (9, 0), (12, 0)])
def test_dry_run_names_what_runs_on_the_gpu_and_why_not(gpu, capability):
    from qwen_image_fast.cli.plan import command_facts, dry_run_report

    gpu(capability)
    config = FastConfig(fp8_attention="auto")
    labels = SimpleNamespace(model="Qwen/Qwen-Image-2512", enhancer=None, preset="fast")
    facts = command_facts(config, labels, "QwenImagePipeline", CUDA, None)
    planned = {opt.name: plan for opt, plan in plans(config, facts)}
    fp8, auto_attention, fp8_kernel = EXPECTED[capability]
    assert bool(planned["fp8"].values) == fp8 and planned["attention"].values == (auto_attention,)
    if not fp8:
        assert "no FP8 tensor cores" in planned["fp8"].why_not and "BF16 GEMMs run" in planned["fp8"].why_not
    assert planned["fp8_attention"].values == ((fp8_kernel,) if fp8_kernel else ())
    job = SimpleNamespace(cfg=4.0, negative_prompt=" ", width=1024, height=1024, steps=50)
    report = dry_run_report(config, labels, "QwenImagePipeline", CUDA, None, [job])
    name = f"sm_{capability[0]}{capability[1]}"
    measured = "measured on H100, H200" if capability == (9, 0) else "planned from the libraries' capability checks"
    assert f"GPU: mocked {name} ({name}): {measured}" in report


@pytest.mark.gpu
def test_the_probe_finds_the_rowwise_fp8_gemm_on_a_gpu_that_has_it():
    """The real probe on the GPU at hand: from 8.9 on, a PyTorch build with the kernel runs it (None), and the
    table's answer and the probe's agree; below 8.9 the table refuses without probing."""
    support = gpu_support.support_on(CUDA)
    if support.fp8_gemm_why is None:
        assert gpu_support.rowwise_fp8_error(0) is None
    assert gpu_support.fp8_gemm_why_not(CUDA) == support.fp8_gemm_why
