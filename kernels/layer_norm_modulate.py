"""LayerNorm (no affine) + adaptive modulation, optionally quantized to rowwise FP8 for the next GEMM.

y = layer_norm(x, eps) * (1 + scale[g]) + shift[g], where g is the modulation row of the token: its sample
(row // L) by default, or `mod_row[row]` when each token picks its own row (diffusers' `zero_cond_t`, where
condition-image tokens use the t=0 modulation). Matches diffusers `QwenImageTransformerBlock`:
`self._modulate(self.img_norm1(x), mod1)` with `nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)`, whose
output is in x's dtype, and `_modulate`'s `x * (1 + scale) + shift` in x's dtype (the modulation tables are the
model's): the kernel computes in fp32 and rounds to x's dtype at the same four places.

The `_fp8` form writes e4m3 rows and their fp32 scales (kernels/fp8.py) instead of y, so the modulated
activations never reach HBM in bf16.
"""

import torch
import triton
import triton.language as tl

from ._utils import FLOAT_DTYPES, FP8_DTYPE, check_tensor, new_output, round_to, rows_launch, tile_rows
from .fp8 import check_q_dtype, fp8_quantize_rows, quantize_fp8_rowwise_ref


@triton.jit
def layer_norm_modulate_rows(x, mask, shift, scale, N, eps, DTYPE: tl.constexpr):
    """x, shift, scale: [BLOCK_M, BLOCK_N] fp32, masked lanes 0 (so y is 0 there). Returns y fp32 holding DTYPE
    values: the LayerNorm output, 1 + scale, the product and the sum each round to DTYPE, as upstream's ops do."""
    mean = tl.sum(x, axis=1) / N
    xc = tl.where(mask, x - mean[:, None], 0.0)
    var = tl.sum(xc * xc, axis=1) / N
    xn = round_to(xc * tl.rsqrt(var + eps)[:, None], DTYPE)
    return round_to(round_to(xn * round_to(1.0 + scale, DTYPE), DTYPE) + shift, DTYPE)


@triton.jit
def load_mod_rows(MOD_ROW, rows, M, rows_per_sample, HAS_MOD_ROW: tl.constexpr):
    """The modulation row [BLOCK_M] of each token: its own entry in MOD_ROW, else its sample index."""
    if HAS_MOD_ROW:
        g = tl.load(MOD_ROW + rows, mask=rows < M, other=0).to(tl.int64)
    else:
        g = rows // rows_per_sample
    return g


