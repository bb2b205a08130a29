"""Two attention outputs over disjoint key sets merged into the attention over their union, written as the next
linear's operand: rowwise FP8 codes and scales, or the model's dtype.

Attention of a query row over keys K1 u K2, from the parts over K1 and K2 (o_i their outputs, l_i = log sum exp of
their scaled scores, a kernel's softmax_lse):
    m = max(l1, l2),  w_i = exp(l_i - m),  o = o1 * (w1 / (w1 + w2)) + o2 * (w2 / (w1 + w2))
per (row, head), in fp32. o is rounded to the parts' dtype (what one attention call over the union would have
written), then, for an FP8 consumer, each token row (all heads, H * D values) is quantized as fp8.py's
quantize_fp8_rowwise does. A part whose weight is 0 (every key of it masked: its l is -inf) adds nothing, whatever
its output holds. l1 must be finite (the first part's keys are never all masked).

One program per BLOCK_M token rows (1 at the real widths: a 32 x 128 row of each part, 16 values a thread at 8
warps); the log-sum-exps [B, H, S] are read with a stride of S per head (H floats a row, a small part of the bytes).
"""

import torch
import triton
import triton.language as tl

from ._utils import FLOAT_DTYPES, FP8_MAX, TILE_ELEMENTS, check_tensor, interpreted_fit, round_to
from .fp8 import Q_DTYPES, check_q_dtype, fp8_row_scales

_FP8_MAX = tl.constexpr(FP8_MAX)


