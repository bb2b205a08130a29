"""SwiGLU on a packed [gate | up] GEMM output: y = silu(gate) * up; silu_mul_fp8 also quantizes y per row to FP8,
the operand of the down projection's rowwise FP8 GEMM.

gate_up: [..., 2 * I], the output of one GEMM with the stacked weight [gate_proj; up_proj] (gate first).
Matches transformers' qwen3_5 `Qwen3_5MLP` (`act_fn(gate_proj(x)) * up_proj(x)`, hidden_act "silu") and diffusers'
`QwenImage21SwiGLUFeedForward` (`activation_fn(gate_layer(x)) * proj(x)`) in the model dtype: silu(gate) is computed
in fp32 and rounded to the dtype, then the product is rounded:
    y = round(round(gate / (1 + exp(-gate))) * up)
"""

import torch
import triton
import triton.language as tl

from ._utils import (
    FLOAT_DTYPES, FP8_DTYPE, TILE_ELEMENTS, check_tensor, chunk_cols, chunked_rows_launch, new_output, round_to,
)
from .fp8 import check_q_dtype, fp8_store_row_chunks, quantize_fp8_rowwise_ref


@triton.jit
def silu_mul_tile(gate, up, DTYPE: tl.constexpr):
    """fp32 tiles holding DTYPE values -> round(round(silu(gate)) * up) as fp32 (also the GEMV's prologue)."""
    act = round_to(tl.fdiv(gate, 1.0 + tl.exp(-gate), ieee_rounding=False), DTYPE)  # silu, rounded like F.silu
    return round_to(act * up, DTYPE)


@triton.jit
def _silu_mul_kernel(
    GU, Y, stride_gu, M, N,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)  # [BLOCK_M, BLOCK_N]
    gu_row = GU + rows[:, None] * stride_gu + cols[None, :]
    gate = tl.load(gu_row, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_row + N, mask=mask, other=0.0).to(tl.float32)
    dtype = Y.dtype.element_ty
    tl.store(Y + rows[:, None] * N + cols[None, :], silu_mul_tile(gate, up, dtype).to(dtype), mask=mask)


@triton.jit
def _silu_mul_chunk(GU, rows, stride_gu, M, N, c: tl.constexpr, CHUNK: tl.constexpr):
    """silu_mul of chunk c of the rows, fp32 [BLOCK_M, CHUNK] (masked lanes: silu(0) * 0 = 0)."""
    cols, mask = chunk_cols(rows, M, N, c, CHUNK)
    gu_row = GU + rows[:, None] * stride_gu + cols[None, :]
    gate = tl.load(gu_row, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_row + N, mask=mask, other=0.0).to(tl.float32)
    return silu_mul_tile(gate, up, GU.dtype.element_ty)


@triton.jit
def _silu_mul_fp8_kernel(GU, Q, S, stride_gu, M, N, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
                         NUM_CHUNKS: tl.constexpr):
    # whole rows in registers as NUM_CHUNKS tiles (chunked_rows_launch): the quantization's amax is per row
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    y0 = _silu_mul_chunk(GU, rows, stride_gu, M, N, 0, CHUNK)
    y1, y2, y3 = y0, y0, y0  # stand-ins for the chunks a narrower row does not have (never read)
    if NUM_CHUNKS > 1:
        y1 = _silu_mul_chunk(GU, rows, stride_gu, M, N, 1, CHUNK)
    if NUM_CHUNKS > 2:
        y2 = _silu_mul_chunk(GU, rows, stride_gu, M, N, 2, CHUNK)
    if NUM_CHUNKS > 3:
        y3 = _silu_mul_chunk(GU, rows, stride_gu, M, N, 3, CHUNK)
    fp8_store_row_chunks(Q, S, rows, M, N, CHUNK, NUM_CHUNKS, y0, y1, y2, y3)


def _rows(gate_up: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """gate_up [..., 2I] checked -> ([M, 2I] view, M, I)."""
    check_tensor("gate_up", gate_up, dtypes=FLOAT_DTYPES)
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up must be [..., 2 * I] with an even last dim, got shape {tuple(gate_up.shape)}")
    n = gate_up.shape[-1] // 2
    m = gate_up.shape[:-1].numel()
    return gate_up.reshape(m, 2 * n), m, n  # a view with a row stride when gate_up's rows are strided


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [..., 2 * I] float, last dim contiguous (rows may be strided). Returns a new contiguous [..., I]
    tensor in gate_up's dtype."""
    gu, m, n = _rows(gate_up)
    y = new_output((m, n), gate_up.dtype, gate_up.device)
    if m and n:
        block_n = min(triton.next_power_of_2(n), 1024)
        block_m = max(1, min(TILE_ELEMENTS // block_n, triton.next_power_of_2(m)))
        _silu_mul_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
            GU=gu, Y=y, stride_gu=gu.stride(0), M=m, N=n, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4,
        )
    return y.view(*gate_up.shape[:-1], n)


def silu_mul_fp8(gate_up: torch.Tensor, q_dtype=FP8_DTYPE) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up: [..., 2 * I] (rows may be strided). Returns q [M, I] (q_dtype) and scale [M, 1] fp32 of
    silu_mul(gate_up) quantized per row, M the rows of gate_up."""
    gu, m, n = _rows(gate_up)
    check_q_dtype(q_dtype)
    if n == 0:
        raise ValueError(f"gate_up has shape {tuple(gate_up.shape)}: a row needs at least one column for its FP8 "
                         "scale")
    q = new_output((m, n), q_dtype, gate_up.device)
    s = new_output((m, 1), torch.float32, gate_up.device)
    if m:
        grid, settings = chunked_rows_launch(m, n)
        _silu_mul_fp8_kernel[grid](GU=gu, Q=q, S=s, stride_gu=gu.stride(0), M=m, N=n, **settings)
    return q, s


def silu_mul_fp8_ref(gate_up: torch.Tensor, q_dtype=FP8_DTYPE) -> tuple[torch.Tensor, torch.Tensor]:
    """The semantics silu_mul_fp8 must reproduce (pure PyTorch)."""
    return quantize_fp8_rowwise_ref(silu_mul_ref(gate_up).reshape(-1, gate_up.shape[-1] // 2), q_dtype)


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """The semantics silu_mul must reproduce (pure PyTorch, in gate_up's dtype like Qwen3_5MLP)."""
    gate, up = gate_up.chunk(2, dim=-1)
    # contiguous: on the CPU, fp32 silu of a strided view takes a scalar exp that differs in the last bit from the
    # vectorized one upstream's contiguous gate_proj output gets
    return torch.nn.functional.silu(gate.contiguous()) * up
