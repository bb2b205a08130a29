"""One-row linear layer (GEMV) for single-token decode: y = x @ weight^T, x [1, K], weight [N, K] (nn.Linear layout).

Semantics of a bf16/fp16 `F.linear` without bias: products summed in fp32, the sum rounded once to the dtype
(cuBLAS' compute type; the summation order differs, so results match to fp32 rounding, not bit for bit).

Why not cuBLAS: at M=1 the step only streams the weight, and on an H200 cuBLAS reached 59-80% of copy bandwidth at
the Qwen3.5-9B decode shapes (a split-K kernel + reduce for the 4096 x 4096 projections), against 75-92% for this
kernel, whose settings come from benchmarks/sweep_gemv.py (results/sweep_gemv_71cb1b5.txt): BLOCK_N = 16 output
rows per program, 1024-wide K steps, weight loads marked evict-first so x stays cached. Each program keeps a
[BLOCK_N, BLOCK_K] fp32 accumulator and reduces it once at the end.
"""

import torch
import triton
import triton.language as tl

from ._utils import FLOAT_DTYPES, check_tensor, new_output, round_to


@triton.jit
def _gemv_kernel(X, W, Y, N, K, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] outputs
    cols = tl.arange(0, BLOCK_K)
    row_mask = rows < N
    w_ptrs = W + rows[:, None].to(tl.int64) * stride_wn + cols[None, :]  # [BLOCK_N, BLOCK_K]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(X + k + cols)
            w = tl.load(w_ptrs + k, mask=row_mask[:, None], other=0.0, eviction_policy="evict_first")
        else:
            col_mask = k + cols < K
            x = tl.load(X + k + cols, mask=col_mask, other=0.0)
            w = tl.load(w_ptrs + k, mask=row_mask[:, None] & col_mask[None, :], other=0.0,
                        eviction_policy="evict_first")
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    dtype = Y.dtype.element_ty
    tl.store(Y + rows, round_to(tl.sum(acc, axis=1), dtype).to(dtype), mask=row_mask)  # round_to: exact in the interpreter


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: [..., K] holding one row (x.numel() == K), last dim contiguous; weight: [N, K] in x's dtype, rows
    contiguous (nn.Linear.weight). Returns a new [..., N] in x's dtype."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, dtypes=(x.dtype,), ndim=2, device=x.device)
    n, k = weight.shape
    if x.dim() == 0 or x.shape[-1] != k or x.numel() != k:
        raise ValueError(f"x must hold one row of K={k} (the weight's {tuple(weight.shape)} is [N, K]), "
                         f"got shape {tuple(x.shape)}")
    y = new_output((*x.shape[:-1], n), x.dtype, x.device)
    if n and k:
        block_k = min(1024, triton.next_power_of_2(k))
        _gemv_kernel[(triton.cdiv(n, 16),)](
            X=x, W=weight, Y=y, N=n, K=k, stride_wn=weight.stride(0), BLOCK_N=16, BLOCK_K=block_k,
            EVEN_K=k % block_k == 0, num_warps=4, num_stages=4,
        )
    elif n:
        y.zero_()
    return y


def gemv_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The semantics gemv must reproduce: fp32 products and sum, rounded once to x's dtype."""
    return (x.float() @ weight.float().T).to(x.dtype)
