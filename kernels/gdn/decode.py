"""One decode step of a Gated DeltaNet layer, from the in_proj outputs to the core output, in one kernel.

Matches transformers' qwen3_5 `Qwen3_5GatedDeltaNet.forward` on its single-token cached path
(`causal_conv1d_update` + `torch_recurrent_gated_delta_rule` with `use_qk_l2norm_in_kernel=True`), up to the
gated RMSNorm. For each sequence at position p, with x = mixed_qkv = [q | k | v] (C = 2 H Dk + HV Dv channels):
    y = silu(conv(x_{p-K+1} .. x_{p-1}, x))  depthwise, K taps; conv rounded to the model dtype, then silu rounded
                                             (F.conv1d then SiLU in the model dtype)
    conv_state[:, p % K] = x                 in place (the state is a ring, see below)
    q, k = l2norm(q), l2norm(k)              fp32, x * rsqrt(sum(x * x) + eps); q *= Dk ** -0.5
    beta = sigmoid(b)                        rounded to b's dtype (upstream `b.sigmoid()`), used in fp32
    g = -exp(A_log) * softplus(a + dt_bias)  fp32
    per value head j (q/k head j // (HV // H)), state S [Dk, Dv] fp32, in place:
        S = S * exp(g);  delta = (v - S^T k) * beta;  S = S + k delta^T;  o = S^T q
Upstream divides q by sqrt(Dk); the kernel multiplies by Dk ** -0.5 (within an fp32 ulp).

Grid: (sequence, value head, Dv block), 128 programs a sequence at Qwen3.5-9B's sizes, each with a [Dk, 32] state
tile: one program per (sequence, key head), walking its value heads and Dv blocks in turn, would leave most SMs idle
at small batch (16 programs at B=1). Every program of a key head needs that head's q and k, so each recomputes their
conv from the conv state. Shifting the state in place would then race (one program's shift under another's read);
instead the conv state is a ring of K inputs per channel, slot p % K holding the input at position p: the step at
position p reads slots (p-K+1 .. p-1) % K and writes only slot p % K, which no program of the step reads. The
q/k slots are written by the head's first program, the v slots by the program that owns them.
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
def _conv_silu(X, RING, CW, channels, mask, pos, write, stride_ring_c, stride_cw, DTYPE: tl.constexpr,
               K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Causal conv + SiLU of `channels` at position `pos` over (the ring's K-1 inputs before pos, x); when `write`,
    stores x in the ring at slot pos % K. Returns [BLOCK_C] fp32 holding DTYPE values."""
    taps = tl.arange(0, BLOCK_K)  # 0 .. K-2: positions pos-K+1 .. pos-1 from the ring; K-1: this token
    slots = (pos + 1 + taps) % K  # tap t reads position pos-K+1+t (pos >= 0, so the sum stays non-negative)
    from_ring = mask[:, None] & (taps < K - 1)[None, :]  # [BLOCK_C, BLOCK_K]
    window = tl.load(RING + channels[:, None] * stride_ring_c + slots[None, :], mask=from_ring, other=0.0)
    x = tl.load(X + channels, mask=mask, other=0.0)  # [BLOCK_C]
    window = tl.where((taps == K - 1)[None, :], x[:, None], window)  # [BLOCK_C, BLOCK_K], model dtype
    w = tl.load(CW + channels[:, None] * stride_cw + taps[None, :], mask=mask[:, None] & (taps < K)[None, :],
                other=0.0)
    y = round_to(tl.sum(window.to(tl.float32) * w.to(tl.float32), axis=1), DTYPE)
    tl.store(RING + channels * stride_ring_c + pos % K, x, mask=mask & write)
    return round_to(_silu(y), DTYPE)


@triton.jit
def _gated_delta_rule_decode_kernel(
    QKV, A, B, CONV, POS, CW, A_LOG, DT_BIAS, STATE, O,
    stride_qkv, stride_a, stride_b, stride_conv_b, stride_conv_c, stride_cw, eps, scale,
    H: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, K: tl.constexpr,
    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_K: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1)
    i_v = tl.program_id(2)
    i_h = hv // GROUP
    dtype = O.dtype.element_ty
    x_row = QKV + i_b * stride_qkv
    ring = CONV + i_b * stride_conv_b
    pos = tl.load(POS + i_b)
    dk = tl.arange(0, BLOCK_DK)
    dk_mask = dk < DK
    dv = i_v * BLOCK_DV + tl.arange(0, BLOCK_DV)
    dv_mask = dv < DV

    writes_qk = (hv % GROUP == 0) & (i_v == 0)  # one program per key head stores its q/k inputs
    q = _conv_silu(x_row, ring, CW, i_h * DK + dk, dk_mask, pos, writes_qk, stride_conv_c, stride_cw, dtype,
                   K, BLOCK_K)  # [BLOCK_DK]
    k = _conv_silu(x_row, ring, CW, (H + i_h) * DK + dk, dk_mask, pos, writes_qk, stride_conv_c, stride_cw, dtype,
                   K, BLOCK_K)
    v = _conv_silu(x_row, ring, CW, 2 * H * DK + hv * DV + dv, dv_mask, pos, True, stride_conv_c, stride_cw, dtype,
                   K, BLOCK_K)  # [BLOCK_DV]
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + eps) * scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + eps)

    b = tl.load(B + i_b * stride_b + hv).to(tl.float32)
    beta = round_to(tl.sigmoid(b), B.dtype.element_ty)
    a = tl.load(A + i_b * stride_a + hv).to(tl.float32) + tl.load(DT_BIAS + hv).to(tl.float32)
    decay = tl.exp(-tl.exp(tl.load(A_LOG + hv).to(tl.float32)) * _softplus(a))

    s_ptrs = STATE + ((i_b * H * GROUP + hv) * DK + dk[:, None]) * DV + dv[None, :]
    s_mask = dk_mask[:, None] & dv_mask[None, :]
    s = tl.load(s_ptrs, mask=s_mask, other=0.0) * decay  # [BLOCK_DK, BLOCK_DV]
    delta = (v - tl.sum(s * k[:, None], axis=0)) * beta  # [BLOCK_DV]
    s = s + k[:, None] * delta[None, :]
    tl.debug_barrier()  # small tiles replicate elements across warps: all loads land before a store
    tl.store(s_ptrs, s, mask=s_mask)
    tl.store(O + (i_b * H * GROUP + hv) * DV + dv, tl.sum(s * q[:, None], axis=0).to(dtype), mask=dv_mask)


