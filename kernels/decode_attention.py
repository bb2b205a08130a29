"""One decode step of (grouped-query) attention over a static KV cache: writes the new key/value, attends, gates.

Per sequence b at position p = positions[b], query head h reading KV head h // (H / KVH):
    k_cache[b, p], v_cache[b, p] = k[b], v[b]          in place; nothing else in the caches changes
    s_j = (q[b, h] . k_cache[b, j]) * scale            fp32, j = 0..p (keys past p are never read, whatever they hold)
    o = sum_j softmax(s)_j v_cache[b, j]               softmax and sum in fp32, then rounded to q's dtype
    with gate: o = round(o * round(sigmoid(gate[b, h])))  sigmoid in fp32; as transformers' qwen3_5
                                                          `Qwen3_5Attention` (`attn_output * torch.sigmoid(gate)`
                                                          in the model dtype)
It replaces index_put of k/v + masked scaled_dot_product_attention + sigmoid + mul. The grid depends only on the
shapes and positions stay on the device, so the step can be replayed in a CUDA graph while positions advance.

Flash-decoding, two kernels:
- split: grid (B, KVH, NUM_SPLITS). A program takes the H / KVH query heads of one KV head, so each cached key and
  value is loaded once for its whole group, and one chunk of keys, [s * chunk, (s + 1) * chunk) clipped to p + 1.
  NUM_SPLITS = min(64, cdiv(L, 16)) is fixed by L (graph-safe); chunk = cdiv(p + 1, NUM_SPLITS) rounded up to
  BLOCK_N is computed on the device, so short and long contexts both spread over the splits (at B = 1, KVH = 4,
  64 splits make 256 programs for the 132 SMs of an H100 / H200). Each program runs an online softmax over its
  keys in BLOCK_N tiles and writes its partial (max m, sum l, unnormalized acc) in fp32; a program whose chunk
  starts past p writes an empty partial (m = -inf, l = 0, acc = 0).
- combine: grid (B, H, cdiv(D, 64)): o = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s with M = max_s m_s,
  then the rounding and the gate.
The dot products are fp32 broadcast-multiply-reduce on the CUDA cores, not tl.dot: a group holds H / KVH = 4 query
rows (Qwen3.5) where an MMA needs 16 (3/4 of it padding), each cached element is read once for H / KVH FMAs (the
step is memory-bound), the math stays the reference's fp32, and it runs under the Triton interpreter in every dtype.

Race-freedom: the cache at p is written by the one program whose chunk holds p; every program of the launch reads
cached keys and values only at positions < p (the key at p comes from k, v directly), so no program reads an
element another may be writing. positions must lie in [0, L): that is not checked (it would sync with the host).
"""

import torch
import triton
import triton.language as tl

from ._utils import FLOAT_DTYPES, check_tensor, new_output, round_to

MAX_SPLITS = 64
# about this many keys per split at p = L - 1 (below MAX_SPLITS splits): one 16-key tile, so short contexts at B = 1
# still spread over enough programs (the step is latency-bound there)
KEYS_PER_SPLIT = 16


