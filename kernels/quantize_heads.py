"""FP8 quantization of an attention operand per (sample, head) or per tensor: x [B, S, H, D] -> e4m3 codes and
scales [B, H] (x ~= code * scale), the amax taken over each sample's first `valid[b]` rows only (a padded key's
value is never attended: its row is quantized with the same scale, clamped).

Three launches, each over the whole operand or less: the amax of each (sample, row chunk, head) (partials
[B, H, C]), the scales from them (one program; per tensor: every [B, H] entry the same), the quantization.
scale = max(amax, 1e-12) / 448, code = e4m3(clamp(x * (1 / scale), +-448)).
"""

import torch
import triton
import triton.language as tl

from ._utils import FLOAT_DTYPES, FP8_AMAX_EPS, FP8_DTYPE, FP8_MAX, TILE_ELEMENTS, check_tensor, head_block, new_output
from .fp8 import check_q_dtype

_FP8_MAX = tl.constexpr(FP8_MAX)
_FP8_AMAX_EPS = tl.constexpr(FP8_AMAX_EPS)
CHUNK_ROWS = 64  # rows of one amax partial: [B, H, S / 64] partials, read whole by the scales program
AMAX_TILE = 4  # the amax programs' tiles: 4x the elementwise tile (8 rows x 8 heads x 128 on a GPU), 8 warps


@triton.jit
def _amax_partials_kernel(X, VALID, P, S, H, n_chunks, stride_b, stride_s, HEAD_DIM: tl.constexpr,
                          CHUNK: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    b, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    heads = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_D)
    valid = tl.load(VALID + b)
    amax = tl.zeros([BLOCK_H], dtype=tl.float32)
    for start in range(0, CHUNK, BLOCK_S):
        rows = chunk * CHUNK + start + tl.arange(0, BLOCK_S)
        mask = (((rows < valid) & (rows < S))[:, None, None] & (heads[None, :, None] < H)
                & (cols[None, None, :] < HEAD_DIM))
        ptrs = X + b * stride_b + rows[:, None, None] * stride_s + heads[None, :, None] * HEAD_DIM + cols[None, None, :]
        x = tl.abs(tl.load(ptrs, mask=mask, other=0.0).to(tl.float32))
        amax = tl.maximum(amax, tl.max(tl.max(x, axis=2), axis=0))
    tl.store(P + (b * H + heads) * n_chunks + chunk, amax, mask=heads < H)


