"""One fused dual-stream block of the fast transformer, and the kernels' glue between its GEMMs.

Per block and stream (image tokens L_img, text tokens L_txt):

    [previous block's residual + gate2 * mlp] + norm1 + mod1 (+fp8) in one kernel -> fused QKV GEMM
    -> qkv_pack (QK-norm, RoPE, into joint [B, L_img + L_txt, H, D] buffers) -> attention (padded text keys masked)
    -> attn_split (+fp8) -> output GEMM -> residual + gate1, norm2 + mod2 (+fp8) in one kernel -> fc1 GEMM
    -> gelu (+fp8) -> fc2 GEMM, whose gated residual add the next block's first kernel does (norm_out's after the
       last block)
"""

import functools
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers.hooks._helpers import TransformerBlockMetadata, TransformerBlockRegistry
from diffusers.models.attention import AttentionModuleMixin

from ....kernels.attn_split_fp8 import attn_split_fp8
from ....kernels.fp8 import quantize_fp8_rowwise
from ....kernels.gelu_fp8 import gelu_fp8
from ....kernels.layer_norm_modulate import layer_norm_modulate, layer_norm_modulate_fp8
from ....kernels.output_bound import output_bound_scales
from ....kernels.qkv_pack import qkv_pack, rms_norm_fp8_scale
from ....kernels.residual_gate import (
    residual_gate,
    residual_gate_layer_norm_modulate,
    residual_gate_layer_norm_modulate_fp8,
)
from ...core.config import FastTransformerConfig
from ...core.runtime.context import count_blocks, get_context
from ...core.runtime.cuda_graph import read_by_graph
from ...core.runtime.parallel import Ulysses, UlyssesPlan
from ...core.runtime.taylorseer import PendingTerm
from ...core.model.attention import TextMask, joint_attention
from ...core.model.fp8_attention import CudnnFp8Attention, fp8_attention, v_bound_terms
from ...core.model.linear import FastLinear, Operand, as_fp8_operand, q_dtype_for
from ...core.model.numerics import clip_float16
from .step_caches import past_hooks

# Producers of the next GEMM's operand: FP8 (q, scale) rows when that linear runs in FP8, else plain rows [M, D].

def norm_mod(x, shift, scale, mod_row, fp8: bool) -> Operand:
    if fp8:
        return as_fp8_operand(*layer_norm_modulate_fp8(x, shift, scale, mod_row=mod_row, q_dtype=q_dtype_for(x.device)))
    return layer_norm_modulate(x, shift, scale, mod_row=mod_row).view(-1, x.shape[-1])


def gate_norm_mod(residual, x, gate, shift, scale, mod_row, fp8: bool,
                  prior: "Tail | None" = None) -> tuple[torch.Tensor, Operand]:
    """residual [+ prior.gate * prior.out] + gate * x, then LayerNorm + modulation: (new residual, next operand); x
    a tensor or a TaylorSeer prediction whose last term is still pending, summed here."""
    extras = {} if prior is None else dict(prior=(prior.out, prior.gate))
    if isinstance(x, PendingTerm):
        x, extras["x_term"] = x.x, (x.f, x.c)
    if fp8:
        residual, q, s = residual_gate_layer_norm_modulate_fp8(
            residual, x, gate, shift, scale, mod_row=mod_row, q_dtype=q_dtype_for(x.device), **extras)
        return residual, as_fp8_operand(q, s)
    residual, y = residual_gate_layer_norm_modulate(residual, x, gate, shift, scale, mod_row=mod_row, **extras)
    return residual, y.view(-1, y.shape[-1])


def gelu(h: torch.Tensor, fp8: bool) -> Operand:
    if fp8:
        return as_fp8_operand(*gelu_fp8(h, q_dtype=q_dtype_for(h.device)))
    return F.gelu(h, approximate="tanh")


