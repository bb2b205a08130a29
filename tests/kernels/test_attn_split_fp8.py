import pytest
import torch
from helpers import DEVICES, DTYPES, assert_close

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
    for name, got, want in zip(("q1", "s1", "q2", "s2"), out, ref):  # a copy and a row quantization: bit-equal
        assert got.shape == want.shape and torch.equal(got, want), name
    if device == "cuda":  # e4m3 codes only off the interpreter
        q1, s1, q2, s2 = attn_split_fp8(o, split)
        q1_ref, s1_ref, q2_ref, s2_ref = attn_split_fp8_ref(o, split)
        assert torch.equal(q1.view(torch.uint8), q1_ref.view(torch.uint8)) and torch.equal(s1, s1_ref), "e4m3 first"
        assert torch.equal(q2.view(torch.uint8), q2_ref.view(torch.uint8)) and torch.equal(s2, s2_ref), "e4m3 second"


def test_rejects_bad_split():
    with pytest.raises(ValueError, match=r"split=10 must lie in \[0, S=9\]"):
        attn_split_fp8(torch.randn(1, 9, 16), 10)
