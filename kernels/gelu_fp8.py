"""GELU (tanh approximation) + rowwise FP8 quantization of the MLP hidden, the operand of the second MLP GEMM.

y = gelu_tanh(h) = h * sigmoid(2 * sqrt(2/pi) * (h + 0.044715 h^3)), rounded to h's dtype as
`F.gelu(h, approximate="tanh")` returns it (diffusers `FeedForward(activation_fn="gelu-approximate")`), then
quantized per row (kernels/fp8.py). h * sigmoid(2u) equals 0.5 h (1 + tanh(u)) and needs no libdevice tanh.
"""

import math

import torch
import triton
import triton.language as tl

from ._utils import FLOAT_DTYPES, FP8_DTYPE, check_tensor, chunk_cols, chunked_rows_launch, new_output, round_to
from .fp8 import check_q_dtype, fp8_store_row_chunks, quantize_fp8_rowwise_ref

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
# exp(-2u) as exp2(GELU_EXP2 * (h + 0.044715 h^3)): the constants folded into one multiply (tl.exp is exp2 of x *
# log2(e) on NVIDIA GPUs; this kernel is bound by its arithmetic nearly as much as by its bytes)
GELU_EXP2 = -2.0 * SQRT_2_OVER_PI * math.log2(math.e)


@triton.jit
def _gelu_chunk(H, rows, stride_h, M, N, c: tl.constexpr, CHUNK: tl.constexpr, GELU_EXP2: tl.constexpr):
    """gelu_tanh of chunk c of the rows, rounded to H's dtype, as fp32 [BLOCK_M, CHUNK] (masked lanes 0)."""
    cols, mask = chunk_cols(rows, M, N, c, CHUNK)
    h = tl.load(H + rows[:, None] * stride_h + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    # h * sigmoid(2u) with a fast division: an IEEE division per element would make this kernel compute-bound
    y = tl.fdiv(h, 1.0 + tl.exp2(GELU_EXP2 * (h + 0.044715 * h * h * h)), ieee_rounding=False)
    return round_to(y, H.dtype.element_ty)


@triton.jit
def _gelu_fp8_kernel(H, Q, S, stride_h, M, N, GELU_EXP2: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
                     NUM_CHUNKS: tl.constexpr):
    # whole rows in registers as NUM_CHUNKS tiles (chunked_rows_launch): the amax is over the row
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    y0 = _gelu_chunk(H, rows, stride_h, M, N, 0, CHUNK, GELU_EXP2)
    y1, y2, y3 = y0, y0, y0  # stand-ins for the chunks a narrower row does not have (never read)
    if NUM_CHUNKS > 1:
        y1 = _gelu_chunk(H, rows, stride_h, M, N, 1, CHUNK, GELU_EXP2)
    if NUM_CHUNKS > 2:
        y2 = _gelu_chunk(H, rows, stride_h, M, N, 2, CHUNK, GELU_EXP2)
    if NUM_CHUNKS > 3:
        y3 = _gelu_chunk(H, rows, stride_h, M, N, 3, CHUNK, GELU_EXP2)
    fp8_store_row_chunks(Q, S, rows, M, N, CHUNK, NUM_CHUNKS, y0, y1, y2, y3)


def gelu_fp8(h: torch.Tensor, q_dtype=FP8_DTYPE) -> tuple[torch.Tensor, torch.Tensor]:
    """h: [M, N] (rows may be strided). Returns q [M, N] (q_dtype) and scale [M, 1] fp32 of gelu_tanh(h)."""
    check_tensor("h", h, dtypes=FLOAT_DTYPES, ndim=2)
    check_q_dtype(q_dtype)
    m, n = h.shape
    if n == 0:
        raise ValueError(f"h has shape {tuple(h.shape)}: a row needs at least one column for its FP8 scale")
    q = new_output((m, n), q_dtype, h.device)
    s = new_output((m, 1), torch.float32, h.device)
    if m:
        grid, settings = chunked_rows_launch(m, n)
        _gelu_fp8_kernel[grid](H=h, Q=q, S=s, stride_h=h.stride(0), M=m, N=n, GELU_EXP2=GELU_EXP2, **settings)
    return q, s


def gelu_fp8_ref(h: torch.Tensor, q_dtype=FP8_DTYPE) -> tuple[torch.Tensor, torch.Tensor]:
    """The semantics gelu_fp8 must reproduce (pure PyTorch)."""
    return quantize_fp8_rowwise_ref(torch.nn.functional.gelu(h, approximate="tanh"), q_dtype)
