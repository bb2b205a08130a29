"""Gated residual add, optionally fused with the next LayerNorm + modulation (+ rowwise FP8 quantization).

residual_out = residual + gate[g] * x, with diffusers' casts (`hidden_states + img_gate1 * img_attn_output`: the
product rounds to the residual's dtype, then the sum does). The fused forms continue on residual_out with
layer_norm_modulate (kernels/layer_norm_modulate.py): after attention that is norm2 + mod2 of the same block,
after the MLP it is norm1 + mod1 of the next block, so each residual row is read once and written once.
g is the token's sample, or mod_row[row] (zero_cond_t), as in layer_norm_modulate.

Two optional terms, each rounded as its torch expression is, let one pass replace three where x itself is a sum:
- prior=(x0, gate0): residual first becomes residual + gate0[g] * x0 (an earlier gated add still pending);
- x_term=(f, c): x becomes x + f * c, c a device scalar [1] (the last term of a sum like a Taylor extrapolation's,
  `x + f * c[0]`: the product rounds to x's dtype, then the sum does).
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
    RES, X, GATE, PRIOR, PRIOR_GATE, TERM, TERM_COEF, SHIFT, SCALE, MOD_ROW, RES_OUT, Y, Y_SCALE,
    stride_gate, stride_prior_gate, stride_shift, stride_scale, rows_per_sample, M, N, eps,
    HAS_MOD_ROW: tl.constexpr, HAS_PRIOR: tl.constexpr, HAS_TERM: tl.constexpr, HAS_NORM: tl.constexpr,
    QUANT_FP8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows, cols, mask = tile_rows(M, N, BLOCK_M, BLOCK_N)
    offs = rows[:, None] * N + cols[None, :]  # [BLOCK_M, BLOCK_N]
    g = load_mod_rows(MOD_ROW, rows, M, rows_per_sample, HAS_MOD_ROW)
    dtype = RES_OUT.dtype.element_ty
    res = tl.load(RES + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_PRIOR:
        x0 = tl.load(PRIOR + offs, mask=mask, other=0.0).to(tl.float32)
        gate0 = load_mod(PRIOR_GATE, g, stride_prior_gate, cols, mask)
        res = round_to(res + round_to(gate0 * x0, dtype), dtype)
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_TERM:
        f = tl.load(TERM + offs, mask=mask, other=0.0).to(tl.float32)
        c = tl.load(TERM_COEF).to(tl.float32)
        x = round_to(x + round_to(f * c, dtype), dtype)
    gate = load_mod(GATE, g, stride_gate, cols, mask)
    r = round_to(res + round_to(gate * x, dtype), dtype)  # fp32 holding a `dtype` value
    tl.store(RES_OUT + offs, r.to(dtype), mask=mask)
    if HAS_NORM:
        shift = load_mod(SHIFT, g, stride_shift, cols, mask)
        scale = load_mod(SCALE, g, stride_scale, cols, mask)
        y = layer_norm_modulate_rows(r, mask, shift, scale, N, eps, dtype)
        store_rows(Y, Y_SCALE, rows, M, N, cols, mask, y, QUANT_FP8)


def _check(residual, x, prior, x_term) -> dict:
    """Validate the streams; returns the gates to check as modulation tables."""
    check_tensor("residual", residual, ndim=3)
    streams = {"x": x} | ({} if prior is None else {"prior[0]": prior[0]}) | (
        {} if x_term is None else {"x_term[0]": x_term[0]})
    for name, t in streams.items():
        check_tensor(name, t, dtypes=(residual.dtype,), shape=residual.shape, device=residual.device)
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")
    if not residual.is_contiguous():
        raise ValueError(f"residual must be contiguous, got strides {residual.stride()}")
    if x_term is not None:
        check_tensor("x_term[1]", x_term[1], dtypes=(torch.float32,), shape=(1,), device=residual.device)
    return {} if prior is None else {"prior[1]": prior[1]}


def residual_gate(residual, x, gate, *, mod_row=None, prior=None, x_term=None) -> torch.Tensor:
    """residual, x: [B, L, D]; gate: [B, D] (or [G, D] with mod_row: int [B*L]). Returns residual + gate * x.
    prior: (x0 [B, L, D], gate0 [G, D]), added to residual first; x_term: (f [B, L, D], c fp32 [1]), added to x."""
    gates = _check(residual, x, prior, x_term)
    check_modulation(residual, mod_row, gate=gate, **gates)
    res_out = new_output(residual.shape, residual.dtype, residual.device)
    _launch(residual, x, gate, prior, x_term, None, None, mod_row, 0.0, res_out, None, None)
    return res_out


def residual_gate_layer_norm_modulate(residual, x, gate, shift, scale, *, mod_row=None, eps: float = 1e-6,
                                      prior=None, x_term=None):
    """Returns (residual_out [B, L, D], layer_norm_modulate(residual_out, shift, scale) [B, L, D])."""
    gates = _check(residual, x, prior, x_term)
    check_modulation(residual, mod_row, gate=gate, shift=shift, scale=scale, **gates)
    res_out = new_output(residual.shape, residual.dtype, residual.device)
    y = new_output(residual.shape, residual.dtype, residual.device)
    _launch(residual, x, gate, prior, x_term, shift, scale, mod_row, eps, res_out, y, None)
    return res_out, y


def residual_gate_layer_norm_modulate_fp8(
    residual, x, gate, shift, scale, *, mod_row=None, eps: float = 1e-6, q_dtype=FP8_DTYPE, prior=None, x_term=None
):
    """Returns (residual_out [B, L, D], q [B*L, D], q_scale [B*L, 1]): the next GEMM's rowwise-FP8 operand."""
    gates = _check(residual, x, prior, x_term)
    check_modulation(residual, mod_row, gate=gate, shift=shift, scale=scale, **gates)
    check_q_dtype(q_dtype)
    b, l, d = residual.shape
    res_out = new_output(residual.shape, residual.dtype, residual.device)
    q = new_output((b * l, d), q_dtype, residual.device)
    s = new_output((b * l, 1), torch.float32, residual.device)
    _launch(residual, x, gate, prior, x_term, shift, scale, mod_row, eps, res_out, q, s)
    return res_out, q, s


