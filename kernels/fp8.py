"""Rowwise FP8 (e4m3fn): per-row quantization and the scaled GEMM that consumes it.

Quantization of a row x: a = max(amax(|x|), 1e-12); scale = a / 448; q = e4m3(clamp(x * (448 / a), -448, 448))
(one division per row, not per element).
Activations are quantized per token (row of [M, K]), weights per output channel (row of [N, K]), and
fp8_linear computes (q_x * s_x) @ (q_w * s_w).T + bias with fp32 accumulation, as torchao's PerRow
`Float8DynamicActivationFloat8WeightConfig` does through the same `torch._scaled_mm`; the CPU makes the same call
to scaled_mm_cpu, which computes it alike and refuses what the CUDA op refuses.

`q_dtype=torch.float32` makes the kernels store the clamped pre-cast values instead of e4m3 codes: the Triton
interpreter mis-rounds fp32 -> fp8 near powers of two, so CPU tests check those values and the scales, and the
GPU tests check exact e4m3 codes.
"""

import torch
import triton
import triton.language as tl

from ._utils import (
    FLOAT_DTYPES, FP8_AMAX_EPS, FP8_DTYPE, FP8_MAX, TILE_ELEMENTS, check_tensor, chunk_cols, interpreted_fit,
    new_output, rows_launch, tile_rows,
)

Q_DTYPES = (FP8_DTYPE, torch.float32)


# Globals a @triton.jit function reads must be tl.constexpr.
_FP8_MAX = tl.constexpr(FP8_MAX)
_FP8_AMAX_EPS = tl.constexpr(FP8_AMAX_EPS)


@triton.jit
def fp8_quantize_rows(y):
    """y: [BLOCK_M, BLOCK_N] fp32 with masked lanes = 0. Returns (clamped y / scale, scale [BLOCK_M])."""
    inv, scale = fp8_row_scales(tl.max(tl.abs(y), axis=1))
    return fp8_apply_scale(y, inv), scale


@triton.jit
def fp8_row_scales(amax):
    """amax: [BLOCK_M] of |y| over whole rows. Returns (448 / a, a / 448) for a = max(amax, eps): what y is
    multiplied by before the cast, and the scale the GEMM takes. Rows held in chunks reduce their amax over the
    chunks first (tl.maximum of each chunk's), then scale each chunk with fp8_apply_scale."""
    amax = tl.maximum(amax, _FP8_AMAX_EPS)
    fp8_max = _FP8_MAX + 0.0 * amax  # [BLOCK_M]
    # IEEE divisions, as the reference's tensor / tensor (Triton's `/` is div.full.f32 on NVIDIA GPUs, 2 ulp)
    return tl.div_rn(fp8_max, amax), tl.div_rn(amax, fp8_max)


@triton.jit
def fp8_apply_scale(y, inv):
    """y: [BLOCK_M, BLOCK_N] fp32, inv [BLOCK_M] from fp8_row_scales -> the clamped values the e4m3 cast takes."""
    return tl.clamp(y * inv[:, None], -_FP8_MAX, _FP8_MAX)


@triton.jit
def fp8_store_chunk(Q, rows, M, N, c: tl.constexpr, CHUNK: tl.constexpr, y, inv):
    """Stores chunk c (chunk_cols) of rows [BLOCK_M] of a row-major [M, N] Q: y [BLOCK_M, CHUNK] scaled by inv."""
    cols, mask = chunk_cols(rows, M, N, c, CHUNK)
    tl.store(Q + rows[:, None] * N + cols[None, :], fp8_apply_scale(y, inv).to(Q.dtype.element_ty), mask=mask)


