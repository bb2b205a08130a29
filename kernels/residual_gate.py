"""Gated residual add, optionally fused with the next LayerNorm + modulation (+ rowwise FP8 quantization).

residual_out = residual + gate[g] * x, with diffusers' casts (`hidden_states + img_gate1 * img_attn_output`: the
product rounds to the residual's dtype, then the sum does). The fused forms continue on residual_out with
layer_norm_modulate (kernels/layer_norm_modulate.py): after attention that is norm2 + mod2 of the same block,
after the MLP it is norm1 + mod1 of the next block, so each residual row is read once and written once.
g is the token's sample, or mod_row[row] (zero_cond_t), as in layer_norm_modulate.
"""

import torch
import triton
import triton.language as tl

from ._utils import FP8_DTYPE, check_tensor, new_output, round_to, rows_launch, tile_rows
from .fp8 import check_q_dtype, quantize_fp8_rowwise_ref
from .layer_norm_modulate import (
    check_modulation,
    gather_modulation,
    layer_norm_modulate_ref,
    layer_norm_modulate_rows,
    load_mod,
    load_mod_rows,
    store_rows,
)


@triton.jit
def _residual_gate_kernel(
    RES, X, GATE, SHIFT, SCALE, MOD_ROW, RES_OUT, Y, Y_SCALE,
    stride_gate, stride_shift, stride_scale, rows_per_sample, M, N, eps,
    HAS_MOD_ROW: tl.constexpr, HAS_NORM: tl.constexpr, QUANT_FP8: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows, cols, mask = tile_rows(M, N, BLOCK_M, BLOCK_N)
    offs = rows[:, None] * N + cols[None, :]  # [BLOCK_M, BLOCK_N]
    g = load_mod_rows(MOD_ROW, rows, M, rows_per_sample, HAS_MOD_ROW)
    res = tl.load(RES + offs, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    gate = load_mod(GATE, g, stride_gate, cols, mask)
    dtype = RES_OUT.dtype.element_ty
    r = round_to(res + round_to(gate * x, dtype), dtype)  # fp32 holding a `dtype` value
    tl.store(RES_OUT + offs, r.to(dtype), mask=mask)
    if HAS_NORM:
        shift = load_mod(SHIFT, g, stride_shift, cols, mask)
        scale = load_mod(SCALE, g, stride_scale, cols, mask)
        y = layer_norm_modulate_rows(r, mask, shift, scale, N, eps, dtype)
        store_rows(Y, Y_SCALE, rows, M, N, cols, mask, y, QUANT_FP8)


def _check(residual, x):
    check_tensor("residual", residual, ndim=3)
    check_tensor("x", x, dtypes=(residual.dtype,), shape=residual.shape, device=residual.device)
    if not (residual.is_contiguous() and x.is_contiguous()):
        raise ValueError(f"residual and x must be contiguous, got strides {residual.stride()} and {x.stride()}")


def residual_gate(residual, x, gate, *, mod_row=None) -> torch.Tensor:
    """residual, x: [B, L, D]; gate: [B, D] (or [G, D] with mod_row: int [B*L]). Returns residual + gate * x."""
    _check(residual, x)
    check_modulation(residual, mod_row, gate=gate)
    res_out = new_output(residual.shape, residual.dtype, residual.device)
    _launch(residual, x, gate, None, None, mod_row, 0.0, res_out, None, None)
    return res_out


def residual_gate_layer_norm_modulate(residual, x, gate, shift, scale, *, mod_row=None, eps: float = 1e-6):
    """Returns (residual_out [B, L, D], layer_norm_modulate(residual_out, shift, scale) [B, L, D])."""
    _check(residual, x)
    check_modulation(residual, mod_row, gate=gate, shift=shift, scale=scale)
    res_out = new_output(residual.shape, residual.dtype, residual.device)
    y = new_output(residual.shape, residual.dtype, residual.device)
    _launch(residual, x, gate, shift, scale, mod_row, eps, res_out, y, None)
    return res_out, y


def residual_gate_layer_norm_modulate_fp8(
    residual, x, gate, shift, scale, *, mod_row=None, eps: float = 1e-6, q_dtype=FP8_DTYPE
):
    """Returns (residual_out [B, L, D], q [B*L, D], q_scale [B*L, 1]): the next GEMM's rowwise-FP8 operand."""
    _check(residual, x)
    check_modulation(residual, mod_row, gate=gate, shift=shift, scale=scale)
    check_q_dtype(q_dtype)
    b, l, d = residual.shape
    res_out = new_output(residual.shape, residual.dtype, residual.device)
    q = new_output((b * l, d), q_dtype, residual.device)
    s = new_output((b * l, 1), torch.float32, residual.device)
    _launch(residual, x, gate, shift, scale, mod_row, eps, res_out, q, s)
    return res_out, q, s


def _launch(residual, x, gate, shift, scale, mod_row, eps, res_out, y, y_scale):
    b, l, d = residual.shape
    if b * l == 0:
        return
    has_norm = shift is not None
    grid, settings = rows_launch(b * l, d)
    _residual_gate_kernel[grid](
        RES=residual, X=x, GATE=gate, SHIFT=shift, SCALE=scale, MOD_ROW=mod_row, RES_OUT=res_out, Y=y, Y_SCALE=y_scale,
        stride_gate=gate.stride(0), stride_shift=shift.stride(0) if has_norm else 0,
        stride_scale=scale.stride(0) if has_norm else 0, rows_per_sample=l, M=b * l, N=d, eps=eps,
        HAS_MOD_ROW=mod_row is not None, HAS_NORM=has_norm, QUANT_FP8=y_scale is not None, **settings,
    )


def residual_gate_ref(residual, x, gate, *, mod_row=None) -> torch.Tensor:
    """The semantics residual_gate must reproduce, with diffusers' casts."""
    return residual + gather_modulation(gate, residual, mod_row) * x


def residual_gate_layer_norm_modulate_ref(residual, x, gate, shift, scale, *, mod_row=None, eps: float = 1e-6):
    res_out = residual_gate_ref(residual, x, gate, mod_row=mod_row)
    return res_out, layer_norm_modulate_ref(res_out, shift, scale, mod_row=mod_row, eps=eps)


def residual_gate_layer_norm_modulate_fp8_ref(
    residual, x, gate, shift, scale, *, mod_row=None, eps: float = 1e-6, q_dtype=FP8_DTYPE
):
    res_out, y = residual_gate_layer_norm_modulate_ref(residual, x, gate, shift, scale, mod_row=mod_row, eps=eps)
    return (res_out, *quantize_fp8_rowwise_ref(y.reshape(-1, y.shape[-1]), q_dtype))
