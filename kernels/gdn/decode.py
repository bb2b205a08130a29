"""One decode step of a Gated DeltaNet layer, from the in_proj outputs to the core output, in one kernel.

Matches transformers' qwen3_5 `Qwen3_5GatedDeltaNet.forward` on its single-token cached path
(`causal_conv1d_update` + `torch_recurrent_gated_delta_rule` with `use_qk_l2norm_in_kernel=True`), up to the
gated RMSNorm. For each sequence, with x = mixed_qkv = [q | k | v] (C = 2 H Dk + HV Dv channels):
    y = silu(conv(conv_state, x))            depthwise, K taps over (K-1 previous inputs, x); conv rounded to the
                                             model dtype, then silu rounded (F.conv1d then SiLU in the model dtype)
    conv_state = (conv_state[1:], x)         in place
    q, k = l2norm(q), l2norm(k)              fp32, x * rsqrt(sum(x * x) + eps); q *= Dk ** -0.5
    beta = sigmoid(b)                        rounded to b's dtype (upstream `b.sigmoid()`), used in fp32
    g = -exp(A_log) * softplus(a + dt_bias)  fp32
    per value head j (q/k head j // (HV // H)), state S [Dk, Dv] fp32, in place:
        S = S * exp(g);  delta = (v - S^T k) * beta;  S = S + k delta^T;  o = S^T q
Upstream divides q by sqrt(Dk); the kernel multiplies by Dk ** -0.5 (within an fp32 ulp).

One program per (sequence, key head): the q/k conv channels of a key head are read and shifted by exactly one
program (a grid over value heads would need them in several programs, which races with the in-place update); it
loops over the HV // H value heads of its group and over Dv blocks, a [Dk, BLOCK_DV] state tile at a time.
"""

import torch
import triton
import triton.language as tl

from .._utils import FLOAT_DTYPES, check_tensor, new_output, round_to


@triton.jit
def _softplus(x):
    """F.softplus (beta 1, threshold 20): log1p(exp(x)). log1p as log(u) * e / (u - 1) with u = 1 + e (Kahan's form):
    plain log(1 + e) loses the rounding of 1 + e, up to ~1e-3 of the result at x = -10 and all of it below -17."""
    e = tl.exp(x)
    u = 1.0 + e
    log1p = tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0)))
    return tl.where(x > 20.0, x, log1p)


@triton.jit
def _silu(x):
    return tl.fdiv(x, 1.0 + tl.exp(-x), ieee_rounding=False)


@triton.jit
def _conv_silu_update(X, CONV, CW, channels, mask, stride_conv_c, stride_cw, DTYPE: tl.constexpr,
                      WIDTH: tl.constexpr, BLOCK_W: tl.constexpr):
    """Causal conv + SiLU of `channels` over (their K-1 = WIDTH conv-state entries, x); shifts x into the state.
    Returns [BLOCK_C] fp32 holding DTYPE values."""
    taps = tl.arange(0, BLOCK_W)  # 0 .. WIDTH-1: the state, oldest first; WIDTH: this token
    in_state = mask[:, None] & (taps < WIDTH)[None, :]  # [BLOCK_C, BLOCK_W]
    state = tl.load(CONV + channels[:, None] * stride_conv_c + taps[None, :], mask=in_state, other=0.0)
    x = tl.load(X + channels, mask=mask, other=0.0)  # [BLOCK_C]
    window = tl.where((taps == WIDTH)[None, :], x[:, None], state)  # [BLOCK_C, BLOCK_W], model dtype
    w = tl.load(CW + channels[:, None] * stride_cw + taps[None, :], mask=mask[:, None] & (taps <= WIDTH)[None, :],
                other=0.0)
    y = round_to(tl.sum(window.to(tl.float32) * w.to(tl.float32), axis=1), DTYPE)
    shifted = mask[:, None] & (taps >= 1)[None, :] & (taps <= WIDTH)[None, :]
    tl.debug_barrier()  # every thread's state load lands before any thread overwrites a neighbouring tap
    tl.store(CONV + channels[:, None] * stride_conv_c + taps[None, :] - 1, window, mask=shifted)
    return round_to(_silu(y), DTYPE)


