import pytest
import torch
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformerBlock
from helpers import DEVICES, DTYPES, assert_close

from qwen_image_fast.kernels._utils import FP8_DTYPE
from qwen_image_fast.kernels.attn_split_fp8 import attn_split_fp8, attn_split_fp8_ref
from qwen_image_fast.kernels.fp8 import dequantize_fp8_rowwise, quantize_fp8_rowwise_ref

# e4m3 keeps 3 mantissa bits: a rounding error of at most 2^-4 relative, ~2.5% RMS on normal data.
FP8_TOL = 4e-2


def test_ref_splits_like_diffusers():
    """Our joint sequence is [image, text] (diffusers' is [text, image]): split at L_img, the first stream must be
    what diffusers' QwenDoubleStreamAttnProcessor2_0 feeds attn.to_out[0] (image), the second what it feeds
    attn.to_add_out (text), as rowwise-FP8 operands [B * len, H * Dh], batch-major."""
    torch.manual_seed(0)
    b, l_img, l_txt, heads, head_dim = 2, 5, 3, 3, 16  # 24 heads x 128 in the model
    d = heads * head_dim
    attn = QwenImageTransformerBlock(dim=d, num_attention_heads=heads, attention_head_dim=head_dim).attn
    seen = {}
    attn.to_out[0].register_forward_pre_hook(lambda m, args: seen.update(image=args[0]))  # [B, L_img, D]
    attn.to_add_out.register_forward_pre_hook(lambda m, args: seen.update(text=args[0]))  # [B, L_txt, D]
    with torch.no_grad():
        attn(hidden_states=torch.randn(b, l_img, d), encoder_hidden_states=torch.randn(b, l_txt, d))

    o = torch.cat([seen["image"], seen["text"]], dim=1).unflatten(-1, (heads, head_dim))  # ours: [B, S, H, Dh]
    q_img, s_img, q_txt, s_txt = attn_split_fp8_ref(o, l_img)
    pre_img, _, pre_txt, _ = attn_split_fp8_ref(o, l_img, torch.float32)
    for name, q, s, pre in (("image", q_img, s_img, pre_img), ("text", q_txt, s_txt, pre_txt)):
        rows = seen[name].reshape(-1, d)  # what diffusers' output projection got, [B * len, D]
        pre_expected, s_expected = quantize_fp8_rowwise_ref(rows, torch.float32)
        assert torch.equal(pre, pre_expected) and torch.equal(s, s_expected), f"{name}: pre-cast values, scales"
        assert_close(dequantize_fp8_rowwise(q, s), rows, FP8_TOL, f"{name}: dequantized")


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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("b,s,split,d", [(1, 1, 0, 48), (1, 2, 1, 48), (2, 37, 5, 123), (2, 5, 3, 3072),
                                         (3, 6, 6, (3, 16))])  # split = S; d as (heads, head_dim): [B, S, H, Dh]
def test_codes_with_one_scale_match_ref(device, b, s, split, d):
    """o as e4m3 codes with one scale (cuDNN's FP8 attention output): each stream's codes copied bit for bit,
    o_scale on every row."""
    o = (torch.randn(b, s, *((d,) if isinstance(d, int) else d), device=device) * 60).clamp(-448, 448).to(FP8_DTYPE)
    o_scale = torch.tensor([0.0371], device=device)
    out = attn_split_fp8(o, split, o_scale=o_scale)
    ref = attn_split_fp8_ref(o, split, o_scale=o_scale)
    for name, got, want in zip(("q1", "s1", "q2", "s2"), out, ref):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        assert torch.equal(got.view(torch.uint8) if got.dtype == FP8_DTYPE else got,
                           want.view(torch.uint8) if want.dtype == FP8_DTYPE else want), name
    assert (ref[1] == o_scale).all() and (ref[3] == o_scale).all()


def test_codes_refusals():
    o8 = torch.randn(1, 4, 16).to(FP8_DTYPE)
    with pytest.raises(ValueError, match="q_dtype=torch.float32 with o_scale"):
        attn_split_fp8(o8, 2, torch.float32, o_scale=torch.ones(1))
    with pytest.raises(ValueError, match="o has dtype torch.float32; allowed: torch.float8_e4m3fn"):
        attn_split_fp8(o8.float(), 2, o_scale=torch.ones(1))
    with pytest.raises(ValueError, match=r"o_scale must have shape \(1,\)"):
        attn_split_fp8(o8, 2, o_scale=torch.ones(2))


def test_rejects_bad_split():
    with pytest.raises(ValueError, match=r"split=10 must lie in \[0, S=9\]"):
        attn_split_fp8(torch.randn(1, 9, 16), 10)
