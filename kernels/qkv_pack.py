"""Fused-QKV epilogue of Qwen-Image's joint attention, for one stream (image or text).

From the fused projection qkv = cat([to_q(x), to_k(x), to_v(x)], -1) of L tokens, writes rows
[seq_offset, seq_offset + L) of the joint [B, S, H, D] buffers:
    q = rope(rms_norm(q) * w_q),  k = rope(rms_norm(k) * w_k),  v = v
Matches diffusers' QwenDoubleStreamAttnProcessor2_0 up to its torch.cat([text, image]): RMSNorm as in diffusers
(normalize in fp32, cast to the weight's dtype, multiply by the weight in that dtype), then
`apply_rotary_emb_qwen(use_real=False)` (fp32 complex multiply, cast back). The kernel rounds to the dtype at the
same two places before the fp32 rotation. The formulas are rms_norm.py's and rope.py's tiles.

FP8 attention operands (qk_scales given): q and k are written as e4m3 codes of the fp32 rotation's output times
1 / scale, clamped to +-448, with one scale per tensor that needs no amax pass: RMSNorm bounds a head's vector
(sum of its squared normalized entries = D), so |rms_norm(x) * w| <= sqrt(D) * max|w|, and the rotation keeps each
pair's norm below that (rms_norm_fp8_scale). v is written as it is (quantize_heads.py quantizes it once both
streams are in, its amax known), or, given v_scale (a bound its caller proved), as FP8 codes the same way.
"""

import math

import torch
import triton
import triton.language as tl

from ._utils import (FLOAT_DTYPES, FP8_DTYPE, FP8_MAX, TILE_ELEMENTS, check_tensor, head_block, interpreted_fit,
                     round_to)
from .rms_norm import rms_norm_ref, rms_norm_tile, row_rstd
from .rope import rope_interleaved_tile, rope_qwen_image_ref


QK_FP8_DTYPES = (FP8_DTYPE, torch.float32)
BOUND_MARGIN = 1 + 2**-7  # the normed values round to bf16 / fp16 before the rotation: up to 2^-8 above the bound
_FP8_MAX = tl.constexpr(FP8_MAX)


@triton.jit
def _to_fp8(x, S):
    """fp32 x -> clamp(x * (1 / scale), +-448), the values an e4m3 cast takes (S: the scale's pointer)."""
    inv = tl.div_rn(1.0, tl.load(S))
    return tl.clamp(x * inv, -_FP8_MAX, _FP8_MAX)


