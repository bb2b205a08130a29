"""Rotary position embeddings, two conventions.

rope_qwen_image: Qwen-Image's interleaved RoPE. Head dims (2i, 2i+1) form the complex number x[2i] + i x[2i+1],
which is multiplied by cos + i sin of its token and pair, in fp32, then cast back to x's dtype once. Matches diffusers'
`apply_rotary_emb_qwen(x, freqs_cis, use_real=False)`, with freqs = `torch.view_as_real(freqs_cis)` of
`QwenEmbedRope`'s output:
    y[2i]   = x[2i] cos_i - x[2i+1] sin_i
    y[2i+1] = x[2i] sin_i + x[2i+1] cos_i

rope_rotate_half: Qwen3.5's partial rotate-half RoPE. The first R head dims are rotated, the rest pass through:
    y[:R] = x[:R] * cos + rotate_half(x[:R]) * sin,  rotate_half(u) = cat(-u[R/2:], u[:R/2])
Matches transformers' qwen3_5 `apply_rotary_pos_emb`, which computes in x's dtype (its cos/sin come in x's dtype);
the kernel computes in fp32 and casts once, so it is within rounding of the reference, not bit-equal.
"""

import torch
import triton
import triton.language as tl

from ._utils import FLOAT_DTYPES, check_tensor, new_output


def head_block(n_heads: int) -> int:
    """Heads per program: a [BLOCK_H, D] tile; 8 heads of 128 dims keep a program's loads wide on Hopper."""
    return min(8, triton.next_power_of_2(n_heads))


