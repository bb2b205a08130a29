"""Qwen-Image-2.1's block on the fused kernels (model.py's docstring has its equations and the attention layout), and
what every block of a forward reads: the modulation rows (Rows) and the attention plan (Attention).

FP8 attention (FastConfig(fp8_attention=...)): the target's queries attend in FP8 to two key sets, each quantized
once with its own v scale: the target's keys and values (this forward's, [B, T, H, D] scratch) and the prefix's (the
prefix cache in FP8, Fp8Prefix, written when the prefix is computed), one attention call each (its log-sum-exp
returned, core/model/fp8_attention.fp8_attention_lse), merged into the output projection's rowwise-FP8 operand by
one kernel (kernels/attention_merge.py). q and k take the RMSNorm bound's static scales (kernels/qkv_pack.py), which
hold for every step, so the prefix's keys are valid against any step's queries; v's scale comes from its bound over
the QKV GEMM's FP8 row scales (core/model/fp8_attention.py), or where that does not hold (FP8 GEMMs off, a LoRA on
v) from an amax pass (quantize_fp8_heads). A prefill's prefix queries attend block-causally in BF16, as without the
option (once a call).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...kernels._utils import FP8_DTYPE
from ...kernels.attention_merge import merge_attention
from ...kernels.fp8 import quantize_fp8_rowwise
from ...kernels.output_bound import output_bound_scales
from ...kernels.layer_norm_modulate import layer_norm_modulate, layer_norm_modulate_fp8
from ...kernels.qkv_pack import qkv_pack, rms_norm_fp8_scale
from ...kernels.quantize_heads import quantize_fp8_heads
from ...kernels.residual_gate import residual_gate_layer_norm_modulate, residual_gate_layer_norm_modulate_fp8
from ...kernels.swiglu import silu_mul, silu_mul_fp8
from ..core.config import FastTransformerConfig
from ..core.model.attention import TextMask, joint_attention
from ..core.model.fp8_attention import fp8_attention_lse, v_bound_terms
from ..core.model.linear import FastLinear, Operand, as_fp8_operand, q_dtype_for
from ..core.runtime.cuda_graph import read_by_graph

LINEARS = ("qkv", "out", "gate_up", "down")  # a block's fused linears: [W_q; W_k; W_v], W_out, [W_gate; W_up], W_down


class Rows:
    """What every block of a forward reads: the modulation tables [G, D] (shift: zeros, 2.1 modulates by scale
    only), each token's row of them (mod_row [B * N] int, or None: the token's sample), the rotary tables
    [N, D_head / 2, 2] of the rows in x's order, and where the target and the prefix are."""

    def __init__(self, modulation: torch.Tensor, mod_row, freqs: torch.Tensor, prefix_rows: int, target_rows: int):
        dim = modulation.shape[1] // 4
        scale1, gate1, scale2, gate2 = modulation.split(dim, dim=1)  # [mod1 scale, gate | mod2 scale, gate]
        self.scale1, self.scale2 = scale1.contiguous(), scale2.contiguous()
        self.gate1, self.gate2 = gate1.tanh().contiguous(), gate2.tanh().contiguous()  # as the block's gate.tanh()
        self.shift = torch.zeros_like(self.scale1)
        self.mod_row, self.freqs = mod_row, freqs
        self.prefix_rows, self.target_rows = prefix_rows, target_rows


class Attention:
    """One forward's attention plan: the keys' padding ([target, prefix] per sample), and for a prefill the prefix's
    segments (diffusers' (start, end, is_text) runs) and key validity [B, P]. fp8: the FP8 attention kernel (None:
    `backend` in BF16), prefix_valid: int32 [B] each sample's valid prefix keys (None: all)."""

    def __init__(self, backend: str, seqused_k: torch.Tensor, key_mask: torch.Tensor, segments=None,
                 prefix_key_valid=None, fp8: str | None = None, prefix_valid: torch.Tensor | None = None):
        self.backend, self.mask = backend, TextMask.of(seqused_k, key_mask)
        self.segments, self.prefix_key_valid = segments, prefix_key_valid
        self.fp8, self.prefix_valid = fp8, prefix_valid


