"""Pure-PyTorch references for the gated delta rule (Gated DeltaNet) and its short causal convolution.

Per value head, with S the fp32 state [Dk, Dv], q, k L2-normalized in fp32 and q scaled by Dk ** -0.5:
    S = S * exp(g_t)
    delta = (v_t - S^T k_t) * beta_t
    S = S + k_t delta^T
    o_t = S^T q_t
Value head j reads q/k head j // (HV // H) (grouped value attention: upstream repeat_interleaves q and k).
recurrent_gated_delta_rule_ref mirrors transformers' qwen3_5 `torch_recurrent_gated_delta_rule` op for op;
chunk_gated_delta_rule_ref is the chunked (WY / UT-transform) form of the same recurrence, as
`torch_chunk_gated_delta_rule` and fla's `chunk_gated_delta_rule` compute it, for prefill on the CPU.
causal_conv1d_ref is upstream's `causal_conv1d_fn` / `causal_conv1d_update` (depthwise, no bias, SiLU) with a
[B, C, K-1] state. gated_delta_rule_decode_ref is the `Qwen3_5GatedDeltaNet.forward` single-token cached path from
in_proj outputs to the core attention output (before the gated norm), with the decode kernel's conv state: a ring
of the last K inputs (conv_ring, ring_window).
"""

import torch
import torch.nn.functional as F


