"""One-row linear layer (GEMV) for single-token decode: y = x @ weight^T, x [1, K], weight [N, K] (nn.Linear layout).
Two variants compute their input in the GEMV's prologue instead of a kernel of their own: silu_mul_gemv from a
[gate | up] row (an MLP's down projection), gated_rms_norm_gemv from per-head outputs and gates (a Gated-DeltaNet
output norm and out_proj).

Semantics of a bf16/fp16 `F.linear` without bias: products summed in fp32, the sum rounded once to the dtype
(cuBLAS' compute type; the summation order differs, so results match to fp32 rounding, not bit for bit).

Why not cuBLAS: at M=1 the step only streams the weight, and cuBLAS picks a split-K kernel + reduce for some of the
Qwen3.5-9B decode shapes (the 4096 x 4096 projections); a single pass over the weight streams it closer to copy
bandwidth (benchmarks/RESULTS.md, GEMV vs cuBLAS). Tile settings are benchmarks/bench_gemv.py --sweep's choice:
BLOCK_N = 16 output rows per program, 1024-wide K steps, weight loads marked evict-first so x stays cached. Each
program keeps a [BLOCK_N, BLOCK_K] fp32 accumulator and reduces it once at the end.
"""

import torch
import triton
import triton.language as tl

from ._utils import FLOAT_DTYPES, check_tensor, new_output, round_to
from .rms_norm import gated_norm_tile, gated_rms_norm_ref
from .swiglu import silu_mul_ref, silu_mul_tile


@triton.jit
def _load_chunk(ptrs, cols, K, EVEN_K: tl.constexpr):
    """fp32 [BLOCK_K] at columns `cols` of a row; no mask when K is a multiple of BLOCK_K (loads stay vectorized)."""
    if EVEN_K:
        return tl.load(ptrs).to(tl.float32)
    else:
        return tl.load(ptrs, mask=cols < K, other=0.0).to(tl.float32)


@triton.jit
def _input_chunk(X, Z, NW, cols, K, eps, PROLOGUE: tl.constexpr, GROUP: tl.constexpr, GROUPS: tl.constexpr,
                 EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr, NW_DTYPE: tl.constexpr):
    """The GEMV's input at columns `cols`, fp32 [BLOCK_K]. Every program recomputes its K step's prologue: at M=1
    that is cheaper than a kernel boundary.
        "none": X;  "silu_mul": silu_mul of X = [gate | up] (2K wide);
        "gated_norm": gated_rms_norm of X over groups of GROUP columns (heads), gated by Z, weighted by NW [GROUP];
                      a K step holds GROUPS = BLOCK_K / GROUP whole heads."""
    x = _load_chunk(X + cols, cols, K, EVEN_K)
    if PROLOGUE == "silu_mul":
        x = silu_mul_tile(x, _load_chunk(X + K + cols, cols, K, EVEN_K), DTYPE)
    elif PROLOGUE == "gated_norm":
        z = tl.reshape(_load_chunk(Z + cols, cols, K, EVEN_K), (GROUPS, GROUP))
        w = tl.reshape(tl.load(NW + cols % GROUP).to(tl.float32), (GROUPS, GROUP))
        x = tl.reshape(gated_norm_tile(tl.reshape(x, (GROUPS, GROUP)), z, w, GROUP, eps, DTYPE, NW_DTYPE), (BLOCK_K,))
        x = round_to(x, DTYPE)
    return x


@triton.jit
def _gemv_kernel(X, Z, NW, W, Y, N, K, stride_wn, eps, PROLOGUE: tl.constexpr, GROUP: tl.constexpr,
                 GROUPS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] outputs
    cols = tl.arange(0, BLOCK_K)
    row_mask = rows < N
    w_ptrs = W + rows[:, None].to(tl.int64) * stride_wn + cols[None, :]  # [BLOCK_N, BLOCK_K]
    dtype = Y.dtype.element_ty
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        x = _input_chunk(X, Z, NW, k + cols, K, eps, PROLOGUE, GROUP, GROUPS, EVEN_K, BLOCK_K, dtype,
                         NW.dtype.element_ty)
        if EVEN_K:
            w = tl.load(w_ptrs + k, mask=row_mask[:, None], other=0.0, eviction_policy="evict_first")
        else:
            w = tl.load(w_ptrs + k, mask=row_mask[:, None] & (k + cols < K)[None, :], other=0.0,
                        eviction_policy="evict_first")
        acc += w.to(tl.float32) * x[None, :]
    # round_to first: the interpreter's bf16 cast truncates
    tl.store(Y + rows, round_to(tl.sum(acc, axis=1), dtype).to(dtype), mask=row_mask)