@triton.jit
def fp8_store_row_chunks(Q, S, rows, M, N, CHUNK: tl.constexpr, NUM_CHUNKS: tl.constexpr, y0, y1, y2, y3):
    """Whole rows [BLOCK_M] held as chunks y0..y3 [BLOCK_M, CHUNK] fp32 (chunked_rows_launch; masked lanes 0, the
    chunks past NUM_CHUNKS unread): their rowwise-FP8 codes into Q [M, N], their scales into S [M]."""
    amax = tl.max(tl.abs(y0), axis=1)
    if NUM_CHUNKS > 1:
        amax = tl.maximum(amax, tl.max(tl.abs(y1), axis=1))
    if NUM_CHUNKS > 2:
        amax = tl.maximum(amax, tl.max(tl.abs(y2), axis=1))
    if NUM_CHUNKS > 3:
        amax = tl.maximum(amax, tl.max(tl.abs(y3), axis=1))
    inv, scale = fp8_row_scales(amax)
    fp8_store_chunk(Q, rows, M, N, 0, CHUNK, y0, inv)
    if NUM_CHUNKS > 1:
        fp8_store_chunk(Q, rows, M, N, 1, CHUNK, y1, inv)
    if NUM_CHUNKS > 2:
        fp8_store_chunk(Q, rows, M, N, 2, CHUNK, y2, inv)
    if NUM_CHUNKS > 3:
        fp8_store_chunk(Q, rows, M, N, 3, CHUNK, y3, inv)
    tl.store(S + rows, scale, mask=rows < M)


@triton.jit
def _quantize_fp8_rowwise_kernel(X, Q, S, stride_x, stride_q, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows, cols, mask = tile_rows(M, N, BLOCK_M, BLOCK_N)
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    q, scale = fp8_quantize_rows(x)
    tl.store(Q + rows[:, None] * stride_q + cols[None, :], q.to(Q.dtype.element_ty), mask=mask)
    tl.store(S + rows, scale, mask=rows < M)


def check_q_dtype(q_dtype: torch.dtype):
    if q_dtype not in Q_DTYPES:
        raise ValueError(f"q_dtype={q_dtype}; allowed: {FP8_DTYPE} (e4m3 codes) or torch.float32 (pre-cast values)")


def quantize_fp8_rowwise(x: torch.Tensor, q_dtype: torch.dtype = FP8_DTYPE) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., N] float. Returns q [..., N] (q_dtype) and scale [..., 1] fp32, x ~= q * scale."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    check_q_dtype(q_dtype)
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    q = new_output(x2.shape, q_dtype, x.device)
    s = new_output((x2.shape[0], 1), torch.float32, x.device)
    if x2.shape[0]:
        grid, settings = rows_launch(x2.shape[0], n)
        _quantize_fp8_rowwise_kernel[grid](
            X=x2, Q=q, S=s, stride_x=x2.stride(0), stride_q=q.stride(0), M=x2.shape[0], N=n, **settings
        )
    return q.view(x.shape), s.view(*x.shape[:-1], 1)


def quantize_fp8_rowwise_ref(x: torch.Tensor, q_dtype: torch.dtype = FP8_DTYPE) -> tuple[torch.Tensor, torch.Tensor]:
    """The semantics quantize_fp8_rowwise must reproduce (pure PyTorch)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp_min(FP8_AMAX_EPS)
    # tensor / tensor: IEEE division on every device (CUDA multiplies by the reciprocal of a Python-number divisor)
    fp8_max = torch.full_like(amax, FP8_MAX)
    return (xf * (fp8_max / amax)).clamp(-FP8_MAX, FP8_MAX).to(q_dtype), amax / fp8_max


def dequantize_fp8_rowwise(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values that q [..., N] with scale [..., 1] stands for."""
    return q.float() * scale


# The fewest rows cuBLASLt's fast-accumulation kernels take: 1-40 rows fail at K=12288, N=3072, 63 and up pass
# (H200); fp8_linear pads fewer rows to this many.
FAST_ACCUM_MIN_ROWS = 64


