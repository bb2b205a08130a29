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


def ulp_error(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|out - ref| in units in the last place of ref's dtype, at ref's magnitude (fp64)."""
    mantissa = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}[ref.dtype]
    r = ref.double()
    exponent = torch.frexp(ref.float())[1]  # ref = f * 2**exponent, 0.5 <= |f| < 1
    ulp = torch.ldexp(torch.ones_like(r), exponent - 1 - mantissa).clamp_min(torch.finfo(ref.dtype).tiny)
    return (out.double() - r).abs() / ulp


def assert_nearly_exact(out: torch.Tensor, ref: torch.Tensor, what: str = "", max_ulp: float | None = 1.0,
                        max_frac: float = 1e-3):
    """Bit-equal except a few elements (max_frac) at most max_ulp away (None: no bound, for outputs where a flipped
    intermediate rounding meets cancellation): a kernel that rounds where the reference rounds, but whose fp32
    intermediates (exp, reductions) can differ by an ulp and flip a rounding."""
    assert out.shape == ref.shape and out.dtype == ref.dtype, (
        f"{what}: {tuple(out.shape)} {out.dtype} vs reference {tuple(ref.shape)} {ref.dtype}")
    assert torch.isfinite(out).all(), f"{what}: output has NaN/inf (an element left unwritten?)"
    err = ulp_error(out, ref)
    frac = (err > 0).double().mean().item()
    assert (max_ulp is None or err.max().item() <= max_ulp) and frac <= max_frac, (
        f"{what}: max {err.max().item():.2f} ulp (allowed {max_ulp}), "
        f"{frac:.2e} of elements differ (allowed {max_frac:.0e})")