class PairedAttention:
    """Batched CFG's cached step (model.py's _forward_pair): x's rows are the prompt's B samples, then the negative
    prompt's B, each half attending to its own branch's keys: its Attention plan, its target's rotary tables
    [T, D_head / 2, 2] (a target's positions follow its prefix: the branches' differ) and its prefix cache (the
    block's kv: one per branch). The GEMMs and the per-token kernels run once over both halves."""

    def __init__(self, branches: tuple, freqs: tuple, batch: int):
        self.branches, self.freqs = branches, freqs
        self.halves = (slice(0, batch), slice(batch, 2 * batch))
        self.fp8 = branches[0].fp8


class Fp8Prefix:
    """One block's prefix keys and values in FP8 (the prefix cache under FP8 attention): k8, v8 [B, P, H, D] e4m3
    (k at the block's static k scale), v_scales fp32 [B, H]; quantized once, when the prefix is computed."""

    def __init__(self, shape: tuple, device):
        self.k8 = torch.empty(shape, dtype=FP8_DTYPE, device=device)
        self.v8 = torch.empty(shape, dtype=FP8_DTYPE, device=device)
        self.v_scales = torch.empty(shape[0], shape[2], dtype=torch.float32, device=device)

    def __iter__(self):  # its tensors, as a BF16 block's (key, value) pair iterates
        return iter((self.k8, self.v8, self.v_scales))


class AttentionPart(nn.Module):
    """The block's attention as a module of its own, `transformer_blocks.<i>.attn` as in the stock block, so that
    diffusers' attention-level step cache hooks (TaylorSeerCacheConfig's default pattern) find it and cache or
    predict its output as they do the stock `attn`'s: from the block's normed rows to the output projection's
    [B, N, D] in the joint order. It holds no weights (they stay the block's: its state dict is unchanged); the
    block passes itself in."""

    def forward(self, block: "FastBlock21", h, shape: tuple, rows: Rows, plan, kv,
                scratch) -> torch.Tensor:
        return block.attention(h, shape, rows, plan, kv, scratch)