def fp8_linear(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    fast_accum: bool = False,
) -> torch.Tensor:
    """x_q: [M, K] e4m3 with x_scale [M, 1] fp32 (per token); w_q: [N, K] e4m3 with w_scale [N] fp32 (per output
    channel); bias: [N] in out_dtype or None. Returns [M, N] out_dtype.

    One `torch._scaled_mm` call on every device (fp32 accumulate, both scales and the bias in its epilogue): on
    CUDA the op itself (a GPU without FP8 tensor cores raises), elsewhere through scaled_mm_cpu, which holds the
    call to what the CUDA op requires and computes it alike, so that CPU tests check the call the GPU gets.
    fast_accum: Hopper's faster FP8 accumulation (cuBLAS promotes partial sums to fp32 less often), as torchao's
    inference default; no effect on the CPU. Fewer than FAST_ACCUM_MIN_ROWS rows are padded with zero rows to that
    many, as cuBLASLt (torch 2.11, H200) has no fast-accumulation kernel for them at K=12288
    (CUBLAS_STATUS_NOT_SUPPORTED; a short prompt's text stream unpadded): a row is then accumulated alike at every
    row count, so a rank's part of the rows under Ulysses rounds as one GPU's whole (a threshold here put the two on
    either side of it). A GEMM that small reads its weights in the same time either way."""
    check_tensor("x_q", x_q, dtypes=(FP8_DTYPE,), ndim=2)
    m, k = x_q.shape
    check_tensor("x_scale", x_scale, dtypes=(torch.float32,), shape=(m, 1))
    check_tensor("w_q", w_q, dtypes=(FP8_DTYPE,), ndim=2)
    n = w_q.shape[0]
    if w_q.shape[1] != k:
        raise ValueError(f"w_q has shape {tuple(w_q.shape)}; its in-features must equal x_q's K={k}")
    check_tensor("w_scale", w_scale, dtypes=(torch.float32,), shape=(n,))
    if bias is not None:
        check_tensor("bias", bias, dtypes=(out_dtype,), shape=(n,))
    if k % 16 or n % 16:
        raise ValueError(f"torch._scaled_mm needs K and N divisible by 16, got K={k}, N={n}")
    if x_q.device.type == "cuda":
        if torch.cuda.get_device_capability(x_q.device) < (8, 9):
            name = torch.cuda.get_device_name(x_q.device)
            raise RuntimeError(f"fp8_linear needs FP8 tensor cores (compute capability >= 8.9); {name} has none. "
                               "Use the BF16 mode (fp8=False) on this GPU.")
        scaled_mm = torch._scaled_mm
    else:
        scaled_mm = scaled_mm_cpu
    if fast_accum and m < FAST_ACCUM_MIN_ROWS:  # zero rows below (on every device: CPU tests check this call)
        x_q, x_scale = pad_fp8_rows(x_q, x_scale, FAST_ACCUM_MIN_ROWS)
    # w_q.t() is the column-major [K, N] operand _scaled_mm wants; w_scale as [1, N] selects rowwise scaling.
    return scaled_mm(x_q, w_q.t(), scale_a=x_scale, scale_b=w_scale[None, :], bias=bias, out_dtype=out_dtype,
                     use_fast_accum=fast_accum)[:m]


