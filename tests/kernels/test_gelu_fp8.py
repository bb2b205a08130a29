import pytest
import torch
from diffusers.models.attention import FeedForward
from helpers import DEVICES, DTYPES, TOL, assert_close

from qwen_image_fast.kernels.gelu_fp8 import gelu_fp8, gelu_fp8_ref
from qwen_image_fast.kernels.fp8 import quantize_fp8_rowwise_ref



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ref_matches_diffusers_feedforward_activation(dtype):
    ff = FeedForward(dim=48, dim_out=48, activation_fn="gelu-approximate").to(dtype)
    x = torch.randn(2, 7, 48, dtype=dtype)
    hidden = ff.net[0](x)  # GELU module: proj then tanh-GELU, in x's dtype
    q, s = gelu_fp8_ref(ff.net[0].proj(x).reshape(-1, 192), torch.float32)
    assert torch.equal(q, quantize_fp8_rowwise_ref(hidden.reshape(-1, 192), torch.float32)[0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 192), (5, 123), (2, 12288)])  # 12288: the DiT MLP hidden
def test_kernel_matches_ref(device, dtype, shape):
    h = (torch.randn(shape, device=device) * 3).to(dtype)
    q, s = gelu_fp8(h, torch.float32)
    q_ref, s_ref = gelu_fp8_ref(h, torch.float32)
    assert_close(s, s_ref, TOL[dtype], "scale")
    assert_close(q, q_ref, TOL[dtype], "pre-cast values")
    if device == "cuda":
        q8, s8 = gelu_fp8(h)
        assert_close(q8.float() * s8, q_ref * s_ref, 4e-2, "dequantized e4m3")


def test_large_inputs_stay_finite():
    h = torch.tensor([[-1e4, -50.0, -1e-3, 0.0, 1e-3, 50.0, 1e4, 3.0]])
    q, s = gelu_fp8(h, torch.float32)
    q_ref, s_ref = gelu_fp8_ref(h, torch.float32)
    assert_close(q * s, q_ref * s_ref, 1e-6)


def test_rejects_1d():
    with pytest.raises(ValueError, match="h must have 2 dims"):
        gelu_fp8(torch.randn(16))
