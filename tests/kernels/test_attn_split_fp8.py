import pytest
import torch
from helpers import DEVICES, DTYPES, TOL, assert_close

from qwen_image_fast.kernels.attn_split_fp8 import attn_split_fp8, attn_split_fp8_ref
from qwen_image_fast.kernels.fp8 import dequantize_fp8_rowwise



def test_ref_splits_like_diffusers():
    o = torch.randn(2, 9, 3, 16)  # [B, S, H, Dh] attention output, text rows first as diffusers concatenates
    q1, s1, q2, s2 = attn_split_fp8_ref(o, 4, torch.float32)
    joint = o.flatten(2, 3)
    assert_close(dequantize_fp8_rowwise(q1, s1), joint[:, :4].reshape(-1, 48), 1e-6, "text")
    assert_close(dequantize_fp8_rowwise(q2, s2), joint[:, 4:].reshape(-1, 48), 1e-6, "image")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,s,split,d", [(1, 1, 0, 48), (1, 2, 1, 48), (2, 37, 5, 123), (2, 5, 3, 3072)])
def test_kernel_matches_ref(device, dtype, b, s, split, d):
    o = torch.randn(b, s, d, device=device).to(dtype)
    out = attn_split_fp8(o, split, torch.float32)
    ref = attn_split_fp8_ref(o, split, torch.float32)
    for name, got, want in zip(("q1", "s1", "q2", "s2"), out, ref):
        assert got.shape == want.shape, name
        if got.numel():
            assert_close(got, want, TOL[dtype], name)
    if device == "cuda":
        q1, s1, q2, s2 = attn_split_fp8(o, split)
        if q2.numel():
            assert_close(dequantize_fp8_rowwise(q2, s2), o[:, split:].reshape(-1, d).float(), 4e-2, "e4m3")


def test_rejects_bad_split():
    with pytest.raises(ValueError, match=r"split=10 must lie in \[0, S=9\]"):
        attn_split_fp8(torch.randn(1, 9, 16), 10)