def split_attention(o: torch.Tensor, img_len: int, img_fp8: bool, txt_fp8: bool,
                    o_scale: torch.Tensor | None = None) -> tuple[Operand, Operand]:
    """Joint output [B, S, H, D] -> the image and text operands of the two output projections. o_scale: o holds FP8
    codes with this per-tensor scale [1] (cuDNN's FP8 attention): each part's codes as they are, the scale per row,
    or dequantized for a linear that is not FP8."""
    batch, seq = o.shape[:2]
    o = o.view(batch, seq, -1)
    if o_scale is not None:  # each part's codes copied out (a GEMM operand is one [M, K] matrix), o_scale per row
        qi, si, qt, st = attn_split_fp8(o, img_len, o_scale=o_scale)
        return tuple(as_fp8_operand(q, s) if fp8 else (q.float() * o_scale).to(torch.bfloat16)
                     for q, s, fp8 in ((qi, si, img_fp8), (qt, st, txt_fp8)))
    if img_fp8 and txt_fp8:
        qi, si, qt, st = attn_split_fp8(o, img_len, q_dtype=q_dtype_for(o.device))
        return as_fp8_operand(qi, si), as_fp8_operand(qt, st)
    parts = (o[:, :img_len].reshape(-1, o.shape[-1]), o[:, img_len:].reshape(-1, o.shape[-1]))
    return tuple(as_fp8_operand(*quantize_fp8_rowwise(p, q_dtype_for(o.device))) if fp8 else p
                 for p, fp8 in zip(parts, (img_fp8, txt_fp8)))


def batch_first(x: Operand, batch: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A GEMM operand of rows [B * L, K] (or FP8 (q, scale)) as [B, L, K] and its scale (None)."""
    q, scale = x if isinstance(x, tuple) else (x, None)
    return q.view(batch, -1, q.shape[-1]), scale


def as_operand(rows: torch.Tensor, scale: torch.Tensor | None) -> Operand:
    flat = rows.reshape(-1, rows.shape[-1])
    return flat if scale is None else (flat, scale)


@dataclass
class Tail:
    """A block's last step left to the next block's first kernel: residual += gate * out."""

    out: torch.Tensor  # [B, L, D]
    gate: torch.Tensor  # [G, D]


def add_tail(residual, tail: Tail | None, mod_row) -> torch.Tensor:
    return residual if tail is None else residual_gate(residual, tail.out, tail.gate, mod_row=mod_row)


def head(residual, tail: Tail | None, shift, scale, mod_row, fp8: bool) -> tuple[torch.Tensor, Operand]:
    """[residual + gate * out of the previous block], then LayerNorm + modulation: (new residual, next operand)."""
    if tail is None:
        return residual, norm_mod(residual, shift, scale, mod_row, fp8)
    return gate_norm_mod(residual, tail.out, tail.gate, shift, scale, mod_row, fp8)


class StreamMods:
    """One stream's modulation for one block, as [G, D] views of the [G, 6D] mod output (G = B, or 2B with
    zero_cond_t) in diffusers' chunk order: shift1, scale1, gate1, shift2, scale2, gate2."""

    def __init__(self, mods: torch.Tensor):
        self.shift1, self.scale1, self.gate1, self.shift2, self.scale2, self.gate2 = mods.chunk(6, dim=-1)