@triton.jit
def _scales_kernel(P, SC, n_rows, n_chunks, PER_TENSOR: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """P [n_rows = B * H, n_chunks] -> SC [n_rows]: each row's amax (or all rows', PER_TENSOR) / 448."""
    cols = tl.arange(0, BLOCK_C)
    total = tl.zeros([BLOCK_R], dtype=tl.float32)
    for start in range(0, n_rows, BLOCK_R):
        rows = start + tl.arange(0, BLOCK_R)
        p = tl.load(P + rows[:, None] * n_chunks + cols[None, :],
                    mask=(rows[:, None] < n_rows) & (cols[None, :] < n_chunks), other=0.0)
        amax = tl.maximum(tl.max(p, axis=1), _FP8_AMAX_EPS)
        if PER_TENSOR:
            total = tl.maximum(total, amax)
        else:
            tl.store(SC + rows, tl.div_rn(amax, _FP8_MAX + 0.0 * amax), mask=rows < n_rows)
    if PER_TENSOR:
        amax = tl.max(total, axis=0)
        for start in range(0, n_rows, BLOCK_R):
            rows = start + tl.arange(0, BLOCK_R)
            fp8_max = _FP8_MAX + 0.0 * rows
            tl.store(SC + rows, tl.div_rn(amax + 0.0 * rows, fp8_max), mask=rows < n_rows)


@triton.jit
def _quantize_kernel(X, SC, Q, S, H, stride_b, stride_s, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    heads = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows[:, None, None] < S) & (heads[None, :, None] < H) & (cols[None, None, :] < HEAD_DIM)
    offsets = b * stride_b + rows[:, None, None] * stride_s + heads[None, :, None] * HEAD_DIM + cols[None, None, :]
    x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(SC + b * H + heads, mask=heads < H, other=1.0)
    inv = tl.div_rn(1.0 + 0.0 * scale, scale)  # IEEE, as the reference's
    q = tl.clamp(x * inv[None, :, None], -_FP8_MAX, _FP8_MAX)
    tl.store(Q + offsets, q.to(Q.dtype.element_ty), mask=mask)


def _check(x, valid, per_tensor):
    check_tensor("x", x, dtypes=FLOAT_DTYPES, ndim=4)
    if not x.is_contiguous():
        raise ValueError(f"x must be contiguous [B, S, H, D], got strides {x.stride()}")
    b, s = x.shape[:2]
    check_tensor("valid", valid, dtypes=(torch.int32,), shape=(b,), device=x.device)
    if not isinstance(per_tensor, bool):
        raise TypeError(f"per_tensor must be a bool, got {per_tensor!r}")


def quantize_fp8_heads(x: torch.Tensor, valid: torch.Tensor, per_tensor: bool,
                       q_dtype: torch.dtype = FP8_DTYPE) -> tuple[torch.Tensor, torch.Tensor]:
    """x: contiguous [B, S, H, D] float; valid: int32 [B], the rows of each sample that count (the others are
    quantized, not measured). Returns codes [B, S, H, D] (q_dtype: FP8, or float32 for the values before the cast)
    and scales fp32 [B, H] (per_tensor: all equal)."""
    _check(x, valid, per_tensor)
    check_q_dtype(q_dtype)
    b, s, h, d = x.shape
    q = new_output(x.shape, q_dtype, x.device)
    scales = new_output((b, h), torch.float32, x.device)
    if x.numel() == 0:
        return q, scales.fill_(FP8_AMAX_EPS / FP8_MAX)
    block_h, block_d = head_block(h), triton.next_power_of_2(d)
    block_s = max(1, TILE_ELEMENTS // (block_h * block_d))
    amax_rows = max(1, AMAX_TILE * TILE_ELEMENTS // (block_h * block_d))
    chunk = max(CHUNK_ROWS, amax_rows)
    n_chunks = triton.cdiv(s, chunk)
    partials = torch.empty(b, h, n_chunks, dtype=torch.float32, device=x.device)
    _amax_partials_kernel[(b, n_chunks, triton.cdiv(h, block_h))](
        X=x, VALID=valid, P=partials, S=s, H=h, n_chunks=n_chunks, stride_b=x.stride(0), stride_s=x.stride(1),
        HEAD_DIM=d, CHUNK=chunk, BLOCK_S=amax_rows, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=8)
    block_c = triton.next_power_of_2(n_chunks)
    _scales_kernel[(1,)](P=partials, SC=scales, n_rows=b * h, n_chunks=n_chunks, PER_TENSOR=per_tensor,
                         BLOCK_R=max(1, min(64, TILE_ELEMENTS // block_c)), BLOCK_C=block_c)
    _quantize_kernel[(b, triton.cdiv(s, block_s), triton.cdiv(h, block_h))](
        X=x, SC=scales, Q=q, S=s, H=h, stride_b=x.stride(0), stride_s=x.stride(1), HEAD_DIM=d, BLOCK_S=block_s,
        BLOCK_H=block_h, BLOCK_D=block_d)
    return q, scales


def quantize_fp8_heads_ref(x: torch.Tensor, valid: torch.Tensor, per_tensor: bool,
                           q_dtype: torch.dtype = FP8_DTYPE) -> tuple[torch.Tensor, torch.Tensor]:
    """The semantics quantize_fp8_heads must reproduce (pure PyTorch)."""
    _check(x, valid, per_tensor)
    b, s, h, d = x.shape
    counted = torch.arange(s, device=x.device)[None, :] < valid[:, None]  # [B, S]
    counted_abs = torch.where(counted[:, :, None, None], x.float().abs(), 0.0)
    amax = counted_abs.amax(dim=(1, 3)) if s else x.new_zeros(b, h, dtype=torch.float32)
    amax = amax.clamp_min(FP8_AMAX_EPS)
    if per_tensor:
        amax = amax.max().expand(b, h)
    # tensor / tensor: IEEE division on every device (CUDA multiplies by the reciprocal of a Python-number divisor)
    scales = amax / torch.full_like(amax, FP8_MAX)
    inv = torch.ones_like(scales) / scales
    q = (x.float() * inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(q_dtype)
    return q, scales.contiguous()