@triton.jit
def _pad_fp8_rows_kernel(Q, S, QP, SP, stride_q, M, K, ROWS, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Q [M, K] (bytes) -> QP [ROWS, K] with zero rows below; S [M] -> SP [ROWS] with ones below. Programs tile
    (rows, columns); the first column tile also writes the scales."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    inside = cols[None, :] < K
    q = tl.load(Q + rows[:, None] * stride_q + cols[None, :], mask=inside & (rows[:, None] < M), other=0)
    tl.store(QP + rows[:, None] * K + cols[None, :], q, mask=inside & (rows[:, None] < ROWS))
    if tl.program_id(1) == 0:
        tl.store(SP + rows, tl.load(S + rows, mask=rows < M, other=1.0), mask=rows < ROWS)


def pad_fp8_rows(x_q: torch.Tensor, x_scale: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x_q [M, K] e4m3 and x_scale [M, 1] fp32 with rows - M zero rows (scale 1) below: one launch where
    torch.cat with zeros and ones takes four (each a few microseconds a GEMM's worth at a short prompt's text
    rows, which fp8_linear pads for every text linear of a block at batch 1)."""
    check_tensor("x_q", x_q, dtypes=(FP8_DTYPE,), ndim=2)
    m, k = x_q.shape
    check_tensor("x_scale", x_scale, dtypes=(torch.float32,), shape=(m, 1))
    if rows < m:
        raise ValueError(f"pad_fp8_rows: rows={rows} is fewer than x_q's {m}")
    q = new_output((rows, k), FP8_DTYPE, x_q.device)
    s = new_output((rows, 1), torch.float32, x_q.device)
    x_scale = x_scale.contiguous()
    block_k = interpreted_fit(2048, k)
    block_m = interpreted_fit(max(1, TILE_ELEMENTS // 4 // block_k), rows)
    grid = (triton.cdiv(rows, block_m), triton.cdiv(k, block_k))
    # e4m3 as bytes: the copy moves codes, and the interpreter has no float8 loads to trust
    _pad_fp8_rows_kernel[grid](x_q.view(torch.uint8), x_scale, q.view(torch.uint8), s, x_q.stride(0), m, k, rows,
                               BLOCK_M=block_m, BLOCK_K=block_k)
    return q, s


def pad_fp8_rows_ref(x_q: torch.Tensor, x_scale: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The semantics pad_fp8_rows must reproduce (pure PyTorch)."""
    m, k = x_q.shape
    return (torch.cat([x_q, x_q.new_zeros(rows - m, k)]), torch.cat([x_scale, x_scale.new_ones(rows - m, 1)]))


def scaled_mm_cpu(a, b, scale_a, scale_b, bias=None, out_dtype=torch.bfloat16, use_fast_accum=False) -> torch.Tensor:
    """torch._scaled_mm's rowwise-scaled e4m3 product for CPU tensors, refusing what the CUDA op refuses (Hopper's
    cuBLASLt): e4m3 operands, a [M, K] row-major and b [K, N] column-major, K and N multiples of 16, scale_a [M, 1]
    and scale_b [1, N] contiguous fp32 (rowwise scaling), bias [N] in out_dtype. fp32 accumulation of the exact
    e4m3 products; both scales and the bias in the epilogue; one cast. use_fast_accum changes nothing here.
    Not torch's CPU op: on CPUs with AMX it goes to oneDNN, which (torch 2.11) asserts on rowwise scales. Not held:
    CUDA takes no bias with an fp32 output (CPU tests run fp32 models in FP8 mode with one)."""
    m, k = a.shape
    n = b.shape[1]
    if a.dtype != FP8_DTYPE or b.dtype != FP8_DTYPE:
        raise ValueError(f"_scaled_mm operands are {a.dtype} and {b.dtype}; fp8_linear's call takes {FP8_DTYPE}")
    if b.shape[0] != k:
        raise ValueError(f"_scaled_mm cannot multiply a {tuple(a.shape)} by b {tuple(b.shape)}")
    if a.stride(1) != 1 or b.stride(0) != 1:
        raise ValueError(f"_scaled_mm needs a row-major and b column-major, got strides {a.stride()} and {b.stride()}")
    if k % 16 or n % 16:
        raise ValueError(f"_scaled_mm needs K and N divisible by 16, got K={k}, N={n}")
    for name, scale, shape in (("scale_a", scale_a, (m, 1)), ("scale_b", scale_b, (1, n))):
        if scale.dtype != torch.float32 or scale.shape != shape or not scale.is_contiguous():
            raise ValueError(f"rowwise scaling takes {name} {shape} contiguous fp32, got {tuple(scale.shape)} "
                             f"{scale.dtype} strides {scale.stride()}")
    if bias is not None and (bias.dtype != out_dtype or bias.shape != (n,)):
        raise ValueError(f"_scaled_mm's bias must be ({n},) {out_dtype}, got {tuple(bias.shape)} {bias.dtype}")
    out = (a.float() @ b.float()) * scale_a * scale_b  # [M, N]
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def fp8_linear_ref(x_q, x_scale, w_q, w_scale, bias=None, out_dtype=torch.bfloat16) -> torch.Tensor:
    """The semantics fp8_linear must reproduce: dequantize both operands and multiply in fp32."""
    out = dequantize_fp8_rowwise(x_q, x_scale) @ dequantize_fp8_rowwise(w_q, w_scale[:, None]).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)