@dataclass
class JointInputs:
    """What every block of one forward shares: text mask, rotary tables, timestep embeddings, attention backend,
    the joint Q/K/V buffer [3, B, L_img + L_txt, H, D] each block refills (image first, attention.py says why), and
    under Ulysses the group and where this rank's rows are (core/runtime/parallel.py); then rotary tables, mod_row and
    the buffer cover this rank's rows only, the mask the whole sequence."""

    mask: TextMask | None
    img_freqs: torch.Tensor  # [L_img, D_head / 2, 2] fp32 (cos, sin)
    txt_freqs: torch.Tensor  # [L_txt, D_head / 2, 2]
    silu_temb: torch.Tensor | None  # [G, D]: image modulation input (G = 2B with zero_cond_t: timestep t, then 0)
    silu_temb_t: torch.Tensor | None  # [B, D]: text modulation input (timestep t); both None with a table
    mod_row: torch.Tensor | None  # zero_cond_t: int32 [B * L_img], each image token's modulation row
    backend: str
    qkv: torch.Tensor
    ulysses: Ulysses | None = None
    plan: UlyssesPlan | None = None
    graph_key: tuple = ()  # on_buffers: the signature of the buffers, which the block graphs reading them are keyed by
    fp8_attention: str | None = None  # the FP8 attention kernel (fp8_attention.py), None: `backend` in BF16
    qkv8: torch.Tensor | None = None  # with it: FP8 [3, B, S, H, D] (v there when its bound holds, else in qkv[2])
    valid_keys: torch.Tensor | None = None  # with it: int32 [B], each sample's valid keys (the mask's, or all)

    def on_buffers(self, graphs) -> "JointInputs":
        """These inputs copied into the buffers that block graphs read (graphs: core/runtime/block_graphs.py's
        BlockGraphs), the Q/K/V buffer one of them (scratch): what every block of a forward shares, filled once per
        forward."""
        tensors = dict(img_freqs=self.img_freqs, txt_freqs=self.txt_freqs, silu_temb=self.silu_temb,
                       silu_temb_t=self.silu_temb_t, mod_row=self.mod_row)
        if self.mask is not None:
            tensors.update(seqused_k=self.mask.seqused_k, key_mask=self.mask.key_mask)
        tensors = {name: t for name, t in tensors.items() if t is not None}
        tensors |= {} if self.valid_keys is None else {"valid_keys": self.valid_keys}
        shared = graphs.block_buffers("joint", tensors)
        scratch = graphs.block_buffers("qkv", {"qkv": self.qkv} | ({} if self.qkv8 is None else {"qkv8": self.qkv8}),
                                       fill=False)
        mask = None if self.mask is None else TextMask.of(shared["seqused_k"], shared["key_mask"])
        return replace(self, mask=mask, qkv=scratch["qkv"], qkv8=scratch.get("qkv8"),
                       graph_key=(id(shared), id(scratch)),
                       **{name: shared.get(name) for name in ("img_freqs", "txt_freqs", "silu_temb", "silu_temb_t",
                                                             "mod_row", "valid_keys")})

    def rows(self, rows: slice, batch: int) -> "JointInputs":
        """These inputs for the batch rows `rows` of `batch` (an attention-level cache's rule computing some
        branches' attention only): the Q/K/V buffer and the mask cut to them."""
        if rows == slice(None) or rows == slice(0, batch):
            return self
        if self.ulysses is not None:
            raise ValueError("attention for part of the batch under Ulysses")  # step caches refuse Ulysses first
        mask = None if self.mask is None else TextMask.of(self.mask.seqused_k[rows], self.mask.key_mask[rows])
        if self.fp8_attention:
            return replace(self, mask=mask, qkv=self.qkv[:, rows], qkv8=self.qkv8[:, rows],
                           valid_keys=self.valid_keys[rows])
        return replace(self, mask=mask, qkv=self.qkv[:, rows])

    def attention(self) -> torch.Tensor:
        """Attention over the joint sequence of the rows in `qkv`: [B, rows, H, D]."""
        if self.ulysses is None:
            return joint_attention(*self.qkv.unbind(0), self.mask, self.backend)
        q, k, v = self.ulysses.to_heads(self.qkv, self.plan).unbind(0)
        return self.ulysses.to_rows(joint_attention(q, k, v, self.mask, self.backend), self.plan)