@triton.jit
def _gated_delta_rule_decode_kernel(
    QKV, A, B, CONV, CW, A_LOG, DT_BIAS, STATE, O,
    stride_qkv, stride_a, stride_b, stride_conv_b, stride_conv_c, stride_cw, eps, scale,
    H: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, WIDTH: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, NUM_DV_BLOCKS: tl.constexpr, BLOCK_W: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    dtype = O.dtype.element_ty
    x_row = QKV + i_b * stride_qkv
    conv_row = CONV + i_b * stride_conv_b
    dk = tl.arange(0, BLOCK_DK)
    dk_mask = dk < DK

    q = _conv_silu_update(x_row, conv_row, CW, i_h * DK + dk, dk_mask, stride_conv_c, stride_cw, dtype,
                          WIDTH, BLOCK_W)  # [BLOCK_DK]
    k = _conv_silu_update(x_row, conv_row, CW, (H + i_h) * DK + dk, dk_mask, stride_conv_c, stride_cw, dtype,
                          WIDTH, BLOCK_W)
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + eps) * scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + eps)

    for j in tl.static_range(GROUP):
        hv = i_h * GROUP + j
        b = tl.load(B + i_b * stride_b + hv).to(tl.float32)
        beta = round_to(tl.sigmoid(b), B.dtype.element_ty)
        a = tl.load(A + i_b * stride_a + hv).to(tl.float32) + tl.load(DT_BIAS + hv).to(tl.float32)
        decay = tl.exp(-tl.exp(tl.load(A_LOG + hv).to(tl.float32)) * _softplus(a))
        state_head = STATE + ((i_b * H * GROUP + hv) * DK) * DV
        o_head = O + (i_b * H * GROUP + hv) * DV
        for i_v in tl.static_range(NUM_DV_BLOCKS):
            dv = i_v * BLOCK_DV + tl.arange(0, BLOCK_DV)
            dv_mask = dv < DV
            v = _conv_silu_update(x_row, conv_row, CW, 2 * H * DK + hv * DV + dv, dv_mask, stride_conv_c,
                                  stride_cw, dtype, WIDTH, BLOCK_W)  # [BLOCK_DV]
            s_ptrs = state_head + dk[:, None] * DV + dv[None, :]
            s_mask = dk_mask[:, None] & dv_mask[None, :]
            s = tl.load(s_ptrs, mask=s_mask, other=0.0) * decay  # [BLOCK_DK, BLOCK_DV]
            delta = (v - tl.sum(s * k[:, None], axis=0)) * beta  # [BLOCK_DV]
            s = s + k[:, None] * delta[None, :]
            tl.debug_barrier()  # small tiles replicate elements across warps: all loads land before a store
            tl.store(s_ptrs, s, mask=s_mask)
            tl.store(o_head + dv, tl.sum(s * q[:, None], axis=0).to(dtype), mask=dv_mask)