def _launch(x: torch.Tensor, weight: torch.Tensor, prologue: str = "none", gate=None, norm_weight=None, group=1,
            eps=0.0, *, block_n=16, max_block_k=1024, num_warps=4, num_stages=4) -> torch.Tensor:
    """x: one row of the GEMV input (2K wide for silu_mul); gate, norm_weight, group, eps: for gated_norm. The tile
    settings default to the sweep's choice (bench_gemv.py --sweep passes others)."""
    name = "gate_up" if prologue == "silu_mul" else "x"
    check_tensor(name, x, dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, dtypes=(x.dtype,), ndim=2, device=x.device)
    n, k = weight.shape
    width = 2 * k if prologue == "silu_mul" else k
    row_dims = 2 if prologue == "gated_norm" else 1  # [..., HV, Dv] or [..., K]
    if x.dim() < row_dims or x.shape[-row_dims:].numel() != width or x.numel() != width:
        raise ValueError(f"{name} must hold one row of {'2K' if prologue == 'silu_mul' else 'K'}={width} "
                         f"(the weight's {tuple(weight.shape)} is [N, K]), got shape {tuple(x.shape)}")
    y = new_output((*x.shape[:-row_dims], n), x.dtype, x.device)
    if n:
        block_k = max(group, min(max_block_k, triton.next_power_of_2(k)))
        _gemv_kernel[(triton.cdiv(n, block_n),)](
            X=x, Z=gate if gate is not None else x, NW=norm_weight if norm_weight is not None else x, W=weight, Y=y,
            N=n, K=k, stride_wn=weight.stride(0), eps=eps, PROLOGUE=prologue, GROUP=group, GROUPS=block_k // group,
            BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, num_warps=num_warps, num_stages=num_stages,
        )
    return y


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: [..., K] holding one row (x.numel() == K), last dim contiguous; weight: [N, K] in x's dtype, rows
    contiguous (nn.Linear.weight). Returns a new [..., N] in x's dtype."""
    return _launch(x, weight)


def gemv_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The semantics gemv must reproduce: fp32 products and sum, rounded once to x's dtype."""
    return (x.float() @ weight.float().T).to(x.dtype)


def silu_mul_gemv(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """gemv(silu_mul(gate_up), weight) without the intermediate: gate_up [..., 2K] holding one row (a packed
    [gate | up] GEMM output, as swiglu.silu_mul takes), weight [N, K]. Returns [..., N] in gate_up's dtype."""
    return _launch(gate_up, weight, "silu_mul")


def silu_mul_gemv_ref(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return gemv_ref(silu_mul_ref(gate_up), weight)


def gated_rms_norm_gemv(x: torch.Tensor, gate: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
                        eps: float = 1e-6) -> torch.Tensor:
    """gemv(gated_rms_norm(x, gate, norm_weight, eps) flattened, weight) without the intermediate (a Gated-DeltaNet
    output norm and out_proj): x [..., HV, Dv] holding one row of K = HV * Dv (x.numel() == K), contiguous; gate
    like x (rows may be strided views); norm_weight [Dv], x's dtype or fp32; weight [N, K]. Dv must be a power of
    two (a K step holds whole heads). Returns [..., N] in x's dtype."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.dim() < 2:
        raise ValueError(f"x must be [..., HV, Dv], got shape {tuple(x.shape)}")
    group = x.shape[-1]
    check_tensor("gate", gate, dtypes=FLOAT_DTYPES, shape=x.shape, device=x.device)
    check_tensor("norm_weight", norm_weight, dtypes=(x.dtype, torch.float32), shape=(group,), device=x.device)
    if not x.is_contiguous() or gate.stride(-2) != group:
        raise ValueError(f"x must be contiguous and gate's heads packed (head stride {group}), got strides "
                         f"{x.stride()} and {gate.stride()}")
    if group & (group - 1):
        raise ValueError(f"x's head width {group} must be a power of two")
    return _launch(x, weight, "gated_norm", gate, norm_weight, group, eps)


def gated_rms_norm_gemv_ref(x, gate, norm_weight, weight, eps: float = 1e-6) -> torch.Tensor:
    return gemv_ref(gated_rms_norm_ref(x, gate, norm_weight, eps).flatten(-2), weight)