class JointAttention(AttentionModuleMixin, nn.Module):
    """A block's attention as diffusers' `attn` module of a QwenImageTransformerBlock computes it: from the two
    streams' normalized, modulated rows to their attention outputs after the output projections. It holds no
    weights (the block's linears are passed in, so state-dict keys stay the block's): it is a module only so that
    diffusers' attention-level step caches (TaylorSeer, Pyramid Attention Broadcast) find and hook it at
    `transformer_blocks.<i>.attn`, as on the stock model."""

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, joint: "JointInputs",
                block: "FastBlock", scales: tuple = (None, None), text_out: bool = True):
        """hidden_states [B, L_img, D] / encoder_hidden_states [B, L_txt, D]: the rows the QKV GEMMs take, FP8 with
        their row scales [B * L, 1] in `scales` (None: not FP8), batch-first as diffusers passes its attention the
        normalized streams (its caches read the batch size off them). Returns (img [B, L_img, D], txt [B, L_txt, D]
        or None when not text_out). Called by a step cache's hook with block graphs on, it replays from its own."""
        graphs = get_context().block_graphs
        if graphs is None:
            return self.attend(hidden_states, encoder_hidden_states, joint, block, scales, text_out)
        inputs = dict(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states, img_scale=scales[0],
                      txt_scale=scales[1])
        return graphs.graphed_block(self, "attn", inputs, lambda hidden_states, encoder_hidden_states, img_scale,
                                    txt_scale: self.attend(hidden_states, encoder_hidden_states, joint, block,
                                                           (img_scale, txt_scale), text_out), joint.graph_key)

    def attend(self, hidden_states, encoder_hidden_states, joint: "JointInputs", block: "FastBlock", scales: tuple,
               text_out: bool):
        batch, img_len, dim = hidden_states.shape
        txt_len = encoder_hidden_states.shape[1]
        img_x, txt_x = as_operand(hidden_states, scales[0]), as_operand(encoder_hidden_states, scales[1])
        fp8 = block.config.is_fp8
        q, k, v = joint.qkv.unbind(0)
        qk_scales, v_bound, v_scale, o_scale = None, None, None, None
        if joint.fp8_attention:  # q and k into the FP8 buffers, scaled by the RMSNorm bound; v too where its holds
            q, k, v8 = joint.qkv8.unbind(0)
            qk_scales, v_bound = block.qk_fp8_scales(), block.v_fp8_scales(img_x, txt_x)
            read_by_graph(*qk_scales)  # cached for these weights, made before the forward
            v, v_scale = (v, None) if v_bound is None else (v8, v_bound[:1])
        qkv_pack(block.img_qkv(img_x).view(batch, img_len, -1), block.norm_q, block.norm_k, joint.img_freqs,
                 q, k, v, 0, eps=block.eps, qk_scales=qk_scales, v_scale=v_scale)
        qkv_pack(block.txt_qkv(txt_x).view(batch, txt_len, -1), block.norm_added_q,
                 block.norm_added_k, joint.txt_freqs, q, k, v, img_len, eps=block.eps, qk_scales=qk_scales,
                 v_scale=v_scale)
        if joint.fp8_attention:
            o, o_scale = fp8_attention(joint.fp8_attention, q, k, v, *qk_scales, joint.valid_keys, v_scale,
                                       joint.qkv.dtype, None if v_bound is None else (v_bound[1:2], v_bound[2:]))
        else:
            o = joint.attention()  # [B, L_img + L_txt, H, D]
        img_o, txt_o = split_attention(o, img_len, fp8("img_out"), fp8("txt_out"), o_scale)
        img = block.img_out(img_o).view(batch, img_len, dim)
        return img, block.txt_out(txt_o).view(batch, txt_len, dim) if text_out else None