def l2norm_ref(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x * rsqrt(sum(x * x) + eps) over the last dim (upstream `l2norm`, fla's convention)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta, use_qk_l2norm):
    """[B, T, H*, D] inputs -> fp32 [B, HV, T, D] with q/k repeated over the value-head groups."""
    _check_gdn_shapes(q, k, v, g, beta)
    groups = v.shape[2] // q.shape[2]
    q, k, v, beta, g = (x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                        for x in (q, k, v, beta, g))
    if use_qk_l2norm:
        q, k = l2norm_ref(q), l2norm_ref(k)
    if groups > 1:
        q, k = q.repeat_interleave(groups, dim=1), k.repeat_interleave(groups, dim=1)
    return q, k, v, g, beta


def _check_gdn_shapes(q, k, v, g, beta):
    b, t, h, dk = q.shape
    hv = v.shape[2]
    if k.shape != q.shape or v.shape[:2] != (b, t) or hv % h or g.shape != (b, t, hv) or beta.shape != (b, t, hv):
        raise ValueError(f"expected q, k [B, T, H, Dk], v [B, T, HV, Dv] with HV a multiple of H, g, beta "
                         f"[B, T, HV]; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"g {tuple(g.shape)}, beta {tuple(beta.shape)}")


def recurrent_gated_delta_rule_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor | None = None, scale: float | None = None, use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k: [B, T, H, Dk]; v: [B, T, HV, Dv], HV a multiple of H; g (log decay, <= 0), beta: [B, T, HV];
    initial_state: [B, HV, Dk, Dv] or None (zeros). scale None: q / sqrt(Dk) as upstream, else q * scale.
    Returns (o [B, T, HV, Dv] in v's dtype, final_state [B, HV, Dk, Dv] fp32). Token by token, as upstream."""
    b, t, _, dk = q.shape
    hv, dv = v.shape[2:]
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, use_qk_l2norm)
    q = q / dk**0.5 if scale is None else q * scale
    if initial_state is None:
        state = torch.zeros(b, hv, dk, dv, dtype=torch.float32, device=v.device)
    else:
        state = initial_state.to(v)
    o = torch.zeros_like(v)  # [B, HV, T, Dv]
    for i in range(t):
        q_t, k_t, v_t = q[:, :, i], k[:, :, i], v[:, :, i]  # [B, HV, D]
        state = state * g[:, :, i].exp()[..., None, None]
        kv_mem = (state * k_t.unsqueeze(-1)).sum(dim=-2)  # [B, HV, Dv]
        delta = (v_t - kv_mem) * beta[:, :, i].unsqueeze(-1)
        state = state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        o[:, :, i] = (state * q_t.unsqueeze(-1)).sum(dim=-2)
    return o.transpose(1, 2).contiguous().to(out_dtype), state


def chunk_gated_delta_rule_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor | None = None, scale: float | None = None, use_qk_l2norm: bool = True,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same arguments and results as recurrent_gated_delta_rule_ref (scale None: q * Dk ** -0.5), computed a chunk
    of chunk_size tokens at a time. Within a chunk, with G_t = cumsum(g) from the chunk start and S0 the state
    entering it, the written values u (the deltas) solve the unit lower-triangular system
        u_t + sum_{i<t} beta_t exp(G_t - G_i) (k_t . k_i) u_i = beta_t v_t - beta_t exp(G_t) S0^T k_t
    and then  o_t = exp(G_t) S0^T q_t + sum_{i<=t} exp(G_t - G_i) (q_t . k_i) u_i,
              S_end = exp(G_C) S0 + sum_i exp(G_C - G_i) k_i u_i^T."""
    b, t, _, dk = q.shape
    hv, dv = v.shape[2:]
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, use_qk_l2norm)  # [B, HV, T, D], [B, HV, T]
    q = q * (dk**-0.5 if scale is None else scale)
    c = chunk_size
    pad = (c - t % c) % c  # padded tokens: k = v = 0, g = 0, beta = 0 change neither outputs nor the state
    q, k, v = (F.pad(x, (0, 0, 0, pad)).unflatten(2, (-1, c)) for x in (q, k, v))  # [B, HV, N, C, D]
    g, beta = (F.pad(x, (0, pad)).unflatten(2, (-1, c)) for x in (g, beta))  # [B, HV, N, C]
    g_cum = g.cumsum(-1)
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    decay = (g_cum[..., :, None] - g_cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [.., C, C]
    k_beta = k * beta[..., None]
    strict = (k_beta @ k.transpose(-1, -2)) * decay  # its diagonal is ignored: the system is unit-triangular
    w_v = torch.linalg.solve_triangular(strict, v * beta[..., None], upper=False, unitriangular=True)
    w_k = torch.linalg.solve_triangular(strict, k_beta * g_cum.exp()[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay  # [B, HV, N, C, C]
    q_decayed = q * g_cum.exp()[..., None]
    k_to_end = k * (g_cum[..., -1:] - g_cum).exp()[..., None]
    chunk_decay = g_cum[..., -1].exp()[..., None, None]  # [B, HV, N, 1, 1]
    if initial_state is None:
        state = torch.zeros(b, hv, dk, dv, dtype=torch.float32, device=v.device)
    else:
        state = initial_state.to(torch.float32)
    o = torch.empty_like(v)
    for n in range(q.shape[2]):
        u = w_v[:, :, n] - w_k[:, :, n] @ state  # [B, HV, C, Dv]
        o[:, :, n] = q_decayed[:, :, n] @ state + attn[:, :, n] @ u
        state = state * chunk_decay[:, :, n] + k_to_end[:, :, n].transpose(-1, -2) @ u
    o = o.flatten(2, 3)[:, :, :t].transpose(1, 2).contiguous()
    return o.to(out_dtype), state


def conv_history(x: torch.Tensor, initial_state: torch.Tensor | None) -> torch.Tensor:
    """x: [B, T, C]; initial_state: [B, C, K-1] or None. The conv's inputs over time, [B, C, (K-1) + T] (or T)."""
    xs = x.transpose(1, 2)
    return xs if initial_state is None else torch.cat([initial_state.to(x.dtype), xs], dim=-1)


def last_inputs(history: torch.Tensor, width: int) -> torch.Tensor:
    """history: [B, C, T'] -> the conv state [B, C, width]: its last `width` inputs, zeros first when T' < width."""
    return F.pad(history, (width, 0))[..., history.shape[-1]:].contiguous()


def causal_conv1d_ref(
    x: torch.Tensor, weight: torch.Tensor, initial_state: torch.Tensor | None = None, activation: str | None = "silu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution over time (no bias), then SiLU. x: [B, T, C]; weight: [C, K] (upstream
    `conv1d.weight.squeeze(1)`); initial_state: [B, C, K-1], the previous K-1 inputs oldest first (None: zeros).
    Returns (y [B, T, C] in x's dtype, final_state [B, C, K-1] in x's dtype: the last K-1 inputs, zero-padded on the
    left when there were fewer). Computed like upstream: F.conv1d in weight's dtype, SiLU, cast to x's dtype."""
    bsz, t, c = x.shape
    width = weight.shape[1] - 1
    xs = conv_history(x, initial_state)  # [B, C, (K-1) + T] or [B, C, T]
    # upstream's form (padding K-1, then slices): on the CPU, fp32 SiLU of a strided view takes a scalar exp that
    # can differ in the last bit from the vectorized one, so the layout is kept for bit-equality
    y = F.conv1d(xs.to(weight.dtype), weight.unsqueeze(1), padding=width, groups=c)[..., : xs.shape[-1]][..., -t:]
    if activation is not None:
        if activation not in ("silu", "swish"):
            raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
        y = F.silu(y)
    return y.to(x.dtype).transpose(1, 2), last_inputs(xs, width)


def conv_ring(last: torch.Tensor, position: int) -> torch.Tensor:
    """last: [B, C, K-1], the conv inputs at positions position-K+1 .. position-1, oldest first (zeros before
    position 0, as `causal_conv1d_ref` returns them). Returns the decode step's ring [B, C, K]: slot p % K holds the
    input at position p; slot position % K (the next input's) is zero."""
    kernel_size = last.shape[-1] + 1
    ring = F.pad(last, (0, 1))  # element t: position position-K+1+t, the last one a placeholder for `position`
    return ring.roll((position + 1) % kernel_size, dims=-1).contiguous()  # element t -> slot (position+1+t) % K


def ring_window(ring: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """ring: [B, C, K]; positions: [B]. The K-1 inputs before each sequence's position, [B, C, K-1] oldest first."""
    bsz, c, kernel_size = ring.shape
    slots = (positions[:, None] + 1 + torch.arange(kernel_size - 1, device=ring.device)) % kernel_size  # [B, K-1]
    return ring.gather(-1, slots[:, None, :].expand(bsz, c, kernel_size - 1))


def gated_delta_rule_decode_ref(
    mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, conv_state: torch.Tensor, positions: torch.Tensor,
    conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, recurrent_state: torch.Tensor,
    num_k_heads: int, head_k_dim: int, head_v_dim: int, eps: float = 1e-6,
) -> torch.Tensor:
    """The semantics gated_delta_rule_decode must reproduce; updates conv_state and recurrent_state in place the
    same way. mixed_qkv: [B, C] = [q | k | v] (C = 2 H Dk + HV Dv); a, b: [B, HV]; conv_state: [B, C, K], a ring
    (slot p % K: the input at position p, see conv_ring); positions: [B] int64; conv_weight: [C, K]; A_log, dt_bias:
    [HV]; recurrent_state: [B, HV, Dk, Dv] fp32. Returns o [B, HV, Dv] in mixed_qkv's dtype. Upstream's casts:
    beta = b.sigmoid() in the model dtype, g = -exp(A_log.float()) * softplus(a.float() + dt_bias), q and k
    L2-normalized in fp32."""
    bsz = mixed_qkv.shape[0]
    key_dim = num_k_heads * head_k_dim
    y, _ = causal_conv1d_ref(mixed_qkv[:, None], conv_weight, ring_window(conv_state, positions))  # [B, 1, C]
    q, k, v = torch.split(y, [key_dim, key_dim, y.shape[-1] - 2 * key_dim], dim=-1)
    q = l2norm_ref(q.float().reshape(bsz, 1, num_k_heads, head_k_dim), eps)
    k = l2norm_ref(k.float().reshape(bsz, 1, num_k_heads, head_k_dim), eps)
    v = v.reshape(bsz, 1, -1, head_v_dim)
    beta = b.sigmoid()
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    o, state = recurrent_gated_delta_rule_ref(
        q, k, v, g[:, None], beta[:, None], initial_state=recurrent_state, use_qk_l2norm=False
    )
    conv_state[torch.arange(bsz, device=conv_state.device), :, positions % conv_state.shape[-1]] = mixed_qkv
    recurrent_state.copy_(state)
    return o[:, 0]
