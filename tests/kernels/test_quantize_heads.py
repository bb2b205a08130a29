"""quantize_fp8_heads: attention's V as FP8 per (sample, head) or per tensor, its amax over each sample's valid
rows; the kernel against its reference (scales bit-equal, the values before the cast bit-equal, e4m3 codes on a
GPU), on awkward shapes, outputs poisoned with NaN first (conftest)."""

import pytest
import torch
from helpers import DEVICES, assert_close

from qwen_image_fast.kernels._utils import FP8_AMAX_EPS, FP8_DTYPE, FP8_MAX
from qwen_image_fast.kernels.quantize_heads import CHUNK_ROWS, quantize_fp8_heads, quantize_fp8_heads_ref

FP8_TOL = 4e-2  # e4m3's 3 mantissa bits: ~2.5% RMS on normal data


@pytest.mark.parametrize("per_tensor", [False, True])
def test_ref_roundtrip_and_padded_rows_not_measured(per_tensor):
    """Dequantized counted rows come back within e4m3's precision; a huge value in a row past valid[b] changes
    no scale; each head's (or the tensor's) largest counted magnitude maps to 448."""
    x = torch.randn(2, 40, 3, 16) * torch.tensor([0.01, 1.0, 30.0])[None, None, :, None]
    valid = torch.tensor([40, 25], dtype=torch.int32)
    q, scales = quantize_fp8_heads_ref(x, valid, per_tensor)
    assert q.dtype == FP8_DTYPE and scales.shape == (2, 3)
    assert_close((q.float() * scales[:, None, :, None])[0], x[0], FP8_TOL, "dequant(quant(x))")
    spiked = x.clone()
    spiked[1, 30] = 1e4
    assert torch.equal(quantize_fp8_heads_ref(spiked, valid, per_tensor)[1], scales)
    pre, _ = quantize_fp8_heads_ref(x, valid, per_tensor, torch.float32)
    top = torch.stack([pre[0].abs().amax(dim=(0, 2)), pre[1, :25].abs().amax(dim=(0, 2))])  # counted rows, [B, H]
    if per_tensor:
        torch.testing.assert_close(top.max(), torch.tensor(FP8_MAX), rtol=1e-6, atol=0)
        assert (scales == scales[0, 0]).all()
    else:
        torch.testing.assert_close(top, torch.full((2, 3), FP8_MAX), rtol=1e-6, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_tensor", [False, True])
@pytest.mark.parametrize("b, s, h, d, valid", [
    (1, 1, 1, 16, (1,)),  # one row
    (2, 2 * CHUNK_ROWS + 37, 3, 24, (2 * CHUNK_ROWS + 37, 5)),  # several chunks and a ragged one; D=24 masked tail
    (2, 45, 24, 128, (0, 45)),  # Qwen-Image's heads; a sample with no valid row (scale from eps)
])
def test_kernel_matches_ref(device, dtype, per_tensor, b, s, h, d, valid):
    x = (torch.randn(b, s, h, d, device=device) * torch.logspace(-2, 2, h, device=device)[:, None]).to(dtype)
    valid = torch.tensor(valid, dtype=torch.int32, device=device)
    q, scales = quantize_fp8_heads(x, valid, per_tensor, torch.float32)
    q_ref, scales_ref = quantize_fp8_heads_ref(x, valid, per_tensor, torch.float32)
    # a maximum, IEEE divisions and one product per element: bit-equal on every device
    assert torch.equal(scales, scales_ref), (scales, scales_ref)
    assert torch.equal(q, q_ref)
    assert q.abs().max() <= FP8_MAX
    if not per_tensor:  # a sample without a valid row: the scale of an all-zero head
        assert (scales[valid == 0] == torch.tensor(FP8_AMAX_EPS) / FP8_MAX).all()
    if device == "cuda":  # e4m3 codes only off the interpreter
        q8, _ = quantize_fp8_heads(x, valid, per_tensor)
        q8_ref, _ = quantize_fp8_heads_ref(x, valid, per_tensor)
        assert torch.equal(q8.view(torch.uint8), q8_ref.view(torch.uint8))


def test_validation():
    x = torch.randn(2, 4, 3, 16)
    valid = torch.tensor([4, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"valid has dtype torch.int64"):
        quantize_fp8_heads(x, valid.long(), False)
    with pytest.raises(ValueError, match=r"valid must have shape \(2,\), got \(3,\)"):
        quantize_fp8_heads(x, torch.zeros(3, dtype=torch.int32), False)
    with pytest.raises(ValueError, match="x must be contiguous"):
        quantize_fp8_heads(x.transpose(1, 2), valid, False)
    with pytest.raises(TypeError, match="per_tensor must be a bool"):
        quantize_fp8_heads(x, valid, "yes")
    with pytest.raises(ValueError, match="q_dtype"):
        quantize_fp8_heads(x, valid, False, torch.bfloat16)
