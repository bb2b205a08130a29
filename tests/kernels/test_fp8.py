import pytest
import torch
from helpers import DEVICES, TOL, assert_close

from qwen_image_fast.kernels._utils import FP8_DTYPE, FP8_MAX
from qwen_image_fast.kernels.fp8 import (
    dequantize_fp8_rowwise,
    fp8_linear,
    fp8_linear_ref,
    quantize_fp8_rowwise,
    quantize_fp8_rowwise_ref,
)

# e4m3 keeps 3 mantissa bits: a rounding error of at most 2^-4 relative, ~2.5% RMS on normal data.
FP8_TOL = 4e-2


def test_ref_roundtrip_within_e4m3_precision():
    x = torch.randn(64, 300, dtype=torch.float64).float() * torch.logspace(-3, 3, 64)[:, None]
    q, s = quantize_fp8_rowwise_ref(x)
    assert q.dtype == FP8_DTYPE and s.shape == (64, 1)
    assert_close(dequantize_fp8_rowwise(q, s), x, FP8_TOL, "dequant(quant(x))")
    # each row's largest magnitude maps to +-448 (up to the fp32 rounding of amax / (amax / 448))
    pre, _ = quantize_fp8_rowwise_ref(x, torch.float32)
    torch.testing.assert_close(pre.abs().amax(-1), torch.full((64,), FP8_MAX), rtol=1e-6, atol=0)


def test_ref_zero_row_has_finite_scale():
    q, s = quantize_fp8_rowwise_ref(torch.zeros(2, 16))
    assert torch.isfinite(s).all() and (s > 0).all() and (q.float() == 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 48), (7, 123), (3, 3072)])
def test_quantize_kernel_matches_ref(device, dtype, shape):
    x = (torch.randn(shape, device=device) * 3).to(dtype)
    q, s = quantize_fp8_rowwise(x, torch.float32)
    q_ref, s_ref = quantize_fp8_rowwise_ref(x, torch.float32)
    # a row maximum, two IEEE divisions and one product per element: bit-equal on every device and dtype
    assert torch.equal(s, s_ref), "scale"
    assert torch.equal(q, q_ref), "pre-cast values"
    assert q.abs().max() <= FP8_MAX
    if device == "cuda":  # exact e4m3 codes only off the interpreter
        q8, s8 = quantize_fp8_rowwise(x)
        q8_ref, _ = quantize_fp8_rowwise_ref(x)
        assert torch.equal(q8.view(torch.uint8), q8_ref.view(torch.uint8))


@pytest.mark.parametrize("device", DEVICES)
def test_quantize_strided_rows_and_leading_dims(device):
    x = torch.randn(2, 5, 96, device=device)[..., :80]  # rows strided by 96
    q, s = quantize_fp8_rowwise(x, torch.float32)
    q_ref, s_ref = quantize_fp8_rowwise_ref(x, torch.float32)
    assert q.shape == (2, 5, 80) and s.shape == (2, 5, 1)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)


def test_quantize_rejects_bad_q_dtype():
    with pytest.raises(ValueError, match="q_dtype=torch.float16"):
        quantize_fp8_rowwise(torch.randn(2, 16), torch.float16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m", [1, 37])
def test_fp8_linear_matches_ref_and_nn_linear(device, m):
    torch.manual_seed(0)
    k, n = 96, 144
    lin = torch.nn.Linear(k, n).to(device=device, dtype=torch.bfloat16)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    x_q, x_s = quantize_fp8_rowwise(x)
    w_q, w_s = quantize_fp8_rowwise(lin.weight)
    out = fp8_linear(x_q, x_s, w_q, w_s.view(-1), lin.bias)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    assert_close(out, fp8_linear_ref(x_q, x_s, w_q, w_s.view(-1), lin.bias), TOL[torch.bfloat16], "vs ref")
    # against the upstream module: within the error FP8 operands introduce
    assert_close(out, lin(x), 2 * FP8_TOL, "vs nn.Linear")


@pytest.mark.gpu
def test_fp8_linear_fast_accum_at_every_row_count():
    """Short rows (a short prompt's unpadded text stream) at the model's K and N, fast accumulation asked for:
    cuBLASLt has no such kernel below ~64 rows at K=12288, so fp8_linear must not ask it there."""
    torch.manual_seed(0)
    for k, n in ((3072, 9216), (3072, 12288), (12288, 3072)):
        w_q, w_s = quantize_fp8_rowwise(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
        bias = torch.zeros(n, device="cuda", dtype=torch.bfloat16)
        for m in range(1, 130):
            x_q, x_s = quantize_fp8_rowwise(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
            out = fp8_linear(x_q, x_s, w_q, w_s.view(-1), bias, fast_accum=True)
            assert_close(out, fp8_linear_ref(x_q, x_s, w_q, w_s.view(-1), bias), 2e-2, f"K={k} N={n} M={m}")


def test_fp8_linear_validates():
    x_q = torch.zeros(4, 32, dtype=FP8_DTYPE)
    w_q = torch.zeros(16, 48, dtype=FP8_DTYPE)
    with pytest.raises(ValueError, match="in-features must equal x_q's K=32"):
        fp8_linear(x_q, torch.ones(4, 1), w_q, torch.ones(16))
    with pytest.raises(ValueError, match=r"x_scale must have shape \(4, 1\)"):
        fp8_linear(x_q, torch.ones(4), w_q[:, :32], torch.ones(16))
    with pytest.raises(ValueError, match="x_q has dtype torch.bfloat16"):
        fp8_linear(torch.zeros(4, 32, dtype=torch.bfloat16), torch.ones(4, 1), w_q[:, :32], torch.ones(16))
