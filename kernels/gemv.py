"""One-row linear layer (GEMV) for single-token decode: y = x @ weight^T, x [1, K], weight [N, K] (nn.Linear layout);
silu_mul_gemv feeds it silu_mul of a [gate | up] row instead (an MLP's down projection), computed in its prologue.

Semantics of a bf16/fp16 `F.linear` without bias: products summed in fp32, the sum rounded once to the dtype
(cuBLAS' compute type; the summation order differs, so results match to fp32 rounding, not bit for bit).

Why not cuBLAS: at M=1 the step only streams the weight, and on an H200 cuBLAS ran the Qwen3.5-9B decode shapes at
59-95% of copy bandwidth (a split-K kernel + reduce for the 4096 x 4096 projections), this kernel at 75-105% (a
pure read stream can beat the copy figure, which reads and writes); settings from benchmarks/bench_gemv.py --sweep
(results/sweep_gemv_71cb1b5.txt): BLOCK_N = 16 output rows per program, 1024-wide K steps, weight loads marked
evict-first so x stays cached. Each program keeps a [BLOCK_N, BLOCK_K] fp32 accumulator and reduces it once at the
end.
"""

import torch
import triton
import triton.language as tl

from ._utils import FLOAT_DTYPES, check_tensor, new_output, round_to
from .swiglu import silu_mul_ref, silu_mul_tile


@triton.jit
def _gemv_kernel(X, W, Y, N, K, stride_wn, SILU_MUL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr):
    """SILU_MUL: X is [gate | up] (2K), and the GEMV's input is silu_mul of it, computed per K step."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] outputs
    cols = tl.arange(0, BLOCK_K)
    row_mask = rows < N
    w_ptrs = W + rows[:, None].to(tl.int64) * stride_wn + cols[None, :]  # [BLOCK_N, BLOCK_K]
    dtype = Y.dtype.element_ty
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:  # no column mask: the loads stay vectorized
            x = tl.load(X + k + cols).to(tl.float32)
            if SILU_MUL:  # every program recomputes its K step's inputs: cheaper than a kernel boundary at M=1
                x = silu_mul_tile(x, tl.load(X + K + k + cols).to(tl.float32), dtype)
            w = tl.load(w_ptrs + k, mask=row_mask[:, None], other=0.0, eviction_policy="evict_first")
        else:
            col_mask = k + cols < K
            x = tl.load(X + k + cols, mask=col_mask, other=0.0).to(tl.float32)
            if SILU_MUL:
                x = silu_mul_tile(x, tl.load(X + K + k + cols, mask=col_mask, other=0.0).to(tl.float32), dtype)
            w = tl.load(w_ptrs + k, mask=row_mask[:, None] & col_mask[None, :], other=0.0,
                        eviction_policy="evict_first")
        acc += w.to(tl.float32) * x[None, :]
    tl.store(Y + rows, round_to(tl.sum(acc, axis=1), dtype).to(dtype), mask=row_mask)  # round_to: exact in the interpreter


def _launch(x: torch.Tensor, weight: torch.Tensor, silu_mul: bool) -> torch.Tensor:
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, dtypes=(x.dtype,), ndim=2, device=x.device)
    n, k = weight.shape
    width = 2 * k if silu_mul else k
    if x.dim() == 0 or x.shape[-1] != width or x.numel() != width:
        raise ValueError(f"{'gate_up' if silu_mul else 'x'} must hold one row of {'2K' if silu_mul else 'K'}={width} "
                         f"(the weight's {tuple(weight.shape)} is [N, K]), got shape {tuple(x.shape)}")
    y = new_output((*x.shape[:-1], n), x.dtype, x.device)
    if n:
        block_k = min(1024, triton.next_power_of_2(k))
        _gemv_kernel[(triton.cdiv(n, 16),)](
            X=x, W=weight, Y=y, N=n, K=k, stride_wn=weight.stride(0), SILU_MUL=silu_mul, BLOCK_N=16,
            BLOCK_K=block_k, EVEN_K=k % block_k == 0, num_warps=4, num_stages=4,
        )
    return y


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: [..., K] holding one row (x.numel() == K), last dim contiguous; weight: [N, K] in x's dtype, rows
    contiguous (nn.Linear.weight). Returns a new [..., N] in x's dtype."""
    return _launch(x, weight, silu_mul=False)


def gemv_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The semantics gemv must reproduce: fp32 products and sum, rounded once to x's dtype."""
    return (x.float() @ weight.float().T).to(x.dtype)


def silu_mul_gemv(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """gemv(silu_mul(gate_up), weight) without the intermediate: gate_up [..., 2K] holding one row (a packed
    [gate | up] GEMM output, as swiglu.silu_mul takes), weight [N, K]. Returns [..., N] in gate_up's dtype."""
    return _launch(gate_up, weight, silu_mul=True)


def silu_mul_gemv_ref(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return gemv_ref(silu_mul_ref(gate_up), weight)
