"""GELU (tanh approximation) + rowwise FP8 quantization of the MLP hidden, the operand of the second MLP GEMM.

y = gelu_tanh(h) = h * sigmoid(2 * sqrt(2/pi) * (h + 0.044715 h^3)), rounded to h's dtype as
`F.gelu(h, approximate="tanh")` returns it (diffusers `FeedForward(activation_fn="gelu-approximate")`), then
quantized per row (kernels/fp8.py). h * sigmoid(2u) equals 0.5 h (1 + tanh(u)) and needs no libdevice tanh.
"""

import math

import torch
import triton
import triton.language as tl

from ._utils import FLOAT_DTYPES, FP8_DTYPE, check_tensor, new_output, round_to, rows_launch, tile_rows
from .fp8 import check_q_dtype, fp8_quantize_rows, quantize_fp8_rowwise_ref

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


@triton.jit
def _gelu_fp8_kernel(H, Q, S, stride_h, M, N, SQRT_2_OVER_PI: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    rows, cols, mask = tile_rows(M, N, BLOCK_M, BLOCK_N)
    h = tl.load(H + rows[:, None] * stride_h + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    # h * sigmoid(2u) with a fast division: an IEEE division per element would make this kernel compute-bound
    y = tl.fdiv(h, 1.0 + tl.exp(-2.0 * SQRT_2_OVER_PI * (h + 0.044715 * h * h * h)), ieee_rounding=False)
    y = round_to(y, H.dtype.element_ty)
    q, scale = fp8_quantize_rows(y)
    tl.store(Q + rows[:, None] * N + cols[None, :], q.to(Q.dtype.element_ty), mask=mask)
    tl.store(S + rows, scale, mask=rows < M)


def gelu_fp8(h: torch.Tensor, q_dtype=FP8_DTYPE) -> tuple[torch.Tensor, torch.Tensor]:
    """h: [M, N] (rows may be strided). Returns q [M, N] (q_dtype) and scale [M, 1] fp32 of gelu_tanh(h)."""
    check_tensor("h", h, dtypes=FLOAT_DTYPES, ndim=2)
    check_q_dtype(q_dtype)
    m, n = h.shape
    q = new_output((m, n), q_dtype, h.device)
    s = new_output((m, 1), torch.float32, h.device)
    if m:
        grid, settings = rows_launch(m, n)
        _gelu_fp8_kernel[grid](H=h, Q=q, S=s, stride_h=h.stride(0), M=m, N=n, SQRT_2_OVER_PI=SQRT_2_OVER_PI, **settings)
    return q, s


def gelu_fp8_ref(h: torch.Tensor, q_dtype=FP8_DTYPE) -> tuple[torch.Tensor, torch.Tensor]:
    """The semantics gelu_fp8 must reproduce (pure PyTorch)."""
    return quantize_fp8_rowwise_ref(torch.nn.functional.gelu(h, approximate="tanh"), q_dtype)
