import pytest
import torch
from diffusers.models.attention import FeedForward
from helpers import (
    DEVICES,
    DTYPES,
    assert_close,
    assert_e4m3_codes_match,
    assert_fp8_precast_matches_ref,
    fp8_activations,
    ulp_error,
)

from qwen_image_fast.kernels.fp8 import quantize_fp8_rowwise_ref
from qwen_image_fast.kernels.gelu_fp8 import SQRT_2_OVER_PI, gelu_fp8, gelu_fp8_ref


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def gelu_exact(h: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(h) in fp64, in the form h * sigmoid(2u), which does not cancel for negative h."""
    hd = h.double()
    return hd * torch.sigmoid(2.0 * SQRT_2_OVER_PI * (hd + 0.044715 * hd**3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ref_matches_diffusers_feedforward_activation(dtype):
    ff = FeedForward(dim=48, dim_out=48, activation_fn="gelu-approximate").to(dtype)
    x = torch.randn(2, 7, 48, dtype=dtype)
    hidden = ff.net[0](x)  # GELU module: proj then tanh-GELU, in x's dtype
    q, s = gelu_fp8_ref(ff.net[0].proj(x).reshape(-1, 192), torch.float32)
    assert torch.equal(q, quantize_fp8_rowwise_ref(hidden.reshape(-1, 192), torch.float32)[0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
# 12288: the DiT MLP hidden, 3 chunks of 4096; 9000: 3 chunks, the last ragged; 16000: 4, the last ragged; 9 rows:
# several programs of chunked rows under the interpreter too (4 rows a program there), the last one partial
@pytest.mark.parametrize("shape", [(1, 192), (5, 123), (2, 12288), (3, 9000), (9, 9000), (2, 16000)])
@pytest.mark.parametrize("strided", [False, True], ids=["packed", "strided"])
def test_kernel_matches_ref(device, dtype, shape, strided):
    h = (torch.randn(shape[0], shape[1] + (7 if strided else 0), device=device) * 3).to(dtype)[:, : shape[1]]
    q, s = gelu_fp8(h, torch.float32)
    q_ref, s_ref = gelu_fp8_ref(h, torch.float32)
    # Upstream's 0.5 h (1 + tanh(u)) cancels for negative h (1 + tanh(u) is 0.3 at h = -1, 0.04 at -2: its fp32
    # value is off by many ulps of the dtype further out); the kernel's h * sigmoid(2u) does not. For h >= -1 nearly
    # exact (GPU: approximate exp and division); below, at least as close to the exact value as upstream, within an
    # ulp.
    calm = h.float() >= -1.0
    assert_fp8_precast_matches_ref(q, s, q_ref, s_ref, dtype, f"{shape} {dtype}", where=calm, max_ulp=1.0,
                                   max_frac=1e-3, gpu=(1.0, 1e-2))
    if dtype != torch.float32:
        y, y_ref, exact = fp8_activations(q, s, dtype), fp8_activations(q_ref, s_ref, dtype), gelu_exact(h).to(dtype)
        worse = (ulp_error(y, exact) > ulp_error(y_ref, exact) + 1) & ~calm
        assert not worse.any(), f"h < -1: {worse.sum().item()} activations further from exact than upstream's"
    if device == "cuda":  # e4m3 codes only off the interpreter; a flipped activation rarely moves its code
        q8, q8_ref = gelu_fp8(h)[0], gelu_fp8_ref(h)[0]
        assert_e4m3_codes_match(q8, q8_ref, "e4m3")


def test_large_inputs_stay_finite():
    h = torch.tensor([[-1e4, -50.0, -1e-3, 0.0, 1e-3, 50.0, 1e4, 3.0]])
    q, s = gelu_fp8(h, torch.float32)
    q_ref, s_ref = gelu_fp8_ref(h, torch.float32)
    assert_close(q * s, q_ref * s_ref, 1e-6)


def test_no_columns_refused():
    """A row of no columns has no FP8 scale (upstream's amax of nothing raises too)."""
    with pytest.raises(ValueError, match=r"h has shape \(3, 0\): a row needs at least one column"):
        gelu_fp8(torch.randn(3, 0))
    assert gelu_fp8(torch.randn(0, 5))[0].shape == (0, 5)


def test_rejects_1d():
    with pytest.raises(ValueError, match="h must have 2 dims"):
        gelu_fp8(torch.randn(16))


@pytest.mark.parametrize("n", [9000, 12288, 16000])
def test_row_amax_spans_every_chunk(n):
    """Row i's largest activation sits in chunk i (rows wider than 8192 run as up to four 4096-column chunks): a
    scale taken from fewer chunks clips it."""
    h = torch.randn(4, n)
    for i, col in enumerate([5, 4100, 8200, n - 1]):
        h[i, col] = 9.0
    q, s = gelu_fp8(h, torch.float32)
    q_ref, s_ref = gelu_fp8_ref(h, torch.float32)
    assert_close(s, s_ref, 1e-6)
    assert_close(q * s, q_ref * s_ref, 1e-5)
