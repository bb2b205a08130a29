"""Helpers shared by the tests (tests/ is on sys.path through pytest's rootdir conftest)."""

import os

import pytest
import torch

from qwen_image_fast.kernels._utils import rel_rms_error

# Scale-aware error bound (RMS of difference / RMS of reference) for a kernel against its reference.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Kernel tests run on the CPU under Triton's interpreter (conftest turns it on when there is no GPU) and on CUDA.
# On a GPU machine the interpreter is off, so Triton cannot launch on CPU tensors: the CPU cases skip there.
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                                 reason="Triton interpreter off (GPU machine)")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str = ""):
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    assert torch.isfinite(out).all(), f"{what}: output has NaN/inf (an element left unwritten?)"
    err = rel_rms_error(out, ref)
    assert err <= tol, f"{what}: rel-RMS error {err:.3e} > {tol:.1e}"
