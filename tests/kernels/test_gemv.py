import re

import pytest
import torch

from helpers import DEVICES, DTYPES, assert_close, assert_matches_ref
from qwen_image_fast.kernels.gemv import (
    gated_rms_norm_gemv,
    gated_rms_norm_gemv_ref,
    gemv,
    gemv_ref,
    silu_mul_gemv,
    silu_mul_gemv_ref,
)
from qwen_image_fast.kernels.rms_norm import gated_rms_norm
from qwen_image_fast.kernels.swiglu import silu_mul

DTYPE_IDS = [str(d).removeprefix("torch.") for d in DTYPES]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def check(out: torch.Tensor, ref: torch.Tensor, what: str):
    """fp32: summation order only (K products). bf16/fp16: an fp32 sum in another order, rounded once (round_to, exact
    under the interpreter too), so off by an ulp where the two sums straddle a rounding boundary (a few percent of
    the outputs at K=2500 in fp16), a few ulp where the sum cancels to a small value: a bounded fraction."""
    assert_matches_ref(out, ref, what, max_ulp=None, max_frac=5e-2, fp32_tol=5e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_ref_matches_linear(dtype):
    linear = torch.nn.Linear(300, 77, bias=False)
    x = torch.randn(1, 300)
    expected = linear.to(dtype)(x.to(dtype))
    check(gemv_ref(x.to(dtype), linear.weight), expected, f"gemv_ref vs nn.Linear {dtype}")


@pytest.mark.parametrize(
    "n, k, lead",
    [(1, 1, (1,)), (37, 100, (1,)), (16, 1024, (1, 1)), (50, 2500, (1,)), (300, 4096, (1, 1))],
    ids=["N1-K1", "N37-K100-tail", "N16-K1024-even", "N50-K2500-3-steps", "N300-K4096"],
)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("device", DEVICES)
def test_gemv_matches_ref(device, dtype, n, k, lead):
    x = torch.randn(*lead, k, device=device).to(dtype)
    weight = (torch.randn(n, k, device=device) / k**0.5).to(dtype)
    out = gemv(x, weight)
    assert out.shape == (*lead, n) and out.dtype == dtype
    check(out, gemv_ref(x, weight), f"gemv N={n} K={k} {dtype}")


@pytest.mark.parametrize("device", DEVICES)
def test_gemv_strided_weight_rows(device):
    # a weight that is a column slice of a wider matrix: rows start stride(0) apart, not K
    wide = torch.randn(45, 700, device=device).to(torch.bfloat16)
    weight = wide[:, 3:603]
    x = torch.randn(1, 600, device=device).to(torch.bfloat16)
    check(gemv(x, weight), gemv_ref(x, weight), "strided weight rows")


@pytest.mark.parametrize("n, k", [(37, 100), (50, 2500)], ids=["N37-K100-tail", "N50-K2500-3-steps"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("device", DEVICES)
def test_silu_mul_gemv_matches_ref(device, dtype, n, k):
    gate_up = (3 * torch.randn(1, 2 * k + 5, device=device)).to(dtype)[:, : 2 * k]  # a slice of a wider output
    weight = (torch.randn(n, k, device=device) / k**0.5).to(dtype)
    out = silu_mul_gemv(gate_up, weight)
    assert out.shape == (1, n) and out.dtype == dtype
    # its input is silu_mul's rounded output: the same GEMV over it, within the GEMV's own bound
    check(out, silu_mul_gemv_ref(gate_up, weight), f"silu_mul_gemv N={n} K={k} {dtype}")
    check(out, gemv(silu_mul(gate_up), weight), f"silu_mul_gemv vs gemv(silu_mul) N={n} K={k} {dtype}")


@pytest.mark.parametrize("n, hv, dv", [(37, 3, 16), (50, 20, 128)], ids=["N37-3x16-tail", "N50-20x128-3-steps"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("device", DEVICES)
def test_gated_rms_norm_gemv_matches_ref(device, dtype, n, hv, dv):
    k = hv * dv
    x = (2 * torch.randn(1, hv, dv, device=device)).to(dtype)
    gate = (3 * torch.randn(1, 2 * k, device=device)).to(dtype)[:, k:].view(1, hv, dv)  # a view, as z is
    norm_weight = (1 + 0.3 * torch.randn(dv, device=device)).to(dtype)
    weight = (torch.randn(n, k, device=device) / k**0.5).to(dtype)
    out = gated_rms_norm_gemv(x, gate, norm_weight, weight, 1e-6)
    assert out.shape == (1, n) and out.dtype == dtype
    check(out, gated_rms_norm_gemv_ref(x, gate, norm_weight, weight, 1e-6), f"gated_rms_norm_gemv {hv}x{dv} {dtype}")
    # its input is gated_rms_norm's output: the same GEMV over it. Not bf16 in the interpreter, whose bf16 cast
    # (gated_rms_norm's store) truncates where the fused prologue rounds
    if device == "cuda" or dtype != torch.bfloat16:
        check(out, gemv(gated_rms_norm(x, gate, norm_weight, 1e-6).flatten(-2), weight),
              f"vs gemv(gated_rms_norm) {dtype}")


# Qwen3.5-9B decode shapes: GDN in_proj, attention qkv, out/o_proj, gate_up, down, lm_head
@pytest.mark.parametrize("n, k", [(12352, 4096), (10240, 4096), (4096, 4096), (24576, 4096), (4096, 12288),
                                  (248320, 4096)])
@pytest.mark.gpu
def test_gemv_real_shapes_gpu(n, k):
    x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
    weight = (0.02 * torch.randn(n, k, device="cuda")).to(torch.bfloat16)
    out = gemv(x, weight)
    check(out, gemv_ref(x, weight), f"gemv N={n} K={k}")
    assert_close(out, torch.nn.functional.linear(x, weight), 1e-2, "gemv vs cuBLAS")


@pytest.mark.gpu
def test_gated_rms_norm_gemv_real_shape_gpu():
    # Qwen3.5-9B Gated-DeltaNet out_proj: 32 value heads x 128 -> 4096
    x = torch.randn(1, 32, 128, device="cuda").to(torch.bfloat16)
    gate = (3 * torch.randn(1, 2 * 4096, device="cuda")).to(torch.bfloat16)[:, 4096:].view(1, 32, 128)
    norm_weight = (1 + 0.3 * torch.randn(128, device="cuda")).to(torch.bfloat16)
    weight = (0.02 * torch.randn(4096, 4096, device="cuda")).to(torch.bfloat16)
    check(gated_rms_norm_gemv(x, gate, norm_weight, weight), gated_rms_norm_gemv_ref(x, gate, norm_weight, weight),
          "gated_rms_norm_gemv 9B out_proj")


@pytest.mark.gpu
def test_silu_mul_gemv_real_shape_gpu():
    gate_up = (3 * torch.randn(1, 2 * 12288, device="cuda")).to(torch.bfloat16)  # Qwen3.5-9B down_proj
    weight = (0.02 * torch.randn(4096, 12288, device="cuda")).to(torch.bfloat16)
    check(silu_mul_gemv(gate_up, weight), silu_mul_gemv_ref(gate_up, weight), "silu_mul_gemv 9B down")


def test_gemv_validation():
    x, weight = torch.randn(1, 8), torch.randn(5, 8)
    with pytest.raises(ValueError, match=re.escape("x must hold one row of K=8 (the weight's (5, 8) is [N, K]), "
                                                   "got shape (2, 8)")):
        gemv(torch.randn(2, 8), weight)
    with pytest.raises(ValueError, match=re.escape("x must hold one row of K=8")):
        gemv(torch.randn(1, 9), weight)
    with pytest.raises(ValueError, match="weight has dtype torch.bfloat16; allowed: torch.float32"):
        gemv(x, weight.bfloat16())
    with pytest.raises(ValueError, match="weight must be contiguous in its last dim"):
        gemv(x, torch.randn(8, 5).T)
    with pytest.raises(ValueError, match="weight must have 2 dims"):
        gemv(x, weight[None])
    with pytest.raises(ValueError, match=re.escape("gate_up must hold one row of 2K=16 (the weight's (5, 8) is "
                                                   "[N, K]), got shape (1, 8)")):
        silu_mul_gemv(x, weight)
    heads, gate, norm_weight = torch.randn(1, 2, 4), torch.randn(1, 2, 4), torch.ones(4)
    with pytest.raises(ValueError, match=re.escape("x must hold one row of K=8")):
        gated_rms_norm_gemv(torch.randn(2, 2, 4), torch.randn(2, 2, 4), norm_weight, weight)
    with pytest.raises(ValueError, match="x's head width 3 must be a power of two"):
        gated_rms_norm_gemv(torch.randn(1, 2, 3), torch.randn(1, 2, 3), torch.ones(3), torch.randn(5, 6))
    with pytest.raises(ValueError, match=re.escape("gate must have shape (1, 2, 4), got (1, 4, 2)")):
        gated_rms_norm_gemv(heads, gate.view(1, 4, 2), norm_weight, weight)
    with pytest.raises(ValueError, match="gate's heads packed"):
        gated_rms_norm_gemv(heads, torch.randn(1, 2, 8)[..., :4], norm_weight, weight)