@triton.jit
def load_mod(T, g, stride, cols, mask):
    """Rows g [BLOCK_M] of a [G, N] modulation table as a [BLOCK_M, BLOCK_N] fp32 tile."""
    return tl.load(T + g[:, None] * stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def store_rows(Y, Y_SCALE, rows, M, stride_y, cols, mask, y, QUANT_FP8: tl.constexpr):
    """Store y [BLOCK_M, BLOCK_N] fp32 (holding activation-dtype values) as is, or as rowwise FP8 + scale."""
    if QUANT_FP8:
        q, s = fp8_quantize_rows(y)
        tl.store(Y + rows[:, None] * stride_y + cols[None, :], q.to(Y.dtype.element_ty), mask=mask)
        tl.store(Y_SCALE + rows, s, mask=rows < M)
    else:
        tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _layer_norm_modulate_kernel(
    X, SHIFT, SCALE, MOD_ROW, Y, Y_SCALE,
    stride_x, stride_shift, stride_scale, stride_y, rows_per_sample, M, N, eps,
    HAS_MOD_ROW: tl.constexpr, QUANT_FP8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows, cols, mask = tile_rows(M, N, BLOCK_M, BLOCK_N)
    g = load_mod_rows(MOD_ROW, rows, M, rows_per_sample, HAS_MOD_ROW)
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    shift = load_mod(SHIFT, g, stride_shift, cols, mask)
    scale = load_mod(SCALE, g, stride_scale, cols, mask)
    y = layer_norm_modulate_rows(x, mask, shift, scale, N, eps, X.dtype.element_ty)
    store_rows(Y, Y_SCALE, rows, M, stride_y, cols, mask, y, QUANT_FP8)


def check_modulation(x: torch.Tensor, mod_row: torch.Tensor | None, **mods: torch.Tensor) -> int:
    """Validate x [B, L, D] (rows contiguous), per-token mod_row [B*L] and each [G, D] modulation table.
    Returns the number of table rows G."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES, ndim=3)
    b, l, d = x.shape
    if not x.is_contiguous():
        raise ValueError(f"x must be contiguous [B, L, D], got shape {tuple(x.shape)} strides {x.stride()}")
    n_rows = None
    for name, t in mods.items():
        check_tensor(name, t, dtypes=FLOAT_DTYPES, ndim=2, device=x.device)
        if t.shape[1] != d:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; its width must equal x's D={d}")
        if n_rows is not None and t.shape[0] != n_rows:
            raise ValueError(f"{name} has {t.shape[0]} rows, the other modulation tensors {n_rows}")
        n_rows = t.shape[0]
    if mod_row is None:
        if n_rows != b:
            raise ValueError(f"modulation tables have {n_rows} rows; without mod_row they need one per sample (B={b})")
    else:
        check_tensor("mod_row", mod_row, dtypes=(torch.int32, torch.int64), shape=(b * l,), device=x.device)
    return n_rows


def layer_norm_modulate(x, shift, scale, *, mod_row=None, eps: float = 1e-6) -> torch.Tensor:
    """x: [B, L, D]; shift, scale: [B, D] (or [G, D] with mod_row: int [B*L]); rows may be strided views of a
    larger modulation tensor. Returns y [B, L, D] in x.dtype."""
    check_modulation(x, mod_row, shift=shift, scale=scale)
    y = new_output(x.shape, x.dtype, x.device)
    _launch(x, shift, scale, mod_row, eps, y, None)
    return y


def layer_norm_modulate_fp8(x, shift, scale, *, mod_row=None, eps: float = 1e-6, q_dtype=FP8_DTYPE):
    """As layer_norm_modulate, quantized per token: returns q [B*L, D] (q_dtype) and scale [B*L, 1] fp32, the
    operand form of fp8_linear. q_dtype=torch.float32 stores the pre-cast values (interpreter tests)."""
    check_modulation(x, mod_row, shift=shift, scale=scale)
    check_q_dtype(q_dtype)
    m, d = x.shape[0] * x.shape[1], x.shape[2]
    q = new_output((m, d), q_dtype, x.device)
    s = new_output((m, 1), torch.float32, x.device)
    _launch(x, shift, scale, mod_row, eps, q, s)
    return q, s


def _launch(x, shift, scale, mod_row, eps, y, y_scale):
    b, l, d = x.shape
    if b * l == 0:
        return
    grid, settings = rows_launch(b * l, d)
    _layer_norm_modulate_kernel[grid](
        X=x, SHIFT=shift, SCALE=scale, MOD_ROW=mod_row, Y=y, Y_SCALE=y_scale,
        stride_x=d, stride_shift=shift.stride(0), stride_scale=scale.stride(0), stride_y=d,
        rows_per_sample=l, M=b * l, N=d, eps=eps,
        HAS_MOD_ROW=mod_row is not None, QUANT_FP8=y_scale is not None, **settings,
    )


def gather_modulation(t: torch.Tensor, x: torch.Tensor, mod_row: torch.Tensor | None) -> torch.Tensor:
    """[G, D] modulation table -> the [B, L or 1, D] values each token of x [B, L, D] uses."""
    if mod_row is None:
        return t[:, None, :]
    return t[mod_row.long()].view(x.shape)


def layer_norm_modulate_ref(x, shift, scale, *, mod_row=None, eps: float = 1e-6) -> torch.Tensor:
    """The semantics layer_norm_modulate must reproduce, with diffusers' casts (all in x's dtype)."""
    xn = torch.nn.functional.layer_norm(x, (x.shape[-1],), eps=eps)
    shift, scale = gather_modulation(shift, x, mod_row), gather_modulation(scale, x, mod_row)
    return xn * (1 + scale) + shift


def layer_norm_modulate_fp8_ref(x, shift, scale, *, mod_row=None, eps: float = 1e-6, q_dtype=FP8_DTYPE):
    y = layer_norm_modulate_ref(x, shift, scale, mod_row=mod_row, eps=eps)
    return quantize_fp8_rowwise_ref(y.reshape(-1, x.shape[-1]), q_dtype)