@triton.jit
def _qkv_pack_kernel(
    QKV, WQ, WK, F, Q, K, V, QS, KS, VS, L, H, n_tok, seq_offset, eps,
    stride_qkv_b, stride_qkv_l, stride_f_tok, stride_f_pair, stride_out_b, stride_out_s,
    HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    FP8: tl.constexpr, FP8_V: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T], b * L + l
    b = tok // L
    l = tok % L
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_D)
    mask = ((tok[:, None, None] < n_tok) & (heads[None, :, None] < H)
            & (cols[None, None, :] < HEAD_DIM))  # [BLOCK_T, BLOCK_H, BLOCK_D]
    head_cols = heads[None, :, None] * HEAD_DIM + cols[None, None, :]  # same layout in qkv and the outputs
    src = QKV + (b * stride_qkv_b + l * stride_qkv_l)[:, None, None] + head_cols
    dst = (b * stride_out_b + (seq_offset + l) * stride_out_s)[:, None, None] + head_cols
    pairs = tl.arange(0, BLOCK_D // 2)
    f_mask = (tok[:, None] < n_tok) & (pairs[None, :] < HEAD_DIM // 2)  # [BLOCK_T, BLOCK_D // 2]
    f_ptrs = F + l[:, None] * stride_f_tok + pairs[None, :] * stride_f_pair
    cos = tl.load(f_ptrs, mask=f_mask, other=1.0)
    sin = tl.load(f_ptrs + 1, mask=f_mask, other=0.0)

    dtype = QKV.dtype.element_ty
    # the norms' outputs round to the dtype (diffusers' RMSNorm output is in it), the rotation is fp32, cast once
    w_q = tl.load(WQ + cols, mask=cols < HEAD_DIM, other=0.0).to(tl.float32)  # [BLOCK_D]
    q = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    q = round_to(rms_norm_tile(q, row_rstd(q, HEAD_DIM, eps), w_q, False, dtype), dtype)
    q = rope_interleaved_tile(q, cos, sin, BLOCK_T, BLOCK_H, BLOCK_D)
    if FP8:
        tl.store(Q + dst, _to_fp8(q, QS).to(Q.dtype.element_ty), mask=mask)
    else:
        tl.store(Q + dst, q.to(dtype), mask=mask)

    w_k = tl.load(WK + cols, mask=cols < HEAD_DIM, other=0.0).to(tl.float32)
    k = tl.load(src + H * HEAD_DIM, mask=mask, other=0.0).to(tl.float32)
    k = round_to(rms_norm_tile(k, row_rstd(k, HEAD_DIM, eps), w_k, False, dtype), dtype)
    k = rope_interleaved_tile(k, cos, sin, BLOCK_T, BLOCK_H, BLOCK_D)
    if FP8:
        tl.store(K + dst, _to_fp8(k, KS).to(K.dtype.element_ty), mask=mask)
    else:
        tl.store(K + dst, k.to(dtype), mask=mask)

    v = tl.load(src + 2 * H * HEAD_DIM, mask=mask, other=0.0)
    if FP8_V:
        tl.store(V + dst, _to_fp8(v.to(tl.float32), VS).to(V.dtype.element_ty), mask=mask)
    else:
        tl.store(V + dst, v, mask=mask)


def _check_qkv_pack_args(qkv, norm_q_weight, norm_k_weight, freqs, q_out, k_out, v_out, seq_offset,
                         qk_scales=None, v_scale=None):
    """Validate the arguments of qkv_pack; returns (B, L, H, D)."""
    check_tensor("qkv", qkv, dtypes=FLOAT_DTYPES, ndim=3)
    check_tensor("v_out", v_out, ndim=4, device=qkv.device)
    b, s, h, d = v_out.shape
    for name, t, fp8 in (("q_out", q_out, qk_scales is not None), ("k_out", k_out, qk_scales is not None),
                         ("v_out", v_out, v_scale is not None)):
        check_tensor(name, t, dtypes=QK_FP8_DTYPES if fp8 else (qkv.dtype,), shape=v_out.shape, device=qkv.device)
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")
    scales = ([] if qk_scales is None else list(zip(("q_scale", "k_scale"), qk_scales))) + (
        [] if v_scale is None else [("v_scale", v_scale)])
    if qk_scales is not None and len(qk_scales) != 2:
        raise ValueError(f"qk_scales must be (q_scale, k_scale), got {len(qk_scales)} tensors")
    for name, t in scales:
        check_tensor(name, t, dtypes=(torch.float32,), shape=(1,), device=qkv.device)
    if d % 2:
        raise ValueError(f"head dim D={d} (from v_out's shape {tuple(v_out.shape)}) must be even for RoPE pairs")
    if qkv.shape[0] != b or qkv.shape[2] != 3 * h * d:
        raise ValueError(f"qkv has shape {tuple(qkv.shape)}; expected [B={b}, L, 3 * H * D = {3 * h * d}] "
                         f"(H={h}, D={d} from v_out's shape {tuple(v_out.shape)})")
    n_tok = qkv.shape[1]
    check_tensor("norm_q_weight", norm_q_weight, dtypes=(qkv.dtype,), shape=(d,), device=qkv.device)
    check_tensor("norm_k_weight", norm_k_weight, dtypes=(qkv.dtype,), shape=(d,), device=qkv.device)
    check_tensor("freqs", freqs, dtypes=(torch.float32,), shape=(n_tok, d // 2, 2), device=qkv.device)
    if not 0 <= seq_offset <= s - n_tok:
        raise ValueError(f"seq_offset={seq_offset} with L={n_tok} rows does not fit the joint buffers' S={s}: "
                         f"need 0 <= seq_offset <= {s - n_tok}")
    return b, n_tok, h, d


def qkv_pack(
    qkv: torch.Tensor,
    norm_q_weight: torch.Tensor,
    norm_k_weight: torch.Tensor,
    freqs: torch.Tensor,
    q_out: torch.Tensor,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
    seq_offset: int,
    eps: float = 1e-6,
    qk_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """qkv: [B, L, 3 * H * D], last dim contiguous; norm_q_weight, norm_k_weight: [D] in qkv's dtype; freqs:
    [L, D // 2, 2] fp32 (cos, sin); q_out, k_out, v_out: contiguous [B, S, H, D] in qkv's dtype. Writes rows
    [seq_offset, seq_offset + L) of the three buffers and nothing else. qk_scales: (q_scale, k_scale) fp32 [1]
    (rms_norm_fp8_scale): q_out and k_out hold FP8 codes (or, q_dtype float32, the values before the cast: the
    interpreter's fp32 -> fp8 cast mis-rounds, fp8.py) with q ~= q_out * q_scale. v_scale: fp32 [1], v_out the
    same way (the caller proved |v| <= 448 * v_scale)."""
    b, n_tok, h, d = _check_qkv_pack_args(qkv, norm_q_weight, norm_k_weight, freqs, q_out, k_out, v_out, seq_offset,
                                          qk_scales, v_scale)
    if b * n_tok * h == 0:
        return
    block_h, block_d = head_block(h), triton.next_power_of_2(d)
    block_t = interpreted_fit(max(1, TILE_ELEMENTS // 2 // (block_h * block_d)), b * n_tok)  # real: a token a program
    q_scale, k_scale = qk_scales if qk_scales is not None else (None, None)
    _qkv_pack_kernel[(triton.cdiv(b * n_tok, block_t), triton.cdiv(h, block_h))](
        QKV=qkv, WQ=norm_q_weight, WK=norm_k_weight, F=freqs, Q=q_out, K=k_out, V=v_out, QS=q_scale, KS=k_scale,
        VS=v_scale,
        L=n_tok, H=h, n_tok=b * n_tok, seq_offset=seq_offset, eps=eps,
        stride_qkv_b=qkv.stride(0), stride_qkv_l=qkv.stride(1),
        stride_f_tok=freqs.stride(0), stride_f_pair=freqs.stride(1),
        stride_out_b=q_out.stride(0), stride_out_s=q_out.stride(1),
        HEAD_DIM=d, BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_D=block_d, FP8=qk_scales is not None,
        FP8_V=v_scale is not None,
    )


def qkv_pack_ref(qkv, norm_q_weight, norm_k_weight, freqs, q_out, k_out, v_out, seq_offset, eps=1e-6,
                 qk_scales=None, v_scale=None) -> None:
    """The semantics qkv_pack must reproduce (pure PyTorch), writing the same rows of the same buffers."""
    _, n_tok, h, d = _check_qkv_pack_args(qkv, norm_q_weight, norm_k_weight, freqs, q_out, k_out, v_out, seq_offset,
                                          qk_scales, v_scale)
    q, k, v = qkv.unflatten(-1, (3, h, d)).unbind(2)  # [B, L, H, D] each
    rows = slice(seq_offset, seq_offset + n_tok)
    for x, weight, out, i in ((q, norm_q_weight, q_out, 0), (k, norm_k_weight, k_out, 1)):
        normed = rms_norm_ref(x, weight, eps)
        if qk_scales is None:
            out[:, rows] = rope_qwen_image_ref(normed, freqs)
        else:  # the rotation's fp32 output, quantized
            inv = torch.ones_like(qk_scales[i]) / qk_scales[i]  # tensor / tensor: IEEE on every device
            out[:, rows] = (rope_qwen_image_ref(normed.float(), freqs) * inv).clamp(-FP8_MAX, FP8_MAX).to(out.dtype)
    if v_scale is None:
        v_out[:, rows] = v
    else:
        inv = torch.ones_like(v_scale) / v_scale
        v_out[:, rows] = (v.float() * inv).clamp(-FP8_MAX, FP8_MAX).to(v_out.dtype)


def rms_norm_fp8_scale(weights: list[torch.Tensor], head_dim: int) -> torch.Tensor:
    """The FP8 scale (value = code * scale) of rms_norm(x) * w then rotated pairwise, for any x and any of
    `weights` (e.g. the image and text streams' norm weights, which share one joint buffer): sqrt(D) * max|w|
    (margin BOUND_MARGIN) maps to 448. fp32 [1], on the weights' device."""
    amax = torch.stack([w.detach().abs().max().float() for w in weights]).max()
    return (amax * (math.sqrt(head_dim) * BOUND_MARGIN / FP8_MAX)).reshape(1)
