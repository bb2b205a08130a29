"""RMSNorm in the three conventions this project meets, optionally fused with a residual add or a SiLU gate.

With n(x) = x.float() * rsqrt(mean(x.float() ** 2, -1) + eps) over the last dim:

- rms_norm(x, w), zero_centered=False: diffusers `RMSNorm` (the DiT's QK-norm and txt_norm)
      y = n(x).to(w.dtype) * w            (the cast only for fp16/bf16 w; w.dtype must equal x.dtype)
- rms_norm(x, w), zero_centered=True: transformers `Qwen3_5RMSNorm` (all fp32, cast once)
      y = (n(x) * (1 + w.float())).to(x.dtype)
- add_rms_norm(x, residual, w): the HF decoder layer's add, then either norm above
      residual_out = x + residual (in x.dtype); y = rms_norm(residual_out, w)
- gated_rms_norm(x, gate, w): transformers `Qwen3_5RMSNormGated` (Gated-DeltaNet output norm)
      y = ((w * n(x).to(x.dtype)) * silu(gate.float())).to(x.dtype)

One kernel does all of them (rows held in registers, several rows per program when rows are narrow, as the
128-wide per-head norms are); constexpr switches select the residual add, the zero-centred weight and the gate. It
computes in fp32 and rounds where upstream rounds (round_to). The formulas are @triton.jit tiles (row_rstd,
rms_norm_tile, gated_norm_tile) that fused kernels call too: qkv_pack, rms_norm_rope, gemv's gated prologue.
Rows up to MAX_N wide; wider rows would need a looped two-pass kernel.
"""

import torch
import triton
import triton.language as tl

from ._utils import FLOAT_DTYPES, check_tensor, new_output, round_to, rows_launch, tile_rows

MAX_N = 65536  # past this a register-resident row spills badly (rows_launch gives at most 16 warps)


@triton.jit
def row_rstd(x, N, eps):
    """x: [..., BLOCK_N] fp32 rows of width N, masked lanes 0. Returns rsqrt(mean(x * x) + eps) as [..., 1]."""
    return tl.rsqrt(tl.sum(x * x, axis=-1, keep_dims=True) / N + eps)


@triton.jit
def rms_norm_tile(x, rstd, w, ZERO_CENTERED: tl.constexpr, DTYPE: tl.constexpr):
    """Rows of rms_norm before the final cast to DTYPE: x [..., BLOCK_N] fp32 holding DTYPE values, rstd [..., 1]
    (row_rstd), w fp32, broadcast against x. diffusers: round(x * rstd) * w; zero-centred: x * rstd * (1 + w).
    Also the norm of qkv_pack (diffusers) and of rms_norm_rope (zero-centred)."""
    if ZERO_CENTERED:
        return x * rstd * (1.0 + w)
    else:
        return round_to(x * rstd, DTYPE) * w


@triton.jit
def gated_norm_tile(x, g, w, N, eps, Y_DTYPE: tl.constexpr, W_DTYPE: tl.constexpr):
    """Rows of gated_rms_norm, before the final cast to Y_DTYPE: x, g [BLOCK_M, BLOCK_N] fp32 (masked columns 0),
    w [1, BLOCK_N] fp32; N the row width. Also the prologue of gemv's gated_rms_norm_gemv."""
    y = round_to(rms_norm_tile(x, row_rstd(x, N, eps), w, False, Y_DTYPE), W_DTYPE)  # w * n(x) in w's dtype
    return y * tl.fdiv(g, 1.0 + tl.exp(-g), ieee_rounding=False)  # silu; an IEEE division per element is slow


