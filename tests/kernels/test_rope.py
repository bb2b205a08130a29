import pytest
import torch
from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope, apply_rotary_emb_qwen
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding, apply_rotary_pos_emb

from helpers import DEVICES, DTYPES, TOL, assert_close
from qwen_image_fast.kernels.rope import rope_qwen_image, rope_qwen_image_ref, rope_rotate_half, rope_rotate_half_ref



def qwen_image_freqs(axes_dim, frame_hw, txt_len, device):
    """Complex (image, text) tables [L, D // 2] from diffusers' QwenEmbedRope, as the transformer builds them."""
    rope = QwenEmbedRope(theta=10000, axes_dim=list(axes_dim), scale_rope=True)
    return rope([frame_hw], device=torch.device(device), max_txt_seq_len=txt_len)


def rotate_half_tables(b, s, r, dtype, device):
    """Random angles -> cos, sin [B, S, R] in dtype, duplicated halves like Qwen3.5's tables."""
    angles = torch.rand(b, s, r // 2, device=device) * 6.0
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("axes_dim", [(8, 4, 4), (16, 56, 56)])  # (16, 56, 56): Qwen-Image, D=128
def test_rope_qwen_image_ref_matches_diffusers(axes_dim, dtype, device):
    img_freqs, txt_freqs = qwen_image_freqs(axes_dim, (1, 4, 6), 7, device)
    for freqs in (img_freqs, txt_freqs):  # txt_freqs is a row slice of the table
        x = torch.randn(2, freqs.shape[0], 3, sum(axes_dim), device=device).to(dtype)
        expected = apply_rotary_emb_qwen(x, freqs, use_real=False)
        assert torch.equal(rope_qwen_image_ref(x, torch.view_as_real(freqs)), expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "b, h, axes_dim, strided",
    [
        (1, 1, (8, 4, 4), False),  # one token, one head
        (2, 3, (8, 4, 4), True),  # x a strided view, as a slice of a fused qkv
        (1, 3, (8, 8, 8), False),  # D=24: masked tail of the [BLOCK_H, 32] tile
        (1, 24, (16, 56, 56), False),  # Qwen-Image: H=24, D=128, three head blocks
    ],
)
def test_rope_qwen_image_matches_ref(b, h, axes_dim, strided, dtype, device):
    frame_hw = (1, 1, 1) if h == 1 else (1, 2, 3) if device == "cpu" else (1, 32, 40)
    img_freqs, txt_freqs = qwen_image_freqs(axes_dim, frame_hw, 5, device)
    for freqs in (torch.view_as_real(img_freqs), torch.view_as_real(txt_freqs)):
        x = torch.randn(b, freqs.shape[0], 2, h, sum(axes_dim), device=device).to(dtype)[:, :, 1]
        x = x if strided else x.contiguous()
        out = rope_qwen_image(x, freqs)
        assert out.is_contiguous()
        assert_close(out, rope_qwen_image_ref(x, freqs), TOL[dtype], f"rope_qwen_image {tuple(x.shape)} {dtype}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 256])  # 256: Qwen3.5, rotary dim R=64
def test_rope_rotate_half_ref_matches_transformers(head_dim, dtype, device):
    config = Qwen3_5TextConfig(hidden_size=64, num_attention_heads=2, head_dim=head_dim)  # partial_rotary_factor 0.25
    rotary = Qwen3_5TextRotaryEmbedding(config).to(device)
    b, s, h = 2, 5, 2
    q = torch.randn(b, s, h, head_dim, device=device).to(dtype)
    k = torch.randn(b, s, h, head_dim, device=device).to(dtype)
    position_ids = torch.arange(s, device=device)[None, None].expand(3, b, s)  # text: same position on all 3 axes
    cos, sin = rotary(q, position_ids)  # [B, S, R] in q's dtype
    assert cos.shape == (b, s, head_dim // 4) and cos.dtype == dtype
    q_embed, k_embed = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # [B, H, S, D]
    assert torch.equal(rope_rotate_half_ref(q, cos, sin), q_embed.transpose(1, 2))
    assert torch.equal(rope_rotate_half_ref(k, cos, sin), k_embed.transpose(1, 2))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "b, s, h, d, r",
    [
        (1, 1, 1, 16, 16),  # one token, full rotation
        (2, 3, 3, 32, 8),
        (1, 2, 3, 48, 24),  # D=48, R=24: masked tails of both tiles
        (1, 3, 10, 256, 64),  # Qwen3.5 head: D=256, R=64; two head blocks, the second masked
    ],
)
def test_rope_rotate_half_matches_ref(b, s, h, d, r, dtype, device):
    s = s if device == "cpu" else 64 * s
    x = torch.randn(b, s, 2, h, d, device=device).to(dtype)[:, :, 1]  # strided rows
    cos, sin = rotate_half_tables(b, s, r, dtype, device)
    out = rope_rotate_half(x, cos, sin)
    ref = rope_rotate_half_ref(x.float(), cos.float(), sin.float())  # rounding once, as the kernel does
    assert_close(out, ref.to(dtype), TOL[dtype], f"rope_rotate_half {(b, s, h, d, r)} {dtype}")
    assert_close(out, rope_rotate_half_ref(x, cos, sin), TOL[dtype], "vs the in-dtype reference")
    assert torch.equal(out[..., r:], x[..., r:])


@pytest.mark.parametrize("device", DEVICES)
def test_rope_rotate_half_batch_broadcast_tables(device):
    x = torch.randn(3, 4, 2, 32, device=device)
    cos, sin = rotate_half_tables(1, 4, 16, torch.float32, device)
    cos, sin = cos.expand(3, -1, -1), sin.expand(3, -1, -1)  # stride 0 over the batch
    assert_close(rope_rotate_half(x, cos, sin), rope_rotate_half_ref(x, cos, sin), TOL[torch.float32])


def test_rope_validation():
    x = torch.randn(1, 4, 2, 16)
    with pytest.raises(ValueError, match=r"D=15"):
        rope_qwen_image(torch.randn(1, 4, 2, 15), torch.randn(4, 7, 2))
    with pytest.raises(ValueError, match=r"freqs must have shape \(4, 8, 2\), got \(5, 8, 2\)"):
        rope_qwen_image(x, torch.randn(5, 8, 2))
    with pytest.raises(ValueError, match=r"freqs has dtype torch.float16"):
        rope_qwen_image(x, torch.randn(4, 8, 2, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"cos has shape \(1, 4, 18\)"):
        rope_rotate_half(x, torch.randn(1, 4, 18), torch.randn(1, 4, 18))
    with pytest.raises(ValueError, match=r"cos has shape \(1, 4, 7\)"):
        rope_rotate_half(x, torch.randn(1, 4, 7), torch.randn(1, 4, 7))
    with pytest.raises(ValueError, match=r"cos has dtype torch.float16"):
        rope_rotate_half(x, torch.randn(1, 4, 8, dtype=torch.float16), torch.randn(1, 4, 8))