class FastBlock21(nn.Module):
    """A QwenImage21TransformerBlock on fused kernels (the module docstring)."""

    def __init__(self, dim: int, heads: int, head_dim: int, mlp_dim: int, config: FastTransformerConfig,
                 eps: float = 1e-6, dtype=None, device=None):
        super().__init__()
        self.dim, self.heads, self.head_dim, self.eps, self.fp8 = dim, heads, head_dim, eps, config.fp8
        for name, (k, n) in zip(LINEARS, ((dim, 3 * dim), (dim, dim), (dim, 2 * mlp_dim), (mlp_dim, dim))):
            setattr(self, name, FastLinear(k, n, config.fp8, config.fp8_fast_accum, dtype=dtype, device=device))
        self.norm_q = nn.Parameter(torch.empty(head_dim, dtype=dtype, device=device), requires_grad=False)
        self.norm_k = nn.Parameter(torch.empty(head_dim, dtype=dtype, device=device), requires_grad=False)
        self.attn = AttentionPart()

    @classmethod
    @torch.no_grad()
    def from_stock(cls, block, config: FastTransformerConfig, device) -> "FastBlock21":
        attn, mlp = block.attn, block.img_mlp
        weights = {"qkv": torch.cat([attn.to_q.weight, attn.to_k.weight, attn.to_v.weight]),
                   "out": attn.to_out[0].weight,
                   "gate_up": torch.cat([mlp.gate_layer.weight, mlp.proj.weight]),  # SwiGLU's gate first
                   "down": mlp.out.weight}
        dim, dtype = attn.to_q.weight.shape[1], attn.to_q.weight.dtype
        with torch.device("meta"):
            fast = cls(dim, attn.heads, attn.inner_dim // attn.heads, mlp.proj.weight.shape[0], config,
                       block.img_norm1.eps, dtype)
        for name, weight in weights.items():  # 2.1 has no biases: zeros give the output dtype and add nothing
            setattr(fast, name, FastLinear.from_weight(weight, weight.new_zeros(weight.shape[0]), config.fp8, device,
                                                       config.fp8_fast_accum))
        fast.norm_q = nn.Parameter(attn.norm_q.weight.detach().to(device), requires_grad=False)
        fast.norm_k = nn.Parameter(attn.norm_k.weight.detach().to(device), requires_grad=False)
        if attn.norm_q.eps != block.img_norm1.eps:
            raise ValueError(f"the block's norms use eps {block.img_norm1.eps} and {attn.norm_q.eps}; the fast block "
                             "takes one")
        return fast

    def rows(self, x: torch.Tensor) -> Operand:
        """A [B, N, K] row tensor as the next GEMM's operand (FP8: quantized per row)."""
        flat = x.reshape(-1, x.shape[-1])
        return as_fp8_operand(*quantize_fp8_rowwise(flat, q_dtype_for(x.device))) if self.fp8 else flat

    def head(self, x, tail, rows: Rows, scale) -> tuple[torch.Tensor, Operand]:
        """[x + tanh(gate) * out of the previous part], then LayerNorm * (1 + scale): (x, the GEMM's operand)."""
        q_dtype = q_dtype_for(x.device)
        if tail is None:
            if self.fp8:
                return x, as_fp8_operand(*layer_norm_modulate_fp8(x, rows.shift, scale, mod_row=rows.mod_row,
                                                                  eps=self.eps, q_dtype=q_dtype))
            return x, layer_norm_modulate(x, rows.shift, scale, mod_row=rows.mod_row, eps=self.eps).flatten(0, 1)
        out, gate = tail
        if self.fp8:
            x, q, s = residual_gate_layer_norm_modulate_fp8(x, out, gate, rows.shift, scale, mod_row=rows.mod_row,
                                                            eps=self.eps, q_dtype=q_dtype)
            return x, as_fp8_operand(q, s)
        x, y = residual_gate_layer_norm_modulate(x, out, gate, rows.shift, scale, mod_row=rows.mod_row, eps=self.eps)
        return x, y.flatten(0, 1)

    def forward(self, x: torch.Tensor, tail, rows: Rows, plan, kv, scratch):
        """x [B, N, D] (tail: the previous block's (out, tanh gate) not yet added); kv: this block's key and value
        buffers [B, T + P, H, D] (a cached step's hold the prefix at rows T..), or its Fp8Prefix; scratch: the
        attention's scratch (attention()). Returns (x, tail) with this block's MLP left as the tail."""
        x, h = self.head(x, tail, rows, rows.scale1)
        a = self.attn(self, h, x.shape, rows, plan, kv, scratch)
        x, h = self.head(x, (a, rows.gate1), rows, rows.scale2)
        gate_up = self.gate_up(h)
        m = as_fp8_operand(*silu_mul_fp8(gate_up, q_dtype_for(x.device))) if self.fp8 else silu_mul(gate_up)
        return x, (self.down(m).view(x.shape), rows.gate2)

    def attention(self, h, shape: tuple, rows: Rows, plan, kv, scratch) -> torch.Tensor:
        """The normed rows h (the QKV GEMM's operand) of x [B, N, D] = shape -> the output projection of the
        attention [B, N, D]; the keys and values written into kv on the way. BF16 attention: kv the block's (key,
        value) buffers [B, T + P, H, D], scratch the queries' buffer of that shape; FP8 (plan.fp8): kv its
        Fp8Prefix, scratch the target's (q8, k8, v8) [B, T, H, D] e4m3. Under batched CFG (plan a PairedAttention)
        kv and the BF16 scratch are a pair, one per branch."""
        batch, n, dim = shape
        qkv = self.qkv(h).view(batch, n, 3 * dim)
        if plan.fp8:
            operand = self.attention_fp8(h, qkv, rows, plan, kv, scratch)
        elif isinstance(plan, PairedAttention):  # a cached step: the target's rows only
            o = torch.empty(batch, n, self.heads, self.head_dim, dtype=qkv.dtype, device=qkv.device)
            for half, branch, freqs, branch_kv, queries in zip(plan.halves, plan.branches, plan.freqs, kv, scratch):
                o[half] = self.attend_bf16(qkv[half], freqs, 0, n, branch, branch_kv, queries)
            operand = self.rows(o.view(batch, n, dim))
        else:
            o = self.attend_bf16(qkv, rows.freqs, rows.prefix_rows, rows.target_rows, plan, kv, scratch)
            operand = self.rows(o.view(batch, n, dim))
        return self.out(operand).view(batch, n, dim)

    def attend_bf16(self, qkv, freqs, p: int, t: int, plan: Attention, kv, queries) -> torch.Tensor:
        """qkv [B, p + t, 3D] (a prefill's prefix rows first) -> the attention [B, p + t, H, D], their keys and
        values written into kv's buffers ([target, prefix]) and the queries into `queries` on the way."""
        k, v = kv
        qkv_pack(qkv[:, p:], self.norm_q, self.norm_k, freqs[p:], queries, k, v, 0, self.eps)
        if p:
            qkv_pack(qkv[:, :p], self.norm_q, self.norm_k, freqs[:p], queries, k, v, t, self.eps)
        return attend(queries, k, v, t, p, plan)

    def qk_fp8_scales(self, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """FP8 attention's q and k scales (the RMSNorm bound: any input, any step): [1] each (qkv_pack's), then
        [batch, H] each (the attention kernel's descales), computed once for these norm weights and batch."""
        key = (batch,) + tuple((w.data_ptr(), w._version) for w in (self.norm_q, self.norm_k))
        if getattr(self, "_qk_fp8_key", None) != key:
            scales = tuple(rms_norm_fp8_scale([w], self.head_dim) for w in (self.norm_q, self.norm_k))
            self._qk_fp8_scales = scales + tuple(s.expand(batch, self.heads).contiguous() for s in scales)
            self._qk_fp8_key = key
        return self._qk_fp8_scales

    def v_fp8_scale(self, h) -> torch.Tensor | None:
        """v's FP8 scale [1] from its bound over the QKV GEMM's FP8 row scales (every row of this forward: a
        prefill's prefix and target share it), or None where the bound does not hold (the operand or the weight not
        FP8, a LoRA adding to v's rows)."""
        terms = v_bound_terms(h, self.qkv, self.heads * self.head_dim)
        return None if terms is None else output_bound_scales([h[1].reshape(-1, 1)], [terms], 1.0)[:1]

    def attention_fp8(self, h, qkv, rows: Rows, plan, kv, scratch: tuple) -> Operand:
        """attention()'s FP8 path (the module docstring) -> the output projection's operand. Under batched CFG
        (plan a PairedAttention, a cached step) each half's queries attend to its own branch's prefix cache (kv: a
        pair of Fp8Prefix); the target's own keys, per sample, are one call for both."""
        batch, n, dim = qkv.shape[0], qkv.shape[1], self.heads * self.head_dim
        t, p = rows.target_rows, rows.prefix_rows
        if isinstance(plan, PairedAttention):
            halves, branches, freqs, prefixes = plan.halves, plan.branches, plan.freqs, kv
        else:
            halves, branches, freqs, prefixes = (slice(None),), (plan,), (rows.freqs[p:],), (kv,)
        q8, k8, v8 = scratch
        q_scale, k_scale, q_descale, k_descale = self.qk_fp8_scales(batch)
        qk_scales = (q_scale, k_scale)
        read_by_graph(q_scale, k_scale, q_descale, k_descale)
        v_scale = self.v_fp8_scale(h)
        v = v8 if v_scale is not None else torch.empty(v8.shape, dtype=qkv.dtype, device=qkv.device)
        for half, half_freqs in zip(halves, freqs):
            qkv_pack(qkv[half, p:], self.norm_q, self.norm_k, half_freqs, q8[half], k8[half], v[half], 0, self.eps,
                     qk_scales=qk_scales, v_scale=v_scale)
        if v_scale is None:
            v8, v_scales = quantize_fp8_heads(v, torch.full((batch,), t, dtype=torch.int32, device=v.device),
                                              per_tensor=False)
        else:
            v_scales = v_scale.expand(batch, self.heads)
        prefix_o = self._prefill_prefix(qkv[:, :p], rows, plan, kv, qk_scales, v_scale) if p else None
        o_t, lse_t = fp8_attention_lse(plan.fp8, q8, k8, v8, q_descale, k_descale, v_scales, dtype=qkv.dtype)
        fp8_out = self.out.fp8  # the output projection's rowwise-FP8 operand [B, N, D], the prefix's rows first
        out = torch.empty(batch, n, dim, dtype=q_dtype_for(qkv.device) if fp8_out else qkv.dtype, device=qkv.device)
        scales = torch.empty(batch, n, dtype=torch.float32, device=qkv.device) if fp8_out else None
        for half, branch, prefix in zip(halves, branches, prefixes):
            o_p, lse_p = fp8_attention_lse(plan.fp8, q8[half], prefix.k8, prefix.v8, q_descale[half],
                                           k_descale[half], prefix.v_scales, branch.prefix_valid, qkv.dtype)
            merge_attention(o_t[half], lse_t[half], o_p, lse_p, out[half, p:],
                            scales[half, p:] if fp8_out else None)
        if p and fp8_out:
            prefix_codes, prefix_scales = quantize_fp8_rowwise(prefix_o.reshape(batch, p, dim), out.dtype)
            out[:, :p], scales[:, :p] = prefix_codes, prefix_scales[..., 0]
        elif p:
            out[:, :p] = prefix_o.reshape(batch, p, dim)
        return as_fp8_operand(out.view(-1, dim), scales.view(-1, 1)) if fp8_out else out.view(-1, dim)

    def _prefill_prefix(self, qkv, rows: Rows, plan: Attention, prefix: Fp8Prefix, qk_scales, v_scale):
        """A prefill's prefix rows qkv [B, P, 3D]: their keys and values into the FP8 prefix cache (k at the static
        scale; v at v_scale, the target's in this forward, or measured over the valid keys); returns the prefix
        queries' block-causal attention [B, P, H, D] in BF16 (the BF16 path's)."""
        batch, p = qkv.shape[:2]
        q, k, v = (torch.empty(batch, p, self.heads, self.head_dim, dtype=qkv.dtype, device=qkv.device)
                   for _ in range(3))
        qkv_pack(qkv, self.norm_q, self.norm_k, rows.freqs[:p], q, k, v, 0, self.eps)
        q8 = torch.empty(q.shape, dtype=FP8_DTYPE, device=q.device)  # written, unread: the prefix queries' are BF16
        if v_scale is not None:
            qkv_pack(qkv, self.norm_q, self.norm_k, rows.freqs[:p], q8, prefix.k8, prefix.v8, 0, self.eps,
                     qk_scales=qk_scales, v_scale=v_scale)
            prefix.v_scales.copy_(v_scale.expand(batch, self.heads))
        else:
            qkv_pack(qkv, self.norm_q, self.norm_k, rows.freqs[:p], q8, prefix.k8, v, 0, self.eps,
                     qk_scales=qk_scales)  # v written again, the same values
            valid = plan.prefix_valid if plan.prefix_valid is not None else torch.full(
                (batch,), p, dtype=torch.int32, device=v.device)
            v8, v_scales = quantize_fp8_heads(v, valid, per_tensor=False)
            prefix.v8.copy_(v8)
            prefix.v_scales.copy_(v_scales)
        return prefix_attention(q, k, v, plan)


def attend(q, k, v, t: int, p: int, plan: Attention) -> torch.Tensor:
    """q, k, v [B, T + P, H, D] as [target, prefix] -> the outputs [B, p + t, H, D] in the joint order [prefix,
    target]: the target's queries attend to every valid key, the prefix's (p > 0, a prefill) block-causally."""
    target = joint_attention(q[:, :t].contiguous(), k, v, plan.mask, plan.backend)  # a view when B = 1
    if not p:
        return target
    return torch.cat([prefix_attention(q[:, t:], k[:, t:], v[:, t:], plan), target], dim=1).contiguous()


def prefix_attention(q, k, v, plan: Attention) -> torch.Tensor:
    """A prefill's prefix queries q [B, P, H, D] against its keys and values (diffusers' QwenImage21AttnProcessor:
    causal over text, bidirectional inside each image block, padded keys masked) -> [B, P, H, D]."""
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, P, D]
    outputs = []
    for start, end, is_text in plan.segments:  # diffusers' QwenImage21AttnProcessor prefill, segment by segment
        mask = None
        if is_text:
            length = end - start
            mask = torch.cat([torch.ones(length, start, dtype=torch.bool, device=q.device),
                              torch.tril(torch.ones(length, length, dtype=torch.bool, device=q.device))], dim=1)
        if plan.prefix_key_valid is not None:
            valid = plan.prefix_key_valid[:, None, None, :end]
            mask = valid if mask is None else mask & valid
        outputs.append(F.scaled_dot_product_attention(qt[:, :, start:end], kt[:, :, :end], vt[:, :, :end],
                                                      attn_mask=mask))
    return torch.cat(outputs, dim=2).transpose(1, 2)
