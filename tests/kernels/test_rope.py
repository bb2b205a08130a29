import pytest
import torch
from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope, apply_rotary_emb_qwen
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding, apply_rotary_pos_emb

from helpers import DEVICES, DTYPES
from qwen_image_fast.kernels.rope import rope_qwen_image_ref, rope_rotate_half_ref

# The RoPE tiles have no launcher of their own: test_qkv_pack.py (interleaved) and test_qk_norm_rope.py
# (rotate-half) check them through the fused kernels. Here: each reference against the upstream function.


def qwen_image_freqs(axes_dim, frame_hw, txt_len, device):
    """Complex (image, text) tables [L, D // 2] from diffusers' QwenEmbedRope, as the transformer builds them."""
    rope = QwenEmbedRope(theta=10000, axes_dim=list(axes_dim), scale_rope=True)
    return rope([frame_hw], device=torch.device(device), max_txt_seq_len=txt_len)


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