def _launch(residual, x, gate, prior, x_term, shift, scale, mod_row, eps, res_out, y, y_scale):
    b, l, d = residual.shape
    if b * l == 0:
        return
    has_norm = shift is not None
    prior, prior_gate = (None, None) if prior is None else prior
    term, term_coef = (None, None) if x_term is None else x_term
    grid, settings = rows_launch(b * l, d)
    _residual_gate_kernel[grid](
        RES=residual, X=x, GATE=gate, PRIOR=prior, PRIOR_GATE=prior_gate, TERM=term, TERM_COEF=term_coef,
        SHIFT=shift, SCALE=scale, MOD_ROW=mod_row, RES_OUT=res_out, Y=y, Y_SCALE=y_scale,
        stride_gate=gate.stride(0), stride_prior_gate=0 if prior is None else prior_gate.stride(0),
        stride_shift=shift.stride(0) if has_norm else 0, stride_scale=scale.stride(0) if has_norm else 0,
        rows_per_sample=l, M=b * l, N=d, eps=eps, HAS_MOD_ROW=mod_row is not None, HAS_PRIOR=prior is not None,
        HAS_TERM=term is not None, HAS_NORM=has_norm, QUANT_FP8=y_scale is not None, **settings,
    )


def residual_gate_ref(residual, x, gate, *, mod_row=None, prior=None, x_term=None) -> torch.Tensor:
    """The semantics residual_gate must reproduce, with diffusers' casts (each step as torch rounds it)."""
    if prior is not None:
        residual = residual_gate_ref(residual, prior[0], prior[1], mod_row=mod_row)
    if x_term is not None:
        x = x + x_term[0] * x_term[1][0]  # a 0-dim fp32 factor: the product stays in x's dtype
    return residual + gather_modulation(gate, residual, mod_row) * x


def residual_gate_layer_norm_modulate_ref(residual, x, gate, shift, scale, *, mod_row=None, eps: float = 1e-6,
                                          prior=None, x_term=None):
    res_out = residual_gate_ref(residual, x, gate, mod_row=mod_row, prior=prior, x_term=x_term)
    return res_out, layer_norm_modulate_ref(res_out, shift, scale, mod_row=mod_row, eps=eps)


def residual_gate_layer_norm_modulate_fp8_ref(
    residual, x, gate, shift, scale, *, mod_row=None, eps: float = 1e-6, q_dtype=FP8_DTYPE, prior=None, x_term=None
):
    res_out, y = residual_gate_layer_norm_modulate_ref(residual, x, gate, shift, scale, mod_row=mod_row, eps=eps,
                                                       prior=prior, x_term=x_term)
    return (res_out, *quantize_fp8_rowwise_ref(y.reshape(-1, y.shape[-1]), q_dtype))
