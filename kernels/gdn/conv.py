"""Depthwise causal convolution over time + SiLU for a Gated DeltaNet prefill, read and written channels-last.

For each sequence, with x [T, C] (channels contiguous: a slice of the packed input projection), weight [C, K] and
the K-1 previous inputs s [C, K-1] (zeros without an initial state):
    y[t, c] = silu(round(sum_k weight[c, k] * x'[t + k, c]))     x' = (s^T, x) along time; fp32 sum, rounded to
                                                                 x's dtype, SiLU rounded again (F.conv1d then SiLU
                                                                 in the model dtype, as transformers' PyTorch
                                                                 `causal_conv1d_fn`; the causal-conv1d CUDA package
                                                                 rounds once)
    final_state = the last K-1 rows of x', as [C, K-1] (what the decode step continues from)
Matches `causal_conv1d_ref` (naive.py). Upstream transposes to [C, T] for F.conv1d; this kernel reads the strided
projection in place and writes y [T, C] contiguous, so q, k, v are views of it.
"""

import torch
import triton
import triton.language as tl

from .._utils import FLOAT_DTYPES, check_tensor, new_output, round_to
from .decode import _silu
from .naive import conv_history, last_inputs


@triton.jit
def _causal_conv1d_silu_kernel(
    X, W, S, Y, T, C, stride_xb, stride_xt, stride_sb, stride_sc, stride_wc,
    HAS_STATE: tl.constexpr, APPLY_SILU: tl.constexpr, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    times = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BLOCK_C]
    col_mask = cols < C
    dtype = Y.dtype.element_ty
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for k in tl.static_range(K):
        src = times - (K - 1) + k  # [BLOCK_T]: input time of tap k; < 0 reads the initial state
        w = tl.load(W + cols * stride_wc + k, mask=col_mask, other=0.0).to(tl.float32)  # [BLOCK_C]
        x = tl.load(X + b * stride_xb + src[:, None] * stride_xt + cols[None, :],
                    mask=(src >= 0)[:, None] & (src < T)[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
        if HAS_STATE:  # state column K-1+src holds input time src (src in [-(K-1), -1])
            s = tl.load(S + b * stride_sb + cols[None, :] * stride_sc + (K - 1 + src)[:, None],
                        mask=(src < 0)[:, None] & (src >= -(K - 1))[:, None] & col_mask[None, :],
                        other=0.0).to(tl.float32)
            x = x + s
        acc += w[None, :] * x
    y = round_to(acc, dtype)
    if APPLY_SILU:
        y = _silu(y)
    mask = (times < T)[:, None] & col_mask[None, :]
    tl.store(Y + b * T * C + times[:, None] * C + cols[None, :], y.to(dtype), mask=mask)


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, initial_state: torch.Tensor | None = None, activation: str | None = "silu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [B, T, C] float, channels contiguous (other strides arbitrary); weight: [C, K] in x's dtype (upstream
    `conv1d.weight.squeeze(1)`); initial_state: [B, C, K-1] in x's dtype, the previous K-1 inputs oldest first
    (None: zeros). Returns (y [B, T, C] contiguous, final_state [B, C, K-1]: the last K-1 inputs, zero-padded on the
    left when there were fewer), both in x's dtype."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES, ndim=3)
    bsz, t, c = x.shape
    check_tensor("weight", weight, dtypes=(x.dtype,), ndim=2, device=x.device)
    if weight.shape[0] != c or weight.shape[1] < 1:
        raise ValueError(f"weight has shape {tuple(weight.shape)}; expected [C, K] = [{c}, K] with K >= 1")
    width = weight.shape[1] - 1
    if initial_state is not None:
        check_tensor("initial_state", initial_state, dtypes=(x.dtype,), shape=(bsz, c, width), device=x.device)
    if activation not in ("silu", "swish", None):
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    y = new_output((bsz, t, c), x.dtype, x.device)
    if bsz * t * c:
        state = initial_state if initial_state is not None else y  # y: a placeholder pointer, never read
        block_t, block_c = 32, min(triton.next_power_of_2(c), 128)
        _causal_conv1d_silu_kernel[(bsz, triton.cdiv(t, block_t), triton.cdiv(c, block_c))](
            X=x, W=weight, S=state, Y=y, T=t, C=c, stride_xb=x.stride(0), stride_xt=x.stride(1),
            stride_sb=state.stride(0), stride_sc=state.stride(1), stride_wc=weight.stride(0),
            HAS_STATE=initial_state is not None, APPLY_SILU=activation is not None, K=width + 1,
            BLOCK_T=block_t, BLOCK_C=block_c,
        )
    return y, last_inputs(conv_history(x, initial_state), width)