@triton.jit
def _rms_norm_fwd_kernel(
    X, R, G, W, Y, R_OUT,
    stride_x, stride_r, stride_g, stride_y, stride_r_out,
    M, N, eps,
    HAS_RESIDUAL: tl.constexpr, ZERO_CENTERED: tl.constexpr, HAS_GATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows, cols, mask = tile_rows(M, N, BLOCK_M, BLOCK_N)  # [BLOCK_M], [BLOCK_N], [BLOCK_M, BLOCK_N]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x = round_to(x + r, R_OUT.dtype.element_ty)  # upstream adds in the model dtype
        tl.store(R_OUT + rows[:, None] * stride_r_out + cols[None, :], x.to(R_OUT.dtype.element_ty), mask=mask)
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]  # [1, BLOCK_N]
    if HAS_GATE:
        g = tl.load(G + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        y = gated_norm_tile(x, g, w, N, eps, Y.dtype.element_ty, W.dtype.element_ty)
    else:
        y = rms_norm_tile(x, row_rstd(x, N, eps), w, ZERO_CENTERED, Y.dtype.element_ty)
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


def _check_x(x: torch.Tensor):
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.dim() == 0:
        raise ValueError("x must have at least 1 dim [..., N], got a 0-dim tensor")
    n = x.shape[-1]
    if n > MAX_N:
        raise ValueError(f"x has row width N={n}; the register-resident kernel allows N <= {MAX_N}")


def _check_weight(weight: torch.Tensor, x: torch.Tensor, zero_centered: bool):
    if not zero_centered and isinstance(weight, torch.Tensor) and weight.dtype != x.dtype:
        raise ValueError(f"weight has dtype {weight.dtype}; with zero_centered=False (diffusers RMSNorm) it must "
                         f"equal x's dtype {x.dtype}, so the output stays in x's dtype")
    dtypes = (x.dtype, torch.float32) if zero_centered else (x.dtype,)
    check_tensor("weight", weight, dtypes=dtypes, shape=(x.shape[-1],), device=x.device)


def _launch(x, residual, gate, weight, eps, zero_centered):
    """x, residual, gate: [..., N] (residual, gate may be None); weight: [N]. Returns (y, residual_out or None)."""
    n = x.shape[-1]
    m = x.shape[:-1].numel()
    x2 = x.reshape(m, n)  # [M, N], a view with a row stride when x's rows are strided
    r2 = residual.reshape(m, n) if residual is not None else x2
    g2 = gate.reshape(m, n) if gate is not None else x2
    y = new_output((m, n), x.dtype, x.device)  # [M, N]
    r_out = new_output((m, n), x.dtype, x.device) if residual is not None else y
    if m and n:
        grid, settings = rows_launch(m, n)
        _rms_norm_fwd_kernel[grid](
            X=x2, R=r2, G=g2, W=weight, Y=y, R_OUT=r_out,
            stride_x=x2.stride(0), stride_r=r2.stride(0), stride_g=g2.stride(0),
            stride_y=y.stride(0), stride_r_out=r_out.stride(0),
            M=m, N=n, eps=eps,
            HAS_RESIDUAL=residual is not None, ZERO_CENTERED=zero_centered, HAS_GATE=gate is not None,
            **settings,
        )
    return y.view(x.shape), (r_out.view(x.shape) if residual is not None else None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, zero_centered: bool = False) -> torch.Tensor:
    """x: [..., N] float (last dim contiguous); weight: [N], x's dtype (or fp32 when zero_centered).
    Returns y [..., N] in x's dtype."""
    _check_x(x)
    _check_weight(weight, x, zero_centered)
    return _launch(x, None, None, weight, eps, zero_centered)[0]


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, zero_centered: bool = False):
    """The semantics rms_norm must reproduce (pure PyTorch, upstream's casts)."""
    xf = x.float()
    xn = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if zero_centered:
        return (xn * (1.0 + weight.float())).to(x.dtype)
    if weight.dtype in (torch.float16, torch.bfloat16):
        xn = xn.to(weight.dtype)
    return xn * weight


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, zero_centered: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [..., N], same shape and dtype; weight as for rms_norm.
    Returns (y, residual_out): residual_out = x + residual in x's dtype, y = rms_norm(residual_out)."""
    _check_x(x)
    check_tensor("residual", residual, dtypes=(x.dtype,), shape=x.shape, device=x.device)
    _check_weight(weight, x, zero_centered)
    return _launch(x, residual, None, weight, eps, zero_centered)


def add_rms_norm_ref(x, residual, weight, eps=1e-6, zero_centered=False) -> tuple[torch.Tensor, torch.Tensor]:
    """The semantics add_rms_norm must reproduce (pure PyTorch)."""
    residual_out = x + residual
    return rms_norm_ref(residual_out, weight, eps, zero_centered), residual_out


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x: [..., N]; gate: [..., N] float, any float dtype; weight: [N], x's dtype or fp32.
    Returns y [..., N] in x's dtype."""
    _check_x(x)
    check_tensor("gate", gate, dtypes=FLOAT_DTYPES, shape=x.shape, device=x.device)
    check_tensor("weight", weight, dtypes=(x.dtype, torch.float32), shape=(x.shape[-1],), device=x.device)
    return _launch(x, None, gate, weight, eps, zero_centered=False)[0]


def gated_rms_norm_ref(x, gate, weight, eps=1e-6) -> torch.Tensor:
    """The semantics gated_rms_norm must reproduce (pure PyTorch, upstream's casts)."""
    xf = x.float()
    xn = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return ((weight * xn) * torch.nn.functional.silu(gate.float())).to(x.dtype)
