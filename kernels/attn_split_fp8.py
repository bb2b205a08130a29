"""Split the joint attention output into its two streams and quantize each to rowwise FP8.

o: [B, S, D] (D = heads * head_dim) holds, per sample, the first stream in rows [0, split) and the second in
[split, S). Returns each stream's rows as [B * len, D] e4m3 with fp32 per-row scales, the operands of the two
output projections (`to_add_out` for text, `to_out.0` for image in diffusers `QwenDoubleStreamAttnProcessor2_0`,
which slices `joint_hidden_states[:, :seq_txt]` / `[:, seq_txt:]`). One pass: o is read once, never copied.

With o_scale, o already holds e4m3 codes with that one scale (an FP8 attention's output): each stream's rows are
its codes as they are, every row's scale o_scale (the two copies and the two scale vectors in one launch).
"""

import torch
import triton
import triton.language as tl

from ._utils import FLOAT_DTYPES, FP8_DTYPE, check_tensor, new_output, rows_launch, tile_rows
from .fp8 import check_q_dtype, fp8_quantize_rows, quantize_fp8_rowwise_ref


@triton.jit
def _attn_split_fp8_kernel(O, O_SCALE, Q1, S1, Q2, S2, seq_len, split, M, N, CODES: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows, cols, mask = tile_rows(M, N, BLOCK_M, BLOCK_N)
    b = rows // seq_len
    t = rows % seq_len
    if CODES:  # O, Q1, Q2 as bytes: the codes copied, the one scale on every row
        q = tl.load(O + rows[:, None] * N + cols[None, :], mask=mask, other=0)
        scale = tl.load(O_SCALE + 0 * rows)
    else:
        o = tl.load(O + rows[:, None] * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        q, scale = fp8_quantize_rows(o)
    first = t < split  # [BLOCK_M]: which stream each row goes to
    row1 = b * split + t  # the row's index in the first stream's output
    row2 = b * (seq_len - split) + t - split
    in_bounds = rows < M
    tl.store(Q1 + row1[:, None] * N + cols[None, :], q.to(Q1.dtype.element_ty), mask=mask & first[:, None])
    tl.store(S1 + row1, scale, mask=in_bounds & first)
    tl.store(Q2 + row2[:, None] * N + cols[None, :], q.to(Q2.dtype.element_ty), mask=mask & ~first[:, None])
    tl.store(S2 + row2, scale, mask=in_bounds & ~first)


def attn_split_fp8(o: torch.Tensor, split: int, q_dtype=FP8_DTYPE, o_scale: torch.Tensor | None = None):
    """o: [B, S, D] or [B, S, H, Dh], contiguous. Returns (q1 [B*split, D], s1 [B*split, 1],
    q2 [B*(S-split), D], s2 [B*(S-split), 1]). o_scale: fp32 [1], o e4m3 codes with that scale (module docstring)."""
    check_tensor("o", o, dtypes=FLOAT_DTYPES if o_scale is None else (FP8_DTYPE,), ndim=(3, 4))
    check_q_dtype(q_dtype)
    if o_scale is not None:
        check_tensor("o_scale", o_scale, dtypes=(torch.float32,), shape=(1,), device=o.device)
        if q_dtype != FP8_DTYPE:
            raise ValueError(f"q_dtype={q_dtype} with o_scale: the codes are copied as they are ({FP8_DTYPE})")
    if not o.is_contiguous():
        raise ValueError(f"o must be contiguous, got shape {tuple(o.shape)} strides {o.stride()}")
    b, s = o.shape[:2]
    if not 0 <= split <= s:
        raise ValueError(f"split={split} must lie in [0, S={s}]")
    o = o.reshape(b, s, -1)
    d = o.shape[-1]
    q1 = new_output((b * split, d), q_dtype, o.device)
    s1 = new_output((b * split, 1), torch.float32, o.device)
    q2 = new_output((b * (s - split), d), q_dtype, o.device)
    s2 = new_output((b * (s - split), 1), torch.float32, o.device)
    if b * s:
        codes = o_scale is not None
        as_bytes = (lambda t: t.view(torch.uint8)) if codes else (lambda t: t)  # the interpreter has no e4m3 loads
        grid, settings = rows_launch(b * s, d)
        _attn_split_fp8_kernel[grid](O=as_bytes(o), O_SCALE=o_scale, Q1=as_bytes(q1), S1=s1, Q2=as_bytes(q2), S2=s2,
                                     seq_len=s, split=split, M=b * s, N=d, CODES=codes, **settings)
    return q1, s1, q2, s2


def attn_split_fp8_ref(o: torch.Tensor, split: int, q_dtype=FP8_DTYPE, o_scale: torch.Tensor | None = None):
    """The semantics attn_split_fp8 must reproduce (pure PyTorch)."""
    o = o.reshape(*o.shape[:2], -1)
    parts = (o[:, :split].reshape(-1, o.shape[-1]), o[:, split:].reshape(-1, o.shape[-1]))
    if o_scale is not None:
        return tuple(t for part in parts for t in (part, o_scale.expand(part.shape[0], 1).contiguous()))
    return tuple(t for part in parts for t in quantize_fp8_rowwise_ref(part, q_dtype))