class FastBlock(nn.Module):
    """One dual-stream block, fused: per stream one QKV linear [3*H*D, D], the output linear, the MLP's two; the
    QK-norm weights [D_head]; img_mod / txt_mod as in diffusers (nn.Sequential(SiLU, Linear(D, 6D))); `attn`, the
    weightless JointAttention."""

    def __init__(self, dim: int, heads: int, head_dim: int, config: FastTransformerConfig, eps: float = 1e-6):
        super().__init__()
        self.heads, self.head_dim, self.eps, self.config = heads, head_dim, eps, config
        self.img_mod = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.txt_mod = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        inner, mlp = heads * head_dim, 4 * dim  # diffusers' FeedForward: mult=4
        shapes = {"qkv": (dim, 3 * inner), "out": (inner, dim), "fc1": (dim, mlp), "fc2": (mlp, dim)}
        for stream in ("img", "txt"):
            for name, (k, n) in shapes.items():
                setattr(self, f"{stream}_{name}", FastLinear(k, n, config.is_fp8(f"{stream}_{name}"),
                                                             config.fp8_fast_accum))
        self.norm_q, self.norm_k = nn.Parameter(torch.empty(head_dim)), nn.Parameter(torch.empty(head_dim))
        self.norm_added_q, self.norm_added_k = nn.Parameter(torch.empty(head_dim)), nn.Parameter(torch.empty(head_dim))
        self.attn = JointAttention()

    @classmethod
    def from_stock(cls, block, config: FastTransformerConfig, device, modulation_device) -> "FastBlock":
        """From a diffusers QwenImageTransformerBlock; its img_mod / txt_mod modules are shared (moved to
        modulation_device)."""
        attn = block.attn
        with torch.device("meta"):
            fast = cls(block.dim, attn.heads, attn.inner_dim // attn.heads, config, attn.norm_q.eps)
        fast.img_mod, fast.txt_mod = block.img_mod.to(modulation_device), block.txt_mod.to(modulation_device)
        for stream, (q, k, v), out, mlp in (
            ("img", (attn.to_q, attn.to_k, attn.to_v), attn.to_out[0], block.img_mlp),
            ("txt", (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj), attn.to_add_out, block.txt_mlp),
        ):
            qkv_w = torch.cat([q.weight.to(device), k.weight.to(device), v.weight.to(device)])  # [3HD, D]
            qkv_b = torch.cat([q.bias.to(device), k.bias.to(device), v.bias.to(device)])
            fc1, fc2 = mlp.net[0].proj, mlp.net[2]
            for name, weight, bias in (("qkv", qkv_w, qkv_b), ("out", out.weight, out.bias),
                                       ("fc1", fc1.weight, fc1.bias), ("fc2", fc2.weight, fc2.bias)):
                setattr(fast, f"{stream}_{name}", FastLinear.from_weight(
                    weight, bias, config.is_fp8(f"{stream}_{name}"), device, config.fp8_fast_accum))
            del qkv_w, qkv_b
        for name, norm in (("norm_q", attn.norm_q), ("norm_k", attn.norm_k), ("norm_added_q", attn.norm_added_q),
                           ("norm_added_k", attn.norm_added_k)):
            setattr(fast, name, nn.Parameter(norm.weight.detach().to(device), requires_grad=False))
        return fast

    def qk_fp8_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """FP8 attention's q and k scales [1] (qkv_pack.rms_norm_fp8_scale over both streams' norm weights, which
        share the joint buffers), computed once for these weights."""
        weights = (self.norm_q, self.norm_added_q, self.norm_k, self.norm_added_k)
        key = tuple((w.data_ptr(), w._version) for w in weights)
        if getattr(self, "_qk_fp8_key", None) != key:
            self._qk_fp8_scales = (rms_norm_fp8_scale(weights[:2], self.head_dim),
                                   rms_norm_fp8_scale(weights[2:], self.head_dim))
            self._qk_fp8_key = key
        return self._qk_fp8_scales

    def v_fp8_scales(self, img_x: Operand, txt_x: Operand) -> torch.Tensor | None:
        """FP8 attention's v scale without an amax pass, from a bound: a stream's v = x @ W_v.T + b with x its QKV
        GEMM's rowwise-FP8 operand (|x_k| <= 448 * its row's scale), so |v| <= 448 * max row scale * max_j
        ||W_v,j||_1 + max |b_v| (the FP8 weight as it computes; BOUND_MARGIN for the output's rounding), the larger
        of the two streams' bounds. Returns fp32 [3]: (v's scale, cuDNN's output scale v_scale * O_HEADROOM, its
        reciprocal), one kernel (kernels/output_bound.py). None where the bound does not hold: an operand or a
        weight not FP8, or a LoRA adding to v's rows (then quantize_fp8_heads measures v)."""
        terms = [v_bound_terms(x, linear, self.heads * self.head_dim)
                 for x, linear in ((img_x, self.img_qkv), (txt_x, self.txt_qkv))]
        if None in terms:
            return None
        return output_bound_scales([img_x[1].reshape(-1, 1), txt_x[1].reshape(-1, 1)], terms,
                                   CudnnFp8Attention.O_HEADROOM)

    def modulation(self, silu_temb: torch.Tensor, silu_temb_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(img [G, 6D], txt [B, 6D]) from the forward's silu(temb) [G, D] and its timestep-t rows [B, D]."""
        return self.img_mod[1](silu_temb), self.txt_mod[1](silu_temb_t)

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, joint: JointInputs,
                mods: tuple[torch.Tensor, torch.Tensor] | None = None, tails: tuple = (None, None),
                text_out: bool = True, defer: bool = False, attention_cache=None):
        """hidden_states [B, L_img, D], encoder_hidden_states [B, L_txt, D]: the residual streams, before the tails
        (img_tail, txt_tail) of the previous block are added when it deferred them. mods: this block's modulation
        from a table (modulation.py); None: computed here.

        defer=True: (txt, img, txt_tail, img_tail), the last residual adds left to the next block's first kernel.
        text_out=False (the last block) skips the text stream's output projection and MLP, whose result diffusers
        discards. attention_cache: a TaylorSeer step's (runtime/taylorseer.BlockCache): the attention outputs
        predicted (nothing that only attention reads is run; the tails are added by post's kernels) or computed
        and stored.
        defer=False: diffusers' block output (stock_forward)."""
        if not defer:
            return self.stock_forward(hidden_states, encoder_hidden_states, joint, mods)
        img_mods, txt_mods = mods if mods is not None else self.modulation(joint.silu_temb, joint.silu_temb_t)
        batch = hidden_states.shape[0]
        if attention_cache is not None and attention_cache.reads_no_inputs:  # attention's outputs from the cache:
            img_attn, txt_attn = attention_cache.outputs(None, batch, text_out)  # the tails go to post's kernels
            img, txt, img_tail, txt_tail = self.post(hidden_states, encoder_hidden_states, img_attn, txt_attn, joint,
                                                     img_mods, txt_mods, text_out, priors=tails)
            return txt, img, txt_tail, img_tail
        img, txt, img_x, txt_x = self.pre(hidden_states, encoder_hidden_states, joint, img_mods, txt_mods, *tails)
        (img_rows, img_scale), (txt_rows, txt_scale) = batch_first(img_x, batch), batch_first(txt_x, batch)
        attn = self.attn if attention_cache is None else past_hooks(self.attn)  # the rule runs the hooks' cache

        def attend(rows: slice) -> tuple:  # the attention outputs of the batch rows `rows`
            if rows == slice(None):
                return attn(img_rows, txt_rows, joint, self, (img_scale, txt_scale), text_out)
            scales = tuple(None if s is None else s.view(batch, -1, *s.shape[1:])[rows].flatten(0, 1)
                           for s in (img_scale, txt_scale))  # FP8 row scales [B * L, ...], batch-major
            return attn(img_rows[rows], txt_rows[rows], joint.rows(rows, batch), self, scales, text_out)

        img_attn, txt_attn = (attend(slice(None)) if attention_cache is None
                              else attention_cache.outputs(attend, batch, text_out))
        img, txt, img_tail, txt_tail = self.post(img, txt, img_attn, txt_attn, joint, img_mods, txt_mods, text_out)
        return txt, img, txt_tail, img_tail

    def pre(self, img, txt, joint: JointInputs, img_mods, txt_mods, img_tail: Tail | None = None,
            txt_tail: Tail | None = None) -> tuple[torch.Tensor, torch.Tensor, Operand, Operand]:
        """Up to attention: (img, txt with the previous block's tails added, the QKV GEMMs' operands)."""
        fp8 = self.config.is_fp8
        im, tm = StreamMods(img_mods), StreamMods(txt_mods)  # [G, 6D], [B, 6D]
        img, img_x = head(img, img_tail, im.shift1, im.scale1, joint.mod_row, fp8("img_qkv"))
        txt, txt_x = head(txt, txt_tail, tm.shift1, tm.scale1, None, fp8("txt_qkv"))
        return img, txt, img_x, txt_x

    def post(self, img, txt, img_attn, txt_attn, joint: JointInputs, img_mods, txt_mods, text_out: bool = True,
             priors: tuple = (None, None)):
        """From the attention outputs [B, L, D] (or TaylorSeer predictions with a term pending): (img, txt, img_tail,
        txt_tail), the MLPs' gated residual adds left to the caller (txt_tail None when not text_out). priors: the
        previous block's tails when pre() has not added them (the attention came from a cache)."""
        batch, img_len, dim = img.shape
        fp8 = self.config.is_fp8
        im, tm = StreamMods(img_mods), StreamMods(txt_mods)
        img, img_x = gate_norm_mod(img, img_attn, im.gate1, im.shift2, im.scale2, joint.mod_row, fp8("img_fc1"),
                                   priors[0])
        img_tail = Tail(self.img_fc2(gelu(self.img_fc1(img_x), fp8("img_fc2"))).view(batch, img_len, dim), im.gate2)
        txt_tail = None
        if not text_out:
            txt = add_tail(txt, priors[1], None)
        else:
            txt, txt_x = gate_norm_mod(txt, txt_attn, tm.gate1, tm.shift2, tm.scale2, None, fp8("txt_fc1"), priors[1])
            txt_tail = Tail(self.txt_fc2(gelu(self.txt_fc1(txt_x), fp8("txt_fc2"))).view(batch, txt.shape[1], dim),
                            tm.gate2)
        return img, txt, img_tail, txt_tail

    def stock_forward(self, hidden_states, encoder_hidden_states, joint: JointInputs, mods=None):
        """diffusers' block output, (encoder_hidden_states, hidden_states) with every residual added: how the block
        runs under diffusers' step caches (registered below: their block-level hooks read this output). With block
        graphs on (core/runtime/block_graphs.py) the block replays from its graph, or, when a hook sits on its
        attention module, the pieces before and after it do; a hook on anything else inside keeps it eager."""
        count_blocks(hidden_states.shape[0])  # the hooks let it run: the runner cannot count it
        graphs = get_context().block_graphs
        inside = hooked_inside(self)
        streams = dict(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states)
        mods = {} if mods is None else dict(img_mods=mods[0], txt_mods=mods[1])
        if graphs is None or inside - {"attn"}:
            return self._stock_forward(joint, **streams, **mods)
        if not inside:
            return graphs.graphed_block(self, "block", streams | mods, functools.partial(self._stock_forward, joint),
                                        joint.graph_key)
        img_mods, txt_mods, img_rows, img_scale, txt_rows, txt_scale = graphs.graphed_block(
            self, "pre", streams | mods, functools.partial(self.stock_pre, joint), joint.graph_key)
        img_attn, txt_attn = self.attn(img_rows, txt_rows, joint, self, (img_scale, txt_scale))
        return graphs.graphed_block(
            self, "post", streams | dict(img_attn=img_attn, txt_attn=txt_attn, img_mods=img_mods, txt_mods=txt_mods),
            functools.partial(self.stock_post, joint), joint.graph_key)

    def stock_pre(self, joint: JointInputs, hidden_states, encoder_hidden_states, img_mods=None, txt_mods=None):
        """diffusers' block up to its attention module: (img_mods, txt_mods, then the image and text rows the QKV
        GEMMs take, batch-first, each with its FP8 row scales or None). Modulation from a table, or computed here."""
        if img_mods is None:
            img_mods, txt_mods = self.modulation(joint.silu_temb, joint.silu_temb_t)
        _, _, img_x, txt_x = self.pre(hidden_states, encoder_hidden_states, joint, img_mods, txt_mods)
        batch = hidden_states.shape[0]
        return img_mods, txt_mods, *batch_first(img_x, batch), *batch_first(txt_x, batch)

    def stock_post(self, joint: JointInputs, hidden_states, encoder_hidden_states, img_attn, txt_attn, img_mods,
                   txt_mods):
        """diffusers' block after its attention module: (encoder_hidden_states, hidden_states), residuals added."""
        img, txt, img_tail, txt_tail = self.post(hidden_states, encoder_hidden_states, img_attn, txt_attn, joint,
                                                 img_mods, txt_mods)
        return clip_float16(add_tail(txt, txt_tail, None)), clip_float16(add_tail(img, img_tail, joint.mod_row))

    def _stock_forward(self, joint: JointInputs, hidden_states, encoder_hidden_states, img_mods=None, txt_mods=None):
        img_mods, txt_mods, img_rows, img_scale, txt_rows, txt_scale = self.stock_pre(
            joint, hidden_states, encoder_hidden_states, img_mods, txt_mods)
        img_attn, txt_attn = self.attn(img_rows, txt_rows, joint, self, (img_scale, txt_scale))
        return self.stock_post(joint, hidden_states, encoder_hidden_states, img_attn, txt_attn, img_mods, txt_mods)


def hooked_inside(block: nn.Module) -> set[str]:
    """The names of the modules inside `block` (not itself) that carry diffusers hooks."""
    return {name for name, module in block.named_modules() if name and getattr(
        getattr(module, "_diffusers_hook", None), "hooks", None)}


# diffusers' block-level step caches (FirstBlockCache, MagCache, SeaCache, TaylorSeer's lite mode) find the streams
# in a block's output by this metadata, as for the stock QwenImageTransformerBlock.
TransformerBlockRegistry.register(FastBlock, TransformerBlockMetadata(return_hidden_states_index=1,
                                                                     return_encoder_hidden_states_index=0))
