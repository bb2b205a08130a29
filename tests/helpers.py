"""Helpers shared by the tests (tests/ is on sys.path through pytest's rootdir conftest)."""

import torch

from qwen_image_fast.kernels._utils import rel_rms_error

# Scale-aware error bound (RMS of difference / RMS of reference) for a kernel against its reference.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
GPU = "cuda"


def device_for(marker: str) -> str:
    return "cuda" if marker == "gpu" else "cpu"


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str = ""):
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    assert torch.isfinite(out).all(), f"{what}: output has NaN/inf (an element left unwritten?)"
    err = rel_rms_error(out, ref)
    assert err <= tol, f"{what}: rel-RMS error {err:.3e} > {tol:.1e}"