@triton.jit
def rope_interleaved(x, cos, sin, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """x: [BLOCK_H, BLOCK_D] fp32, pairs (x[2i], x[2i+1]); cos, sin: [BLOCK_D // 2] fp32. Returns x * (cos + i sin)."""
    xr, xi = tl.split(tl.reshape(x, [BLOCK_H, BLOCK_D // 2, 2]))  # [BLOCK_H, BLOCK_D // 2] each
    yr = xr * cos[None, :] - xi * sin[None, :]
    yi = xr * sin[None, :] + xi * cos[None, :]
    return tl.reshape(tl.join(yr, yi), [BLOCK_H, BLOCK_D])


@triton.jit
def load_freqs(F, stride_f_pair, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """F points at one token's [D // 2, 2] (cos, sin) table. Returns cos, sin: [BLOCK_D // 2] fp32."""
    pairs = tl.arange(0, BLOCK_D // 2)
    mask = pairs < HEAD_DIM // 2
    cos = tl.load(F + pairs * stride_f_pair, mask=mask, other=1.0)
    sin = tl.load(F + pairs * stride_f_pair + 1, mask=mask, other=0.0)
    return cos, sin


@triton.jit
def _rope_qwen_image_kernel(
    X, F, Y, S, H, stride_xb, stride_xs, stride_xh, stride_f_tok, stride_f_pair,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # b * S + s
    b = row // S
    s = row % S
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < H) & (cols[None, :] < HEAD_DIM)  # [BLOCK_H, BLOCK_D]
    x_ptrs = X + b * stride_xb + s * stride_xs + heads[:, None] * stride_xh + cols[None, :]
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_D]
    cos, sin = load_freqs(F + s * stride_f_tok, stride_f_pair, HEAD_DIM, BLOCK_D)
    y = rope_interleaved(x, cos, sin, BLOCK_H, BLOCK_D)
    y_ptrs = Y + row * H * HEAD_DIM + heads[:, None] * HEAD_DIM + cols[None, :]
    tl.store(y_ptrs, y.to(Y.dtype.element_ty), mask=mask)


def rope_qwen_image(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """x: [B, S, H, D] float, last dim contiguous; freqs: [S, D // 2, 2] fp32 (cos, sin), e.g.
    `torch.view_as_real(freqs_cis)`. Returns a new contiguous [B, S, H, D] tensor in x's dtype."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES, ndim=4)
    b, s, h, d = x.shape
    if d % 2:
        raise ValueError(f"x's head dim D={d} must be even (interleaved pairs)")
    check_tensor("freqs", freqs, dtypes=(torch.float32,), shape=(s, d // 2, 2), device=x.device)
    y = new_output(x.shape, x.dtype, x.device)
    if b * s * h == 0:
        return y
    block_h = head_block(h)
    _rope_qwen_image_kernel[(b * s, triton.cdiv(h, block_h))](
        X=x, F=freqs, Y=y, S=s, H=h,
        stride_xb=x.stride(0), stride_xs=x.stride(1), stride_xh=x.stride(2),
        stride_f_tok=freqs.stride(0), stride_f_pair=freqs.stride(1),
        HEAD_DIM=d, BLOCK_H=block_h, BLOCK_D=triton.next_power_of_2(d),
    )
    return y


def rope_qwen_image_ref(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """The semantics rope_qwen_image must reproduce (pure PyTorch; the same ops as apply_rotary_emb_qwen)."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))  # [B, S, H, D // 2]
    fc = torch.view_as_complex(freqs.contiguous())[:, None, :]  # [S, 1, D // 2]
    return torch.view_as_real(xc * fc).flatten(3).to(x.dtype)


@triton.jit
def rotate_half_tile(
    X, C, SN, Y, S, H, stride_xb, stride_xs, stride_xh, stride_cb, stride_cs, stride_sb, stride_ss,
    HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """This program's heads of one token (grid: (B * S, heads / BLOCK_H)), as rotate-half kernels read them: the x and
    y head rows [BLOCK_H, 1], the offsets of one rotated half [BLOCK_R] (j and j + R/2 form a pair) and of the
    pass-through dims [BLOCK_P] with their [BLOCK_H, *] masks, and the token's cos / sin halves [1, BLOCK_R] fp32."""
    row = tl.program_id(0).to(tl.int64)  # b * S + s
    b = row // S
    s = row % S
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    half = tl.arange(0, BLOCK_R)
    rest = ROT_DIM + tl.arange(0, BLOCK_P)
    in_half = half < ROT_DIM // 2
    half_mask = (heads[:, None] < H) & in_half[None, :]  # [BLOCK_H, BLOCK_R]
    rest_mask = (heads[:, None] < H) & (rest[None, :] < HEAD_DIM)  # [BLOCK_H, BLOCK_P]
    x_row = X + b * stride_xb + s * stride_xs + heads[:, None] * stride_xh
    y_row = Y + row * H * HEAD_DIM + heads[:, None] * HEAD_DIM
    c_row = C + b * stride_cb + s * stride_cs
    s_row = SN + b * stride_sb + s * stride_ss
    cos1 = tl.load(c_row + half, mask=in_half, other=0.0).to(tl.float32)[None, :]  # [1, BLOCK_R]
    cos2 = tl.load(c_row + ROT_DIM // 2 + half, mask=in_half, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(s_row + half, mask=in_half, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(s_row + ROT_DIM // 2 + half, mask=in_half, other=0.0).to(tl.float32)[None, :]
    return x_row, y_row, half, rest, half_mask, rest_mask, cos1, cos2, sin1, sin2


@triton.jit
def _rope_rotate_half_kernel(
    X, C, SN, Y, S, H, stride_xb, stride_xs, stride_xh, stride_cb, stride_cs, stride_sb, stride_ss,
    HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    x_row, y_row, half, rest, half_mask, rest_mask, cos1, cos2, sin1, sin2 = rotate_half_tile(
        X, C, SN, Y, S, H, stride_xb, stride_xs, stride_xh, stride_cb, stride_cs, stride_sb, stride_ss,
        HEAD_DIM, ROT_DIM, BLOCK_H, BLOCK_R, BLOCK_P)
    x1 = tl.load(x_row + half[None, :], mask=half_mask, other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_R]
    x2 = tl.load(x_row + ROT_DIM // 2 + half[None, :], mask=half_mask, other=0.0).to(tl.float32)
    y1 = x1 * cos1 - x2 * sin1
    y2 = x2 * cos2 + x1 * sin2
    tl.store(y_row + half[None, :], y1.to(Y.dtype.element_ty), mask=half_mask)
    tl.store(y_row + ROT_DIM // 2 + half[None, :], y2.to(Y.dtype.element_ty), mask=half_mask)

    x_pass = tl.load(x_row + rest[None, :], mask=rest_mask, other=0.0)  # [BLOCK_H, BLOCK_P]
    tl.store(y_row + rest[None, :], x_pass, mask=rest_mask)


def check_rotate_half_args(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """x: [B, S, H, D] float, last dim contiguous; cos, sin: [B, S, R] in x's dtype, R even, R <= D."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES, ndim=4)
    b, s, _, d = x.shape
    check_tensor("cos", cos, dtypes=(x.dtype,), ndim=3, device=x.device)
    r = cos.shape[-1]
    if tuple(cos.shape) != (b, s, r) or r % 2 or r > d:
        raise ValueError(f"cos has shape {tuple(cos.shape)}; expected [B, S, R] = [{b}, {s}, R] with R even and "
                         f"R <= D={d}")
    check_tensor("sin", sin, dtypes=(x.dtype,), shape=cos.shape, device=x.device)


def launch_rotate_half(kernel, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, **extra) -> torch.Tensor:
    """Runs a kernel built on rotate_half_tile over checked x, cos, sin (extra: its own arguments and launch options).
    Returns its new contiguous output, shaped and typed like x."""
    b, s, h, d = x.shape
    r = cos.shape[-1]
    y = new_output(x.shape, x.dtype, x.device)
    if y.numel() == 0:
        return y
    block_h = head_block(h)
    kernel[(b * s, triton.cdiv(h, block_h))](
        X=x, C=cos, SN=sin, Y=y, S=s, H=h,
        stride_xb=x.stride(0), stride_xs=x.stride(1), stride_xh=x.stride(2),
        stride_cb=cos.stride(0), stride_cs=cos.stride(1), stride_sb=sin.stride(0), stride_ss=sin.stride(1),
        HEAD_DIM=d, ROT_DIM=r, BLOCK_H=block_h, BLOCK_R=triton.next_power_of_2(max(r // 2, 1)),
        BLOCK_P=triton.next_power_of_2(max(d - r, 1)), **extra,
    )
    return y


def rope_rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, S, H, D] float, last dim contiguous; cos, sin: [B, S, R] in x's dtype, R even, R <= D (Qwen3.5: R=64 of
    D=256). Returns a new contiguous [B, S, H, D] tensor in x's dtype."""
    check_rotate_half_args(x, cos, sin)
    return launch_rotate_half(_rope_rotate_half_kernel, x, cos, sin)


def rope_rotate_half_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The semantics rope_rotate_half must reproduce (pure PyTorch, in x's dtype like transformers)."""
    r = cos.shape[-1]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # [B, S, 1, R]
    x_rot, x_pass = x[..., :r], x[..., r:]
    x1, x2 = x_rot[..., : r // 2], x_rot[..., r // 2 :]
    rotated = torch.cat((-x2, x1), dim=-1)
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)
