import re

import pytest
import torch
from diffusers.models.activations import get_activation
from diffusers.models.autoencoders.autoencoder_kl_qwenimage import QwenImageRMS_norm

from helpers import DEVICES, DTYPES, assert_matches_ref
from qwen_image_fast.kernels.channel_norm import BLOCK_C, BLOCK_P, channel_norm, channel_norm_ref

DTYPE_IDS = [str(d).removeprefix("torch.") for d in DTYPES]
# FLIPS: the sum of squares (fp32, in another order than torch's) can differ in its last bit, and then the division
# rounds a few elements the other way (one ulp of n); SiLU's slope at negative inputs (d ln silu / d ln y ~ y for
# y << 0) multiplies that relative step, so no ulp bound holds: a fraction of the elements and the rel-RMS do.


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def norm_module(c: int, bias: bool, dtype, images: bool = True) -> QwenImageRMS_norm:
    """images=False: the decoder's norms (on [B, C, T, H, W]); True: the attention block's (on [B, C, H, W])."""
    norm = QwenImageRMS_norm(c, channel_first=True, images=images, bias=bias).to(dtype)
    with torch.no_grad():
        norm.gamma.copy_(1 + 0.5 * torch.randn(norm.gamma.shape))
        if bias:
            norm.bias.copy_(0.3 * torch.randn(norm.bias.shape))
    return norm


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_ref_matches_the_decoders_norm_and_silu(dtype, bias):
    """The VAE decoder's `nonlinearity(norm(x))` (diffusers' QwenImageResidualBlock, norm_out: images=False, one
    frame of [B, C, T, H, W]), and the 2D form, bit for bit."""
    silu = get_activation("silu")
    x = (3 * torch.randn(2, 24, 5, 7)).to(dtype)  # 96 .. 384 channels
    with torch.no_grad():
        norm = norm_module(24, bias, dtype, images=False)
        frame = silu(norm(x.unsqueeze(2))).squeeze(2)
        assert torch.equal(channel_norm_ref(x, norm.gamma, norm.scale, norm.bias, silu=True), frame)
        norm = norm_module(24, bias, dtype)
        assert torch.equal(channel_norm_ref(x, norm.gamma, norm.scale, norm.bias), norm(x))
        assert torch.equal(channel_norm_ref(x, norm.gamma, norm.scale, norm.bias, silu=True), silu(norm(x)))


@pytest.mark.parametrize("b, c, h, w", [(1, 3, 4, 5), (2, 17, 9, 11), (1, 40, 23, 29)],
                         ids=["C3", "C17-two-channel-loads", "C40-three-pixel-blocks"])
@pytest.mark.parametrize("bias, silu", [(False, True), (True, False), (True, True)], ids=["silu", "bias", "both"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("device", DEVICES)
def test_channel_norm_matches_ref(device, dtype, bias, silu, b, c, h, w):
    assert c <= 3 * BLOCK_C and h * w <= 3 * BLOCK_P or device == "cuda"
    norm = norm_module(c, bias, dtype).to(device)
    x = (3 * torch.randn(b, c, h, w, device=device)).to(dtype)
    x[0, :, 0, 0] = 0  # a pixel of zeros: the norm's eps, n = 0
    out = channel_norm(x, norm.gamma.detach(), norm.scale, norm.bias if bias else 0.0, silu=silu)
    ref = channel_norm_ref(x, norm.gamma.detach(), norm.scale, norm.bias.detach() if bias else 0.0, silu=silu)
    assert out.shape == x.shape and out.is_contiguous()
    # FLIPS: the division and silu round once each (exactly, also under the interpreter)
    assert_matches_ref(out, ref, f"channel_norm {b}x{c}x{h}x{w}", max_ulp=None, max_frac=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("c, size", [(384, 128), (192, 512), (96, 1024)])
def test_channel_norm_real_shapes_gpu(c, size):
    """The decoder's widths at 1024^2: 384 channels at 128^2 .. 96 at 1024^2."""
    norm = norm_module(c, False, torch.bfloat16).cuda()
    x = (3 * torch.randn(1, c, size, size, device="cuda")).to(torch.bfloat16)
    out = channel_norm(x, norm.gamma.detach(), norm.scale, silu=True)
    # FLIPS (measured on an H100: 1e-5 to 1e-4 of the elements, up to 5 ulp after SiLU)
    assert_matches_ref(out, channel_norm_ref(x, norm.gamma.detach(), norm.scale, silu=True), f"C={c}",
                       max_ulp=None, max_frac=1e-3)


def test_channel_norm_validation():
    x = torch.randn(1, 4, 3, 3)
    gamma = torch.ones(4)
    with pytest.raises(ValueError, match=re.escape("x must be contiguous [B, C, H, W]")):
        channel_norm(torch.randn(1, 8, 3, 3)[:, ::2], gamma, 2.0)
    with pytest.raises(ValueError, match=re.escape("x must have 4 dims, got shape (4, 3, 3)")):
        channel_norm(x[0], gamma, 2.0)
    with pytest.raises(ValueError, match=re.escape("gamma must have shape (4,), got (3,)")):
        channel_norm(x, torch.ones(3), 2.0)
    with pytest.raises(ValueError, match=re.escape("bias=0.5; allowed: a tensor [C] or 0.0")):
        channel_norm(x, gamma, 2.0, 0.5)
