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
projection in place. With `split` it writes the channel groups (Gated-DeltaNet: q, k, v) as separate contiguous
[B, T, c_i] tensors, so a consumer that needs them contiguous (fla's chunked kernels) copies nothing.
"""

import torch
import triton
import triton.language as tl

from .._utils import FLOAT_DTYPES, check_tensor, new_output, round_to
from .decode import _silu
from .naive import conv_history, last_inputs


@triton.jit
def _causal_conv1d_silu_kernel(
    X, W, S, Y, T, C, S1, S2, stride_xb, stride_xt, stride_sb, stride_sc, stride_wc,
    HAS_STATE: tl.constexpr, APPLY_SILU: tl.constexpr, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Y: one buffer of B * T * C holding channels [0, S1), [S1, S2), [S2, C) as three [B, T, width] blocks, one
    after the other (S1 = S2 = C: plain [B, T, C])."""
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
    start = tl.where(cols < S1, 0, tl.where(cols < S2, S1, S2)).to(tl.int64)  # [BLOCK_C]: its group's first channel
    width = tl.where(cols < S1, S1, tl.where(cols < S2, S2 - S1, C - S2)).to(tl.int64)
    group = start * tl.num_programs(0) * T + b * T * width + (cols - start)  # [BLOCK_C]: (b, t=0, c) in its block
    out = Y + group[None, :] + times[:, None] * width[None, :]
    tl.store(out, y.to(dtype), mask=mask)


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, initial_state: torch.Tensor | None = None, activation: str | None = "silu",
    split: tuple[int, int, int] | None = None,
):
    """x: [B, T, C] float, channels contiguous (other strides arbitrary); weight: [C, K] in x's dtype (upstream
    `conv1d.weight.squeeze(1)`); initial_state: [B, C, K-1] in x's dtype, the previous K-1 inputs oldest first
    (None: zeros); split: None, or three channel counts summing to C. Returns (y, final_state [B, C, K-1]: the last
    K-1 inputs, zero-padded on the left when there were fewer), both in x's dtype; y is [B, T, C] contiguous, or
    with split three contiguous [B, T, c_i] tensors (the channel groups in order)."""
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
    if split is not None and (len(split) != 3 or min(split) < 0 or sum(split) != c):
        raise ValueError(f"split={split}: must be three channel counts >= 0 summing to C={c}")
    s1, s2 = (split[0], split[0] + split[1]) if split is not None else (c, c)
    y = new_output((bsz * t * c,), x.dtype, x.device)  # the [B, T, C] or split blocks, back to back
    if bsz * t * c:
        state = initial_state if initial_state is not None else x  # x: a placeholder pointer, never read
        block_t, block_c = 32, min(triton.next_power_of_2(c), 128)
        _causal_conv1d_silu_kernel[(bsz, triton.cdiv(t, block_t), triton.cdiv(c, block_c))](
            X=x, W=weight, S=state, Y=y, T=t, C=c, S1=s1, S2=s2, stride_xb=x.stride(0), stride_xt=x.stride(1),
            stride_sb=state.stride(0), stride_sc=state.stride(1), stride_wc=weight.stride(0),
            HAS_STATE=initial_state is not None, APPLY_SILU=activation is not None, K=width + 1,
            BLOCK_T=block_t, BLOCK_C=block_c,
        )
    final_state = last_inputs(conv_history(x, initial_state), width)
    if split is None:
        return y.view(bsz, t, c), final_state
    return tuple(part.view(bsz, t, n) for part, n in zip(y.split([bsz * t * n for n in split]), split)), final_state