@triton.jit
def _decode_attention_split_kernel(
    Q, K, V, K_CACHE, V_CACHE, POS, M_PART, L_PART, ACC_PART,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
    stride_kcb, stride_kcl, stride_kch, stride_vcb, stride_vcl, stride_vch, scale,
    H: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    i_kvh = tl.program_id(1)
    i_s = tl.program_id(2)
    pos = tl.load(POS + i_b)  # keys 0..pos are visible; pos is the new one
    # a multiple of BLOCK_N, so a tile never reaches into the next split's keys
    chunk = tl.cdiv(tl.cdiv(pos + 1, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = i_s * chunk
    stop = tl.minimum(start + chunk, pos + 1)  # start >= stop: an empty split

    rows = tl.arange(0, BLOCK_H)  # this KV head's query heads
    heads = i_kvh * GROUP + rows
    row_mask = rows < GROUP
    d = tl.arange(0, BLOCK_D)
    d_mask = d < D
    q = tl.load(Q + i_b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_D]
    k_new = tl.load(K + i_b * stride_kb + i_kvh * stride_kh + d, mask=d_mask, other=0.0)  # [BLOCK_D]
    v_new = tl.load(V + i_b * stride_vb + i_kvh * stride_vh + d, mask=d_mask, other=0.0)
    k_head = K_CACHE + i_b * stride_kcb + i_kvh * stride_kch
    v_head = V_CACHE + i_b * stride_vcb + i_kvh * stride_vch
    owner = (start <= pos) & (pos < stop)  # exactly one split of this (sequence, KV head) holds pos
    tl.store(k_head + pos * stride_kcl + d, k_new, mask=d_mask & owner)
    tl.store(v_head + pos * stride_vcl + d, v_new, mask=d_mask & owner)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(start, stop, BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        cached = (keys < pos)[:, None] & d_mask[None, :]  # [BLOCK_N, BLOCK_D]
        is_new = (keys == pos)[:, None]
        k = tl.load(k_head + keys[:, None] * stride_kcl + d[None, :], mask=cached, other=0.0)
        k = tl.where(is_new, k_new[None, :], k).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [BLOCK_H, BLOCK_N]
        s = tl.where((keys <= pos)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every tile holds a visible key
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        v = tl.load(v_head + keys[:, None] * stride_vcl + d[None, :], mask=cached, other=0.0)
        v = tl.where(is_new, v_new[None, :], v).to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)  # [BLOCK_H, BLOCK_D]
        m_i = m_new

    part = (i_b * H + heads) * NUM_SPLITS + i_s  # [BLOCK_H] rows of the [B, H, NUM_SPLITS] partials
    tl.store(M_PART + part, m_i, mask=row_mask)
    tl.store(L_PART + part, l_i, mask=row_mask)
    tl.store(ACC_PART + part[:, None] * D + d[None, :], acc, mask=row_mask[:, None] & d_mask[None, :])


@triton.jit
def _decode_attention_combine_kernel(
    GATE, M_PART, L_PART, ACC_PART, O, stride_gb, stride_gh,
    H: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_GATE: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = d < D
    splits = tl.arange(0, BLOCK_S)
    s_mask = splits < NUM_SPLITS
    part = (i_b * H + i_h) * NUM_SPLITS + splits  # [BLOCK_S]
    m = tl.load(M_PART + part, mask=s_mask, other=float("-inf"))
    l_s = tl.load(L_PART + part, mask=s_mask, other=0.0)
    acc = tl.load(ACC_PART + part[:, None] * D + d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    w = tl.exp(m - tl.max(m, axis=0))  # [BLOCK_S]; split 0 always holds key 0, empty splits weigh 0
    o = tl.sum(w[:, None] * acc, axis=0) / tl.sum(w * l_s, axis=0)  # [BLOCK_D]
    dtype = O.dtype.element_ty
    o = round_to(o, dtype)
    if HAS_GATE:
        g = tl.load(GATE + i_b * stride_gb + i_h * stride_gh + d, mask=d_mask, other=0.0).to(tl.float32)
        o = round_to(o * round_to(tl.sigmoid(g), dtype), dtype)
    tl.store(O + (i_b * H + i_h) * D + d, o.to(dtype), mask=d_mask)


def _check(q, k, v, k_cache, v_cache, positions, gate):
    check_tensor("q", q, dtypes=FLOAT_DTYPES, ndim=3)
    bsz, h, d = q.shape
    dev, dtype = q.device, (q.dtype,)
    check_tensor("k", k, dtypes=dtype, ndim=3, device=dev)
    kvh = k.shape[1]
    if k.shape[0] != bsz or k.shape[2] != d or kvh == 0 or h % kvh:
        raise ValueError(f"k has shape {tuple(k.shape)}; expected [B, KVH, D] = [{bsz}, KVH, {d}] with H={h} a "
                         f"multiple of KVH")
    check_tensor("v", v, dtypes=dtype, shape=k.shape, device=dev)
    check_tensor("k_cache", k_cache, dtypes=dtype, ndim=4, device=dev)
    max_len = k_cache.shape[1]
    if k_cache.shape != (bsz, max_len, kvh, d) or max_len == 0:
        raise ValueError(f"k_cache has shape {tuple(k_cache.shape)}; expected [B, L, KVH, D] = [{bsz}, L, {kvh}, "
                         f"{d}] with L >= 1")
    check_tensor("v_cache", v_cache, dtypes=dtype, shape=k_cache.shape, device=dev)
    check_tensor("positions", positions, dtypes=(torch.int64,), shape=(bsz,), device=dev)
    if gate is not None:
        check_tensor("gate", gate, dtypes=dtype, shape=q.shape, device=dev)
    return bsz, h, kvh, d, max_len


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    positions: torch.Tensor, gate: torch.Tensor | None = None, scale: float | None = None,
) -> torch.Tensor:
    """q: [B, H, D]; k, v: [B, KVH, D] (this step's key/value), H a multiple of KVH; k_cache, v_cache:
    [B, L, KVH, D], receive k, v at each sequence's position (in place); positions: [B] int64 in [0, L), on the
    device; gate: None or [B, H, D]; scale: None for D ** -0.5. One float dtype throughout; every tensor contiguous
    in its last dim, other strides free. Returns o [B, H, D], contiguous, in q's dtype."""
    bsz, h, kvh, d, max_len = _check(q, k, v, k_cache, v_cache, positions, gate)
    o = new_output((bsz, h, d), q.dtype, q.device)
    if bsz * h * d == 0:
        return o
    scale = d**-0.5 if scale is None else scale
    num_splits = min(MAX_SPLITS, triton.cdiv(max_len, KEYS_PER_SPLIT))
    group = h // kvh
    block_h = triton.next_power_of_2(group)
    block_d = triton.next_power_of_2(d)
    block_n = min(64, max(16, 16384 // (block_h * block_d)))  # [BLOCK_H, BLOCK_N, BLOCK_D] products of ~16384
    m_part = new_output((bsz, h, num_splits), torch.float32, q.device)
    l_part = new_output((bsz, h, num_splits), torch.float32, q.device)
    acc_part = new_output((bsz, h, num_splits, d), torch.float32, q.device)
    _decode_attention_split_kernel[(bsz, kvh, num_splits)](
        Q=q, K=k, V=v, K_CACHE=k_cache, V_CACHE=v_cache, POS=positions, M_PART=m_part, L_PART=l_part,
        ACC_PART=acc_part,
        stride_qb=q.stride(0), stride_qh=q.stride(1), stride_kb=k.stride(0), stride_kh=k.stride(1),
        stride_vb=v.stride(0), stride_vh=v.stride(1),
        stride_kcb=k_cache.stride(0), stride_kcl=k_cache.stride(1), stride_kch=k_cache.stride(2),
        stride_vcb=v_cache.stride(0), stride_vcl=v_cache.stride(1), stride_vch=v_cache.stride(2), scale=scale,
        H=h, GROUP=group, D=d, NUM_SPLITS=num_splits, BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=8 if block_h * block_n * block_d >= 16384 else 4,
    )
    block_dc = min(block_d, 64)
    _decode_attention_combine_kernel[(bsz, h, triton.cdiv(d, block_dc))](
        GATE=gate, M_PART=m_part, L_PART=l_part, ACC_PART=acc_part, O=o,
        stride_gb=gate.stride(0) if gate is not None else 0, stride_gh=gate.stride(1) if gate is not None else 0,
        H=h, D=d, NUM_SPLITS=num_splits, HAS_GATE=gate is not None,
        BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_dc, num_warps=4,
    )
    return o


def decode_attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    positions: torch.Tensor, gate: torch.Tensor | None = None, scale: float | None = None,
) -> torch.Tensor:
    """The semantics decode_attention must reproduce (pure PyTorch, fp32 math), including the in-place cache write."""
    bsz, h, d = q.shape
    kvh, max_len = k.shape[1], k_cache.shape[1]
    scale = d**-0.5 if scale is None else scale
    rows = torch.arange(bsz, device=q.device)
    k_cache[rows, positions] = k
    v_cache[rows, positions] = v
    visible = torch.arange(max_len, device=q.device)[None, :] <= positions[:, None]  # [B, L]
    # zeroed past p: a NaN there must not reach the result (0 * NaN is NaN)
    keys = torch.where(visible[:, :, None, None], k_cache.float(), 0.0)  # [B, L, KVH, D]
    values = torch.where(visible[:, :, None, None], v_cache.float(), 0.0)
    qg = q.float().reshape(bsz, kvh, h // kvh, d)  # query head h reads KV head h // (H / KVH)
    scores = torch.einsum("bkgd,blkd->bkgl", qg, keys) * scale  # [B, KVH, H / KVH, L]
    probs = torch.softmax(scores.masked_fill(~visible[:, None, None, :], float("-inf")), dim=-1)
    o = torch.einsum("bkgl,blkd->bkgd", probs, values).reshape(bsz, h, d).to(q.dtype)
    return o if gate is None else o * torch.sigmoid(gate)
