"""Per-head zero-centred RMSNorm followed by partial rotate-half RoPE, in one pass over q (or k).

With n = x.float() * rsqrt(mean(x.float() ** 2, -1) + eps) over the head dim D:
    u = (n * (1 + w.float())).to(x.dtype)                  transformers qwen3_5 `Qwen3_5RMSNorm` (q_norm / k_norm)
    y[:R] = u[:R] * cos + rotate_half(u[:R]) * sin         `apply_rotary_pos_emb` with partial rotary (R of D dims)
    y[R:] = u[R:]
The RoPE runs in x's dtype as transformers does (its cos/sin come in x's dtype): every product and the sum are
rounded to the dtype, so with u1 = u[:R/2], u2 = u[R/2:R]:
    y[:R/2]  = round(round(u1 * cos[:R/2]) + round(-u2 * sin[:R/2]))
    y[R/2:R] = round(round(u2 * cos[R/2:]) + round(u1 * sin[R/2:]))
This is `Qwen3_5Attention`'s q_norm/k_norm + rotary for one of q, k (Qwen3.5: D=256, R=64).
"""

import torch
import triton
import triton.language as tl

from ._utils import check_tensor, round_to
from .rms_norm import rms_norm_ref
from .rope import check_rotate_half_args, launch_rotate_half, rope_rotate_half_ref, rotate_half_tile


@triton.jit
def _rms_norm_rope_kernel(
    X, W, C, SN, Y, S, H, stride_xb, stride_xs, stride_xh, stride_cb, stride_cs, stride_sb, stride_ss, eps,
    HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    x_row, y_row, half, rest, half_mask, rest_mask, cos1, cos2, sin1, sin2 = rotate_half_tile(
        X, C, SN, Y, S, H, stride_xb, stride_xs, stride_xh, stride_cb, stride_cs, stride_sb, stride_ss,
        HEAD_DIM, ROT_DIM, BLOCK_H, BLOCK_R, BLOCK_P)
    in_half = half < ROT_DIM // 2
    in_rest = rest < HEAD_DIM
    dtype = Y.dtype.element_ty

    # the head row in three disjoint pieces: first rotated half, second rotated half, pass-through
    x1 = tl.load(x_row + half[None, :], mask=half_mask, other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_R]
    x2 = tl.load(x_row + ROT_DIM // 2 + half[None, :], mask=half_mask, other=0.0).to(tl.float32)
    xp = tl.load(x_row + rest[None, :], mask=rest_mask, other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_P]
    sum_sq = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1) + tl.sum(xp * xp, axis=1)  # [BLOCK_H]
    rstd = tl.rsqrt(sum_sq / HEAD_DIM + eps)[:, None]
    w1 = tl.load(W + half, mask=in_half, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(W + ROT_DIM // 2 + half, mask=in_half, other=0.0).to(tl.float32)[None, :]
    wp = tl.load(W + rest, mask=in_rest, other=0.0).to(tl.float32)[None, :]
    u1 = round_to(x1 * rstd * (1.0 + w1), dtype)
    u2 = round_to(x2 * rstd * (1.0 + w2), dtype)
    tl.store(y_row + rest[None, :], (xp * rstd * (1.0 + wp)).to(dtype), mask=rest_mask)

    y1 = round_to(u1 * cos1, dtype) + round_to(-u2 * sin1, dtype)
    y2 = round_to(u2 * cos2, dtype) + round_to(u1 * sin2, dtype)
    tl.store(y_row + half[None, :], y1.to(dtype), mask=half_mask)
    tl.store(y_row + ROT_DIM // 2 + half[None, :], y2.to(dtype), mask=half_mask)


def rms_norm_rope(
    x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """x: [B, S, H, D] float, last dim contiguous, other strides arbitrary (e.g. a view into a packed projection);
    weight: [D] zero-centred, fp32 or x's dtype; cos, sin: [B, S, R] in x's dtype, R even, R <= D (Qwen3.5: R=64 of
    D=256). Returns a new contiguous [B, S, H, D] tensor in x's dtype."""
    check_rotate_half_args(x, cos, sin)
    check_tensor("weight", weight, dtypes=(x.dtype, torch.float32), shape=(x.shape[-1],), device=x.device)
    return launch_rotate_half(
        _rms_norm_rope_kernel, x, cos, sin, W=weight, eps=eps,
        enable_fp_fusion=False,  # else fp16 products and their sum fuse into one fma.f16, skipping a rounding
    )


def rms_norm_rope_ref(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float = 1e-6):
    """The semantics rms_norm_rope must reproduce (pure PyTorch, upstream's casts)."""
    return rope_rotate_half_ref(rms_norm_ref(x, weight, eps, zero_centered=True), cos, sin)