@triton.jit
def _merge_attention_kernel(O1, L1, O2, L2, OUT, SC, S, H, n_rows, s_o1b, s_o1s, s_o2b, s_o2s, s_outb, s_outs, s_scb,
                            s_scs, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
                            BLOCK_D: tl.constexpr, FP8: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # flat (sample, token)
    b, s = rows // S, rows % S
    heads, cols = tl.arange(0, BLOCK_H), tl.arange(0, BLOCK_D)
    row_head = (rows < n_rows)[:, None] & (heads < H)[None, :]  # [BLOCK_M, BLOCK_H]
    lse_at = (b[:, None] * H + heads[None, :]) * S + s[:, None]
    l1 = tl.load(L1 + lse_at, mask=row_head, other=0.0)
    l2 = tl.load(L2 + lse_at, mask=row_head, other=float("-inf"))
    m = tl.maximum(l1, l2)
    w1, w2 = tl.exp(l1 - m), tl.exp(l2 - m)
    total = w1 + w2
    f1, f2 = tl.div_rn(w1, total), tl.div_rn(w2, total)  # IEEE, as the reference's tensor / tensor
    mask = row_head[:, :, None] & (cols < HEAD_DIM)[None, None, :]
    within = heads[None, :, None] * HEAD_DIM + cols[None, None, :]
    o1 = tl.load(O1 + b[:, None, None] * s_o1b + s[:, None, None] * s_o1s + within, mask=mask, other=0.0)
    o2 = tl.load(O2 + b[:, None, None] * s_o2b + s[:, None, None] * s_o2s + within, mask=mask, other=0.0)
    o = o1.to(tl.float32) * f1[:, :, None]
    o = tl.where((f2 > 0)[:, :, None], o + o2.to(tl.float32) * f2[:, :, None], o)  # a masked part's output unread
    o = round_to(o, O1.dtype.element_ty)  # the dtype one attention call over the union writes
    out_at = OUT + b[:, None, None] * s_outb + s[:, None, None] * s_outs + within
    if FP8:
        inv, scale = fp8_row_scales(tl.max(tl.max(tl.abs(o), axis=2), axis=1))
        q = tl.clamp(o * inv[:, None, None], -_FP8_MAX, _FP8_MAX)  # fp8.py's fp8_apply_scale on [M, H, D]
        tl.store(out_at, q.to(OUT.dtype.element_ty), mask=mask)
        tl.store(SC + b * s_scb + s * s_scs, scale, mask=rows < n_rows)
    else:
        tl.store(out_at, o.to(OUT.dtype.element_ty), mask=mask)


def _check(o1, lse1, o2, lse2, out, scale):
    check_tensor("o1", o1, dtypes=FLOAT_DTYPES, ndim=4)
    b, s, h, d = o1.shape
    check_tensor("o2", o2, dtypes=(o1.dtype,), shape=o1.shape, device=o1.device)
    for name, t in (("o1", o1), ("o2", o2)):
        if t.stride(2) != d:
            raise ValueError(f"{name} must have contiguous heads [H, D] in each row, got strides {t.stride()}")
    for name, t in (("lse1", lse1), ("lse2", lse2)):
        check_tensor(name, t, dtypes=(torch.float32,), shape=(b, h, s), device=o1.device)
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous [B, H, S], got strides {t.stride()}")
    check_tensor("out", out, shape=(b, s, h * d), device=o1.device)
    if scale is None:
        if out.dtype != o1.dtype:
            raise ValueError(f"out has dtype {out.dtype}; without a scale tensor it takes the parts' {o1.dtype}")
    else:
        check_q_dtype(out.dtype)
        check_tensor("scale", scale, dtypes=(torch.float32,), shape=(b, s), device=o1.device)


def merge_attention(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor, out: torch.Tensor,
                    scale: torch.Tensor | None = None) -> None:
    """o1, o2: [B, S, H, D] bf16, fp16 or fp32 (any sample and token strides, each row's heads contiguous); lse1, lse2:
    fp32 [B, H, S] contiguous, natural log. Writes the merged attention (module docstring) into out [B, S, H * D]
    (any sample and token strides, last dim contiguous): with scale (fp32 [B, S], any strides) as rowwise FP8
    (out's dtype: e4m3, or fp32 for the clamped pre-cast values, as quantize_fp8_rowwise's q_dtype), else in the
    parts' dtype."""
    _check(o1, lse1, o2, lse2, out, scale)
    b, s, h, d = o1.shape
    if not b * s:
        return
    block_h, block_d = triton.next_power_of_2(h), triton.next_power_of_2(d)
    block_m = interpreted_fit(max(1, TILE_ELEMENTS // (block_h * block_d)), b * s)
    width = block_h * block_d
    fp8 = scale is not None
    _merge_attention_kernel[(triton.cdiv(b * s, block_m),)](
        o1, lse1, o2, lse2, out, scale if fp8 else out, s, h, b * s, o1.stride(0), o1.stride(1), o2.stride(0),
        o2.stride(1), out.stride(0), out.stride(1), scale.stride(0) if fp8 else 0, scale.stride(1) if fp8 else 0,
        HEAD_DIM=d, BLOCK_M=block_m, BLOCK_H=block_h, BLOCK_D=block_d, FP8=fp8,
        num_warps=4 if width <= 2048 else 8 if width <= 8192 else 16)


def merge_attention_ref(o1, lse1, o2, lse2, q_dtype: torch.dtype | None = None):
    """The semantics merge_attention must reproduce (pure PyTorch): the merged [B, S, H * D] in o1's dtype, or with
    q_dtype (Q_DTYPES) its rowwise-FP8 (codes [B, S, H * D], scales [B, S])."""
    from .fp8 import quantize_fp8_rowwise_ref

    l1, l2 = (lse.transpose(1, 2)[..., None] for lse in (lse1, lse2))  # [B, S, H, 1]
    m = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
    f1, f2 = w1 / (w1 + w2), w2 / (w1 + w2)
    o = o1.float() * f1
    o = torch.where(f2 > 0, o + o2.float() * f2, o).to(o1.dtype).flatten(2)
    if q_dtype is None:
        return o
    if q_dtype not in Q_DTYPES:
        raise ValueError(f"q_dtype={q_dtype}; allowed: {Q_DTYPES}")
    q, scale = quantize_fp8_rowwise_ref(o, q_dtype)
    return q, scale[..., 0]