def _check_decode_args(mixed_qkv, a, b, conv_state, conv_weight, A_log, dt_bias, recurrent_state, num_k_heads,
                       head_k_dim, head_v_dim):
    check_tensor("mixed_qkv", mixed_qkv, dtypes=FLOAT_DTYPES, ndim=2)
    bsz, c = mixed_qkv.shape
    dev = mixed_qkv.device
    check_tensor("a", a, dtypes=FLOAT_DTYPES, ndim=2, device=dev)
    hv = a.shape[1]
    if a.shape[0] != bsz or hv % num_k_heads or c != 2 * num_k_heads * head_k_dim + hv * head_v_dim:
        raise ValueError(f"mixed_qkv {tuple(mixed_qkv.shape)} and a {tuple(a.shape)} do not fit num_k_heads="
                         f"{num_k_heads}, head_k_dim={head_k_dim}, head_v_dim={head_v_dim}: expected a [B, HV] with "
                         f"HV a multiple of num_k_heads and C = 2 * H * Dk + HV * Dv")
    check_tensor("b", b, dtypes=FLOAT_DTYPES, shape=a.shape, device=dev)
    check_tensor("conv_state", conv_state, dtypes=(mixed_qkv.dtype,), ndim=3, device=dev)
    width = conv_state.shape[2]
    if conv_state.shape[:2] != (bsz, c) or width < 1:
        raise ValueError(f"conv_state must have shape [B, C, K-1] = [{bsz}, {c}, K-1] with K >= 2, got "
                         f"{tuple(conv_state.shape)}")
    check_tensor("conv_weight", conv_weight, dtypes=(mixed_qkv.dtype,), shape=(c, width + 1), device=dev)
    check_tensor("A_log", A_log, dtypes=FLOAT_DTYPES, shape=(hv,), device=dev)
    check_tensor("dt_bias", dt_bias, dtypes=FLOAT_DTYPES, shape=(hv,), device=dev)
    check_tensor("recurrent_state", recurrent_state, dtypes=(torch.float32,),
                 shape=(bsz, hv, head_k_dim, head_v_dim), device=dev)
    if not recurrent_state.is_contiguous():
        raise ValueError(f"recurrent_state must be contiguous, got strides {recurrent_state.stride()}")
    return bsz, hv, width


def gated_delta_rule_decode(
    mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, conv_state: torch.Tensor, conv_weight: torch.Tensor,
    A_log: torch.Tensor, dt_bias: torch.Tensor, recurrent_state: torch.Tensor, num_k_heads: int, head_k_dim: int,
    head_v_dim: int, eps: float = 1e-6,
) -> torch.Tensor:
    """One token per sequence. mixed_qkv: [B, C] (in_proj_qkv output, [q | k | v], C = 2 H Dk + HV Dv), last dim
    contiguous; a, b: [B, HV] (in_proj_a / in_proj_b outputs); conv_state: [B, C, K-1] in mixed_qkv's dtype, the
    previous K-1 inputs oldest first, updated in place; conv_weight: [C, K] (`conv1d.weight.squeeze(1)`), mixed_qkv's
    dtype; A_log, dt_bias: [HV]; recurrent_state: [B, HV, Dk, Dv] fp32, contiguous, updated in place.
    Returns o [B, HV, Dv] in mixed_qkv's dtype (the input of the gated RMSNorm)."""
    bsz, hv, width = _check_decode_args(mixed_qkv, a, b, conv_state, conv_weight, A_log, dt_bias, recurrent_state,
                                        num_k_heads, head_k_dim, head_v_dim)
    o = new_output((bsz, hv, head_v_dim), mixed_qkv.dtype, mixed_qkv.device)
    if bsz == 0:
        return o
    block_dk = triton.next_power_of_2(head_k_dim)
    block_dv = min(triton.next_power_of_2(head_v_dim), max(16, 8192 // block_dk))  # state tile <= 8192 fp32
    _gated_delta_rule_decode_kernel[(bsz, num_k_heads)](
        QKV=mixed_qkv, A=a, B=b, CONV=conv_state, CW=conv_weight, A_LOG=A_log, DT_BIAS=dt_bias,
        STATE=recurrent_state, O=o,
        stride_qkv=mixed_qkv.stride(0), stride_a=a.stride(0), stride_b=b.stride(0),
        stride_conv_b=conv_state.stride(0), stride_conv_c=conv_state.stride(1), stride_cw=conv_weight.stride(0),
        eps=eps, scale=head_k_dim**-0.5,
        H=num_k_heads, GROUP=hv // num_k_heads, DK=head_k_dim, DV=head_v_dim, WIDTH=width,
        BLOCK_DK=block_dk, BLOCK_DV=block_dv, NUM_DV_BLOCKS=triton.cdiv(head_v_dim, block_dv),
        BLOCK_W=triton.next_power_of_2(width + 1), num_warps=8,  # 8: ~100 registers a thread, 4: ~240
    )
    return o
