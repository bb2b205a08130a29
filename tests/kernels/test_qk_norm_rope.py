import re

import pytest
import torch
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    Qwen3_5RMSNorm,
    Qwen3_5TextRotaryEmbedding,
    apply_rotary_pos_emb,
)

from helpers import DEVICES, DTYPES, assert_matches_ref
from qwen_image_fast.kernels.qk_norm_rope import rms_norm_rope, rms_norm_rope_ref

DTYPE_IDS = [str(d).removeprefix("torch.") for d in DTYPES]
EPS = 1e-6


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def rope_tables(b, s, r, dtype, device):
    """Random angles -> cos, sin [B, S, R] in dtype. Each half its own angles: Qwen3.5's tables repeat theirs, but
    the kernel takes any table, and a kernel reading one half for the other must show here."""
    angles = torch.rand(b, s, r, device=device) * 6.0
    return angles.cos().to(dtype), angles.sin().to(dtype)


def packed_q(b, s, h, d, dtype, device):
    """q as Qwen3.5's attention gets it: the first half of each head of the q_proj output [B, S, H, 2D]."""
    return (2 * torch.randn(b, s, h, 2 * d, device=device)).to(dtype)[..., :d]


def zero_centred_weight(d, dtype, device):
    return (0.5 * torch.randn(d, device=device)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("head_dim", [32, 256])  # 256: Qwen3.5, rotary dim R = 64
def test_ref_matches_qwen35_attention_norm_and_rope(head_dim, dtype):
    config = Qwen3_5TextConfig(hidden_size=64, num_attention_heads=2, head_dim=head_dim)  # partial_rotary_factor 0.25
    rotary = Qwen3_5TextRotaryEmbedding(config)
    b, s, h = 2, 5, 3
    q = packed_q(b, s, h, head_dim, dtype, "cpu")
    k = (2 * torch.randn(b, s, h, head_dim)).to(dtype)
    position_ids = (torch.arange(s) + 7)[None, None].expand(3, b, s)  # text: the same position on all 3 axes
    cos, sin = rotary(q, position_ids)  # [B, S, R] in q's dtype
    assert cos.shape == (b, s, head_dim // 4) and cos.dtype == dtype
    q_norm, k_norm = Qwen3_5RMSNorm(head_dim, eps=EPS), Qwen3_5RMSNorm(head_dim, eps=EPS)
    with torch.no_grad():
        q_norm.weight.copy_(zero_centred_weight(head_dim, torch.float32, "cpu"))
        k_norm.weight.copy_(zero_centred_weight(head_dim, torch.float32, "cpu"))
    q_norm, k_norm = q_norm.to(dtype), k_norm.to(dtype)
    # Qwen3_5Attention.forward: norm on [B, S, H, D], transpose to [B, H, S, D], rotate
    q_embed, k_embed = apply_rotary_pos_emb(q_norm(q).transpose(1, 2), k_norm(k).transpose(1, 2), cos, sin)
    assert torch.equal(rms_norm_rope_ref(q, q_norm.weight, cos, sin, EPS), q_embed.transpose(1, 2))
    assert torch.equal(rms_norm_rope_ref(k, k_norm.weight, cos, sin, EPS), k_embed.transpose(1, 2))


SHAPES = [
    (1, 1, 1, 16, 16),  # decode step, one head, full rotation
    (2, 3, 3, 32, 8),  # odd H
    (1, 2, 5, 48, 24),  # D=48, R=24: masked tails of every tile
    (1, 2, 10, 256, 64),  # Qwen3.5 head (D=256, R=64); two head blocks, the second masked
]


@pytest.mark.parametrize("w_fp32", [False, True], ids=["w-x-dtype", "w-fp32"])
@pytest.mark.parametrize("b, s, h, d, r", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("device", DEVICES)
def test_rms_norm_rope_matches_ref(device, dtype, b, s, h, d, r, w_fp32):
    x = packed_q(b, s, h, d, dtype, device)
    w = zero_centred_weight(d, torch.float32 if w_fp32 else dtype, device)
    cos, sin = rope_tables(b, s, r, dtype, device)
    out = rms_norm_rope(x, w, cos, sin, EPS)
    assert out.is_contiguous()
    ref = rms_norm_rope_ref(x, w, cos, sin, EPS)
    # Rounded where upstream rounds (the norm's output, each RoPE product, the sum). rstd's sum runs in another order
    # (on the GPU also through an approximate rsqrt), so a normed value can round the other way, and the RoPE sum can
    # cancel that ulp into several. The last step is a plain cast: under the interpreter bf16 truncates there.
    assert_matches_ref(out, ref, f"rms_norm_rope {(b, s, h, d, r)}", max_ulp=None, max_frac=2e-3, gpu=(None, 1e-2),
                       truncating_store=True)


@pytest.mark.parametrize("device", DEVICES)
def test_rms_norm_rope_broadcast_tables(device):
    x = torch.randn(3, 4, 2, 32, device=device)
    cos, sin = rope_tables(1, 4, 16, torch.float32, device)
    cos, sin = cos.expand(3, -1, -1), sin.expand(3, -1, -1)  # stride 0 over the batch
    w = zero_centred_weight(32, torch.float32, device)
    assert_matches_ref(rms_norm_rope(x, w, cos, sin), rms_norm_rope_ref(x, w, cos, sin), "broadcast tables")


# Qwen3.5-9B attention: 16 q heads, 4 kv heads, D=256, R=64; decode (S=1, batch 8) and a 2k-token prefill.
@pytest.mark.parametrize("b, s", [(8, 1), (1, 2048)])
@pytest.mark.parametrize("h", [16, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.gpu
def test_rms_norm_rope_real_shapes_gpu(dtype, h, b, s):
    x = packed_q(b, s, h, 256, dtype, "cuda")
    w = zero_centred_weight(256, dtype, "cuda")
    cos, sin = rope_tables(b, s, 64, dtype, "cuda")
    out, ref = rms_norm_rope(x, w, cos, sin), rms_norm_rope_ref(x, w, cos, sin)
    # rstd's reduction order can flip a rounding of the normed value; the RoPE sum can cancel it to many ulp
    assert_matches_ref(out, ref, f"H={h} B={b} S={s}", max_ulp=None, max_frac=1e-3)


def test_rms_norm_rope_validation():
    x, w = torch.randn(1, 4, 2, 16), torch.zeros(16)
    cos = torch.randn(1, 4, 8)
    with pytest.raises(ValueError, match=re.escape("weight must have shape (16,), got (15,)")):
        rms_norm_rope(x, w[:15], cos, cos)
    with pytest.raises(ValueError, match=re.escape("cos has shape (1, 4, 7)")):
        rms_norm_rope(x, w, torch.randn(1, 4, 7), torch.randn(1, 4, 7))
    with pytest.raises(ValueError, match=re.escape("cos has shape (1, 4, 18)")):
        rms_norm_rope(x, w, torch.randn(1, 4, 18), torch.randn(1, 4, 18))
    with pytest.raises(ValueError, match="cos has dtype torch.float16"):
        rms_norm_rope(x, w, cos.half(), cos)
    with pytest.raises(ValueError, match="x must be contiguous in its last dim"):
        rms_norm_rope(x.transpose(2, 3), w, cos, cos)
