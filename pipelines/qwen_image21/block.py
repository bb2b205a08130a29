"""Qwen-Image-2.1's block on the fused kernels (model.py's docstring has its equations and the attention layout), and
what every block of a forward reads: the modulation rows (Rows) and the attention plan (Attention)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...kernels.fp8 import quantize_fp8_rowwise
from ...kernels.layer_norm_modulate import layer_norm_modulate, layer_norm_modulate_fp8
from ...kernels.qkv_pack import qkv_pack
from ...kernels.residual_gate import residual_gate_layer_norm_modulate, residual_gate_layer_norm_modulate_fp8
from ...kernels.swiglu import silu_mul, silu_mul_fp8
from ..core.config import FastTransformerConfig
from ..core.model.attention import TextMask, joint_attention
from ..core.model.linear import FastLinear, Operand, as_fp8_operand, q_dtype_for

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
    segments (diffusers' (start, end, is_text) runs) and key validity [B, P]."""

    def __init__(self, backend: str, seqused_k: torch.Tensor, key_mask: torch.Tensor, segments=None,
                 prefix_key_valid=None):
        self.backend, self.mask = backend, TextMask.of(seqused_k, key_mask)
        self.segments, self.prefix_key_valid = segments, prefix_key_valid


class AttentionPart(nn.Module):
    """The block's attention as a module of its own, `transformer_blocks.<i>.attn` as in the stock block, so that
    diffusers' attention-level step cache hooks (TaylorSeerCacheConfig's default pattern) find it and cache or
    predict its output as they do the stock `attn`'s: from the block's normed rows to the output projection's
    [B, N, D] in the joint order. It holds no weights (they stay the block's: its state dict is unchanged); the
    block passes itself in."""

    def forward(self, block: "FastBlock21", h, shape: tuple, rows: Rows, plan: "Attention", kv: tuple,
                scratch_q: torch.Tensor) -> torch.Tensor:
        return block.attention(h, shape, rows, plan, kv, scratch_q)


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

    def forward(self, x: torch.Tensor, tail, rows: Rows, plan: Attention, kv: tuple, scratch_q: torch.Tensor):
        """x [B, N, D] (tail: the previous block's (out, tanh gate) not yet added); kv: this block's key and value
        buffers [B, T + P, H, D] (a cached step's hold the prefix at rows T..); scratch_q: the queries' buffer of
        that shape. Returns (x, tail) with this block's MLP left as the tail."""
        x, h = self.head(x, tail, rows, rows.scale1)
        a = self.attn(self, h, x.shape, rows, plan, kv, scratch_q)
        x, h = self.head(x, (a, rows.gate1), rows, rows.scale2)
        gate_up = self.gate_up(h)
        m = as_fp8_operand(*silu_mul_fp8(gate_up, q_dtype_for(x.device))) if self.fp8 else silu_mul(gate_up)
        return x, (self.down(m).view(x.shape), rows.gate2)

    def attention(self, h, shape: tuple, rows: Rows, plan: Attention, kv: tuple, scratch_q) -> torch.Tensor:
        """The normed rows h (the QKV GEMM's operand) of x [B, N, D] = shape -> the output projection of the
        attention [B, N, D]; the keys and values written into kv on the way."""
        batch, n, dim = shape
        qkv = self.qkv(h).view(batch, n, 3 * dim)
        k, v = kv
        t, p = rows.target_rows, rows.prefix_rows
        qkv_pack(qkv[:, p:], self.norm_q, self.norm_k, rows.freqs[p:], scratch_q, k, v, 0, self.eps)
        if p:
            qkv_pack(qkv[:, :p], self.norm_q, self.norm_k, rows.freqs[:p], scratch_q, k, v, t, self.eps)
        o = attend(scratch_q, k, v, t, p, plan)  # [B, N, H, D] in x's order
        return self.out(self.rows(o.view(batch, n, dim))).view(batch, n, dim)


def attend(q, k, v, t: int, p: int, plan: Attention) -> torch.Tensor:
    """q, k, v [B, T + P, H, D] as [target, prefix] -> the outputs [B, p + t, H, D] in the joint order [prefix,
    target]: the target's queries attend to every valid key, the prefix's (p > 0, a prefill) block-causally."""
    target = joint_attention(q[:, :t].contiguous(), k, v, plan.mask, plan.backend)  # a view when B = 1
    if not p:
        return target
    qt, kt, vt = (x[:, t:].transpose(1, 2) for x in (q, k, v))  # the prefix [B, H, P, D], its own order
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
    return torch.cat([torch.cat(outputs, dim=2).transpose(1, 2), target], dim=1).contiguous()