def _check_decode_args(mixed_qkv, a, b, conv_state, positions, conv_weight, A_log, dt_bias, recurrent_state,
                       num_k_heads, head_k_dim, head_v_dim):
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
    kernel_size = conv_state.shape[2]
    if conv_state.shape[:2] != (bsz, c) or kernel_size < 2:
        raise ValueError(f"conv_state must have shape [B, C, K] = [{bsz}, {c}, K] with K >= 2 (a ring of the last "
                         f"K conv inputs), got {tuple(conv_state.shape)}")
    check_tensor("positions", positions, dtypes=(torch.int64,), shape=(bsz,), device=dev)
    check_tensor("conv_weight", conv_weight, dtypes=(mixed_qkv.dtype,), shape=(c, kernel_size), device=dev)
    check_tensor("A_log", A_log, dtypes=FLOAT_DTYPES, shape=(hv,), device=dev)
    check_tensor("dt_bias", dt_bias, dtypes=FLOAT_DTYPES, shape=(hv,), device=dev)
    check_tensor("recurrent_state", recurrent_state, dtypes=(torch.float32,),
                 shape=(bsz, hv, head_k_dim, head_v_dim), device=dev)
    if not recurrent_state.is_contiguous():
        raise ValueError(f"recurrent_state must be contiguous, got strides {recurrent_state.stride()}")
    return bsz, hv, kernel_size


def gated_delta_rule_decode(
    mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, conv_state: torch.Tensor, positions: torch.Tensor,
    conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, recurrent_state: torch.Tensor,
    num_k_heads: int, head_k_dim: int, head_v_dim: int, eps: float = 1e-6,
) -> torch.Tensor:
    """One token per sequence. mixed_qkv: [B, C] (in_proj_qkv output, [q | k | v], C = 2 H Dk + HV Dv), last dim
    contiguous; a, b: [B, HV] (in_proj_a / in_proj_b outputs); conv_state: [B, C, K] in mixed_qkv's dtype, a ring
    (slot p % K holds the conv input at position p; `conv_ring` builds it), updated in place; positions: [B] int64,
    each sequence's position p >= 0 (read on the device: no host sync); conv_weight: [C, K]
    (`conv1d.weight.squeeze(1)`), mixed_qkv's dtype; A_log, dt_bias: [HV]; recurrent_state: [B, HV, Dk, Dv] fp32,
    contiguous, updated in place. Returns o [B, HV, Dv] in mixed_qkv's dtype (the input of the gated RMSNorm)."""
    bsz, hv, kernel_size = _check_decode_args(mixed_qkv, a, b, conv_state, positions, conv_weight, A_log, dt_bias,
                                              recurrent_state, num_k_heads, head_k_dim, head_v_dim)
    o = new_output((bsz, hv, head_v_dim), mixed_qkv.dtype, mixed_qkv.device)
    if bsz == 0:
        return o
    block_dv = min(triton.next_power_of_2(head_v_dim), 32)  # 9B: 4 Dv blocks x 32 value heads per sequence
    _gated_delta_rule_decode_kernel[(bsz, hv, triton.cdiv(head_v_dim, block_dv))](
        QKV=mixed_qkv, A=a, B=b, CONV=conv_state, POS=positions, CW=conv_weight, A_LOG=A_log, DT_BIAS=dt_bias,
        STATE=recurrent_state, O=o,
        stride_qkv=mixed_qkv.stride(0), stride_a=a.stride(0), stride_b=b.stride(0),
        stride_conv_b=conv_state.stride(0), stride_conv_c=conv_state.stride(1), stride_cw=conv_weight.stride(0),
        eps=eps, scale=head_k_dim**-0.5,
        H=num_k_heads, GROUP=hv // num_k_heads, DK=head_k_dim, DV=head_v_dim, K=kernel_size,
        BLOCK_DK=triton.next_power_of_2(head_k_dim), BLOCK_DV=block_dv,
        BLOCK_K=triton.next_power_of_2(kernel_size), num_warps=4,
    )
    return o
