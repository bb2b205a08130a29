"""Rotary position embeddings, two conventions: a @triton.jit tile per formula, called by the fused kernels
(qkv_pack.py: interleaved, qk_norm_rope.py: rotate-half), and a pure-PyTorch reference per convention.

Interleaved (Qwen-Image). Head dims (2i, 2i+1) form the complex number x[2i] + i x[2i+1], which is multiplied by
cos + i sin of its token and pair, in fp32, then cast back to x's dtype once. Matches diffusers'
`apply_rotary_emb_qwen(x, freqs_cis, use_real=False)`, with freqs = `torch.view_as_real(freqs_cis)` of
`QwenEmbedRope`'s output:
    y[2i]   = x[2i] cos_i - x[2i+1] sin_i
    y[2i+1] = x[2i] sin_i + x[2i+1] cos_i

Rotate-half (Qwen3.5, partial). The first R head dims are rotated, the rest pass through:
    y[:R] = x[:R] * cos + rotate_half(x[:R]) * sin,  rotate_half(u) = cat(-u[R/2:], u[:R/2])
Matches transformers' qwen3_5 `apply_rotary_pos_emb`, which computes in x's dtype (its cos/sin come in x's dtype):
every product and the sum round to the dtype, so with x1 = x[:R/2], x2 = x[R/2:R]:
    y[:R/2]  = round(round(x1 * cos[:R/2]) + round(-x2 * sin[:R/2]))
    y[R/2:R] = round(round(x2 * cos[R/2:]) + round(x1 * sin[R/2:]))
"""

import torch
import triton
import triton.language as tl

from ._utils import round_to


@triton.jit
def rope_interleaved_tile(x, cos, sin, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """x: [BLOCK_T, BLOCK_H, BLOCK_D] fp32 (tokens, heads, pairs (x[2i], x[2i+1])); cos, sin: [BLOCK_T, BLOCK_D // 2]
    fp32. Returns x * (cos + i sin), fp32, before the one cast to the output dtype."""
    xr, xi = tl.split(tl.reshape(x, [BLOCK_T, BLOCK_H, BLOCK_D // 2, 2]))  # [BLOCK_T, BLOCK_H, BLOCK_D // 2] each
    c, s = cos[:, None, :], sin[:, None, :]
    return tl.reshape(tl.join(xr * c - xi * s, xr * s + xi * c), [BLOCK_T, BLOCK_H, BLOCK_D])


@triton.jit
def rope_rotate_half_tile(x1, x2, cos1, cos2, sin1, sin2, DTYPE: tl.constexpr):
    """The rotated dims in DTYPE arithmetic: x1, x2 fp32 holding DTYPE values, the first and second halves of the R
    rotated dims; cos1, sin1 and cos2, sin2 the matching halves of the tables (broadcast against x1). Returns
    (y1, y2) fp32 with each product rounded to DTYPE, before the sum's cast to DTYPE."""
    y1 = round_to(x1 * cos1, DTYPE) + round_to(-x2 * sin1, DTYPE)
    y2 = round_to(x2 * cos2, DTYPE) + round_to(x1 * sin2, DTYPE)
    return y1, y2


def rope_qwen_image_ref(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE (pure PyTorch; the same ops as apply_rotary_emb_qwen). x: [B, S, H, D] float; freqs:
    [S, D // 2, 2] fp32 (cos, sin). Returns [B, S, H, D] in x's dtype."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))  # [B, S, H, D // 2]
    fc = torch.view_as_complex(freqs.contiguous())[:, None, :]  # [S, 1, D // 2]
    return torch.view_as_real(xc * fc).flatten(3).to(x.dtype)


def rope_rotate_half_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Partial rotate-half RoPE (pure PyTorch, in x's dtype like transformers). x: [B, S, H, D]; cos, sin: [B, S, R]
    in x's dtype, R even, R <= D. Returns [B, S, H, D] in x's dtype."""
    r = cos.shape[-1]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # [B, S, 1, R]
    x_rot, x_pass = x[..., :r], x[..., r:]
    x1, x2 = x_rot[..., : r // 2], x_rot[..., r // 2 :]
    rotated = torch.cat((-x2, x1), dim=-1)
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)
