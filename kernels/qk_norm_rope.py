"""Per-head zero-centred RMSNorm followed by partial rotate-half RoPE, in one pass over q (or k).

With n = x.float() * rsqrt(mean(x.float() ** 2, -1) + eps) over the head dim D:
    u = (n * (1 + w.float())).to(x.dtype)                  transformers qwen3_5 `Qwen3_5RMSNorm` (q_norm / k_norm)
    y[:R] = u[:R] * cos + rotate_half(u[:R]) * sin         `apply_rotary_pos_emb` with partial rotary (R of D dims)
    y[R:] = u[R:]
The RoPE runs in x's dtype as transformers does (its cos/sin come in x's dtype): every product and the sum are
rounded to the dtype, so with u1 = u[:R/2], u2 = u[R/2:R]:
    y[:R/2]  = round(round(u1 * cos[:R/2]) + round(-u2 * sin[:R/2]))
    y[R/2:R] = round(round(u2 * cos[R/2:]) + round(u1 * sin[R/2:]))
This is `Qwen3_5Attention`'s q_norm/k_norm + rotary for one of q, k (Qwen3.5: D=256, R=64). The formulas are
rms_norm.py's and rope.py's tiles; a program holds a head row in three pieces (the two rotated halves, which the
rotation pairs, and the pass-through dims).
"""

import torch
import triton
import triton.language as tl

from ._utils import FLOAT_DTYPES, check_tensor, head_block, new_output, round_to
from .rms_norm import rms_norm_ref, rms_norm_tile
from .rope import rope_rotate_half_ref, rope_rotate_half_tile


@triton.jit
def _rms_norm_rope_kernel(
    X, W, C, SN, Y, S, H, stride_xb, stride_xs, stride_xh, stride_cb, stride_cs, stride_sb, stride_ss, eps,
    HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # b * S + s
    b = row // S
    s = row % S
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    half = tl.arange(0, BLOCK_R)  # j and ROT_DIM // 2 + j form a rotated pair
    rest = ROT_DIM + tl.arange(0, BLOCK_P)  # the pass-through dims
    in_half = half < ROT_DIM // 2
    in_rest = rest < HEAD_DIM
    half_mask = (heads[:, None] < H) & in_half[None, :]  # [BLOCK_H, BLOCK_R]
    rest_mask = (heads[:, None] < H) & in_rest[None, :]  # [BLOCK_H, BLOCK_P]
    x_row = X + b * stride_xb + s * stride_xs + heads[:, None] * stride_xh  # [BLOCK_H, 1]
    y_row = Y + row * H * HEAD_DIM + heads[:, None] * HEAD_DIM
    c_row = C + b * stride_cb + s * stride_cs
    s_row = SN + b * stride_sb + s * stride_ss
    dtype = Y.dtype.element_ty

    x1 = tl.load(x_row + half[None, :], mask=half_mask, other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_R]
    x2 = tl.load(x_row + ROT_DIM // 2 + half[None, :], mask=half_mask, other=0.0).to(tl.float32)
    xp = tl.load(x_row + rest[None, :], mask=rest_mask, other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_P]
    sum_sq = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1) + tl.sum(xp * xp, axis=1)  # [BLOCK_H]
    rstd = tl.rsqrt(sum_sq / HEAD_DIM + eps)[:, None]  # the whole row's, as row_rstd
    w1 = tl.load(W + half, mask=in_half, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(W + ROT_DIM // 2 + half, mask=in_half, other=0.0).to(tl.float32)[None, :]
    wp = tl.load(W + rest, mask=in_rest, other=0.0).to(tl.float32)[None, :]
    u1 = round_to(rms_norm_tile(x1, rstd, w1, True, dtype), dtype)
    u2 = round_to(rms_norm_tile(x2, rstd, w2, True, dtype), dtype)
    tl.store(y_row + rest[None, :], rms_norm_tile(xp, rstd, wp, True, dtype).to(dtype), mask=rest_mask)

    cos1 = tl.load(c_row + half, mask=in_half, other=0.0).to(tl.float32)[None, :]  # [1, BLOCK_R]
    cos2 = tl.load(c_row + ROT_DIM // 2 + half, mask=in_half, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(s_row + half, mask=in_half, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(s_row + ROT_DIM // 2 + half, mask=in_half, other=0.0).to(tl.float32)[None, :]
    y1, y2 = rope_rotate_half_tile(u1, u2, cos1, cos2, sin1, sin2, dtype)
    tl.store(y_row + half[None, :], y1.to(dtype), mask=half_mask)
    tl.store(y_row + ROT_DIM // 2 + half[None, :], y2.to(dtype), mask=half_mask)


def rms_norm_rope(
    x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """x: [B, S, H, D] float, last dim contiguous, other strides arbitrary (e.g. a view into a packed projection);
    weight: [D] zero-centred, fp32 or x's dtype; cos, sin: [B, S, R] in x's dtype, R even, R <= D (Qwen3.5: R=64 of
    D=256), any strides but the last (e.g. one table broadcast over the batch). Returns a new contiguous
    [B, S, H, D] tensor in x's dtype."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES, ndim=4)
    b, s, h, d = x.shape
    check_tensor("cos", cos, dtypes=(x.dtype,), ndim=3, device=x.device)
    r = cos.shape[-1]
    if tuple(cos.shape) != (b, s, r) or r % 2 or r > d:
        raise ValueError(f"cos has shape {tuple(cos.shape)}; expected [B, S, R] = [{b}, {s}, R] with R even and "
                         f"R <= D={d}")
    check_tensor("sin", sin, dtypes=(x.dtype,), shape=cos.shape, device=x.device)
    check_tensor("weight", weight, dtypes=(x.dtype, torch.float32), shape=(d,), device=x.device)
    y = new_output(x.shape, x.dtype, x.device)
    if y.numel() == 0:
        return y
    block_h = head_block(h)
    _rms_norm_rope_kernel[(b * s, triton.cdiv(h, block_h))](
        X=x, W=weight, C=cos, SN=sin, Y=y, S=s, H=h,
        stride_xb=x.stride(0), stride_xs=x.stride(1), stride_xh=x.stride(2),
        stride_cb=cos.stride(0), stride_cs=cos.stride(1), stride_sb=sin.stride(0), stride_ss=sin.stride(1), eps=eps,
        HEAD_DIM=d, ROT_DIM=r, BLOCK_H=block_h, BLOCK_R=triton.next_power_of_2(max(r // 2, 1)),
        BLOCK_P=triton.next_power_of_2(max(d - r, 1)),
        enable_fp_fusion=False,  # else fp16 products and their sum fuse into one fma.f16, skipping a rounding
    )
    return y


def rms_norm_rope_ref(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float = 1e-6):
    """The semantics rms_norm_rope must reproduce (pure PyTorch, upstream's casts)."""
    return rope_rotate_half_ref(rms_norm_ref(x, weight, eps, zero_centered=True), cos, sin)
