"""The fast Qwen-Image transformer: diffusers' `QwenImageTransformer2DModel` (0.42) rebuilt on fused kernels.

Built once from a stock model (`FastQwenImageTransformer.from_diffusers`), which stays usable beside it.
Same `forward` arguments and output as diffusers. Per block and stream (image tokens L_img, text tokens L_txt):

    norm1+mod1 (+fp8) -> fused QKV GEMM -> qkv_pack (QK-norm, RoPE, into joint [B, L_img + L_txt, H, D] buffers)
    -> attention (padded text keys masked) -> attn_split (+fp8) -> output GEMM
    -> residual + gate1, norm2+mod2 (+fp8) in one kernel -> fc1 GEMM -> gelu (+fp8) -> fc2 GEMM
    -> residual + gate2, next block's norm1+mod1 (+fp8) in one kernel (norm_out's after the last block)

All 60 blocks' modulation vectors are computed before the first block. Linears listed in FP8_LINEARS run as
rowwise FP8 `torch._scaled_mm` (per-token activation x per-channel weight scales, bias in the epilogue) unless
the config keeps them in BF16; the embedders, img_mod/txt_mod, norm_out and proj_out always stay in the model's
dtype. Nothing in forward synchronizes with the host, so it can be captured in a CUDA graph.
"""

from dataclasses import dataclass
from math import prod

import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers.models.modeling_outputs import Transformer2DModelOutput

from ...kernels._utils import FP8_DTYPE
from ...kernels.attn_split_fp8 import attn_split_fp8
from ...kernels.fp8 import fp8_linear, quantize_fp8_rowwise, quantize_fp8_rowwise_ref
from ...kernels.gelu_fp8 import gelu_fp8
from ...kernels.layer_norm_modulate import layer_norm_modulate, layer_norm_modulate_fp8
from ...kernels.qkv_pack import qkv_pack
from ...kernels.residual_gate import (
    residual_gate,
    residual_gate_layer_norm_modulate,
    residual_gate_layer_norm_modulate_fp8,
)
from .attention import BACKENDS, TextMask, joint_attention, resolve_backend

# The block linears that may run in FP8; (stream)_(layer).
FP8_LINEARS = ("img_qkv", "img_out", "img_fc1", "img_fc2", "txt_qkv", "txt_out", "txt_fc1", "txt_fc2")


@dataclass(frozen=True)
class FastTransformerConfig:
    """fp8: run FP8_LINEARS in rowwise FP8 (False: BF16 mode, every GEMM in the model's dtype).
    bf16_linears: those of FP8_LINEARS kept in the model's dtype anyway (e.g. ("img_fc2",), which other engines
    found sensitive). fp8_fast_accum: cuBLAS's faster FP8 accumulation on Hopper (torchao's default).
    attention: "auto" | "fa4" | "cudnn" | "sdpa"."""

    fp8: bool = True
    bf16_linears: tuple[str, ...] = ()
    fp8_fast_accum: bool = False
    attention: str = "auto"

    def __post_init__(self):
        unknown = [name for name in self.bf16_linears if name not in FP8_LINEARS]
        if unknown:
            raise ValueError(f"bf16_linears={unknown}; allowed: {', '.join(FP8_LINEARS)}")
        if self.attention not in BACKENDS:
            raise ValueError(f"attention={self.attention!r}; allowed: {', '.join(BACKENDS)}")

    def is_fp8(self, name: str) -> bool:
        return self.fp8 and name not in self.bf16_linears


# An activation operand: rows [M, K] in the model's dtype, or rowwise FP8 (q [M, K], scale [M, 1]).
Operand = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


class FastLinear(nn.Module):
    """y = x @ W.T + b from a stock nn.Linear weight [N, K]: kept as is (BF16 mode; shares the stock tensor when
    already on `device`) or quantized once to e4m3 with a per-output-channel fp32 scale."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, fp8: bool, device, fast_accum: bool = False):
        super().__init__()
        self.fp8, self.fast_accum = fp8, fast_accum
        self.out_dtype = weight.dtype
        weight = weight.detach().to(device)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(device), requires_grad=False)
        if fp8:
            w_q, w_s = quantize_fp8_rowwise_ref(weight)  # exact e4m3 rounding on any device
            self.register_buffer("weight_q", w_q)  # [N, K] e4m3
            self.register_buffer("weight_scale", w_s.view(-1))  # [N] fp32
        else:
            self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, x: Operand) -> torch.Tensor:
        """x: [M, K] (BF16 mode) or (q [M, K], scale [M, 1]) (FP8). Returns [M, N] in the bias/weight dtype."""
        if self.fp8:
            q, s = x
            return fp8_linear(q, s, self.weight_q, self.weight_scale, self.bias, self.out_dtype, self.fast_accum)
        return F.linear(x, self.weight, self.bias)


def as_fp8_operand(q: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernels write e4m3 on CUDA; on the CPU they write the pre-cast fp32 values (the Triton interpreter
    mis-rounds fp32 -> fp8) and PyTorch does the exact cast here."""
    return (q if q.dtype == FP8_DTYPE else q.to(FP8_DTYPE)), s


def q_dtype_for(device: torch.device) -> torch.dtype:
    return FP8_DTYPE if device.type == "cuda" else torch.float32


class FastBlock(nn.Module):
    """One dual-stream block's weights, fused: per stream QKV [3*H*D, D] as one GEMM."""

    def __init__(self, block, config: FastTransformerConfig, device):
        super().__init__()
        attn = block.attn
        self.heads, self.head_dim = attn.heads, attn.inner_dim // attn.heads
        self.img_mod = block.img_mod[1].to(device)  # nn.Linear(D, 6D), stays in the model's dtype
        self.txt_mod = block.txt_mod[1].to(device)
        for stream, (q, k, v), out, mlp in (
            ("img", (attn.to_q, attn.to_k, attn.to_v), attn.to_out[0], block.img_mlp),
            ("txt", (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj), attn.to_add_out, block.txt_mlp),
        ):
            qkv_w = torch.cat([q.weight.to(device), k.weight.to(device), v.weight.to(device)])  # [3HD, D]
            qkv_b = torch.cat([q.bias.to(device), k.bias.to(device), v.bias.to(device)])
            fc1, fc2 = mlp.net[0].proj, mlp.net[2]
            for name, weight, bias in (("qkv", qkv_w, qkv_b), ("out", out.weight, out.bias),
                                       ("fc1", fc1.weight, fc1.bias), ("fc2", fc2.weight, fc2.bias)):
                fp8 = config.is_fp8(f"{stream}_{name}")
                setattr(self, f"{stream}_{name}", FastLinear(weight, bias, fp8, device, config.fp8_fast_accum))
            del qkv_w, qkv_b
        # diffusers RMSNorm weights for QK-norm, [D] each
        self.norm_q = attn.norm_q.weight.detach().to(device)
        self.norm_k = attn.norm_k.weight.detach().to(device)
        self.norm_added_q = attn.norm_added_q.weight.detach().to(device)
        self.norm_added_k = attn.norm_added_k.weight.detach().to(device)
        self.eps = attn.norm_q.eps


class StreamMods:
    """One stream's modulation for one block, as [G, D] views of the [G, 6D] mod output (G = B, or 2B with
    zero_cond_t) in diffusers' chunk order: shift1, scale1, gate1, shift2, scale2, gate2."""

    def __init__(self, mods: torch.Tensor):
        self.shift1, self.scale1, self.gate1, self.shift2, self.scale2, self.gate2 = mods.chunk(6, dim=-1)


class FastQwenImageTransformer(nn.Module):
    """Drop-in for diffusers' QwenImageTransformer2DModel (same config, forward arguments and output)."""

    def __init__(self, stock, config: FastTransformerConfig, device):
        super().__init__()
        device = torch.device(device)
        self.fast_config = config
        self.config = stock.config
        self.zero_cond_t = stock.zero_cond_t
        self.attention_backend = resolve_backend(config.attention, device, stock.dtype)
        self.pos_embed = stock.pos_embed  # no parameters; caches its rotary tables per device
        self.time_text_embed = stock.time_text_embed.to(device)
        self.txt_norm = stock.txt_norm.to(device)
        self.img_in = stock.img_in.to(device)
        self.txt_in = stock.txt_in.to(device)
        self.norm_out_linear = stock.norm_out.linear.to(device)  # AdaLayerNormContinuous: LN eps 1e-6, no affine
        self.proj_out = stock.proj_out.to(device)
        # Block by block, so at most one block's BF16 linears sit on the device beside the converted ones.
        self.blocks = nn.ModuleList()
        for block in stock.transformer_blocks:
            self.blocks.append(FastBlock(block, config, device))
        self._mod_rows: dict = {}

    @classmethod
    @torch.no_grad()
    def from_diffusers(cls, stock, config: FastTransformerConfig | None = None, device=None):
        """stock: a diffusers QwenImageTransformer2DModel (any device; left unchanged except that the modules
        shared with this model (embedders, img_mod/txt_mod, norm_out, proj_out) move to `device`)."""
        device = torch.device(device) if device is not None else stock.device
        return cls(stock, config or FastTransformerConfig(), device)

    @property
    def dtype(self) -> torch.dtype:
        return self.img_in.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.img_in.weight.device

    def _fp8(self, name: str) -> bool:
        return self.fast_config.is_fp8(name)

    def _mod_row(self, img_shapes, batch: int, device) -> torch.Tensor:
        """zero_cond_t: the modulation row of each image token, b (its sample, timestep t) for the first image's
        tokens and b + B (timestep 0) for condition images. int32 [B * L_img], cached per shape."""
        key = (str(img_shapes), batch, str(device))
        if key not in self._mod_rows:
            index = torch.tensor(
                [[0] * prod(sample[0]) + [1] * sum(prod(s) for s in sample[1:]) for sample in img_shapes],
                dtype=torch.int32,
            )
            rows = torch.arange(batch, dtype=torch.int32)[:, None] + batch * index
            self._mod_rows[key] = rows.flatten().to(device)
        return self._mod_rows[key]

    @torch.no_grad()
    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor = None,
        encoder_hidden_states_mask: torch.Tensor = None,
        timestep: torch.LongTensor = None,
        img_shapes=None,
        guidance: torch.Tensor = None,
        attention_kwargs=None,
        controlnet_block_samples=None,
        additional_t_cond=None,
        return_dict: bool = True,
    ):
        if attention_kwargs:
            raise NotImplementedError(f"attention_kwargs={attention_kwargs!r}: LoRA scaling is not supported by "
                                      "the fast transformer; use the stock model")
        hidden_states = self.img_in(hidden_states)  # [B, L_img, D]
        timestep = timestep.to(hidden_states.dtype)
        batch, img_len, dim = hidden_states.shape
        mod_row = None
        if self.zero_cond_t:
            timestep = torch.cat([timestep, timestep * 0], dim=0)
            mod_row = self._mod_row(img_shapes, batch, hidden_states.device)
        encoder_hidden_states = self.txt_in(self.txt_norm(encoder_hidden_states))  # [B, L_txt, D]
        txt_len = encoder_hidden_states.shape[1]
        mask = None if encoder_hidden_states_mask is None else TextMask(encoder_hidden_states_mask, img_len)

        if guidance is not None:
            guidance = guidance.to(hidden_states.dtype) * 1000
        temb = (
            self.time_text_embed(timestep, hidden_states, additional_t_cond)
            if guidance is None
            else self.time_text_embed(timestep, guidance, hidden_states, additional_t_cond)
        )  # [G, D]
        img_freqs, txt_freqs = self.pos_embed(img_shapes, max_txt_seq_len=txt_len, device=hidden_states.device)
        img_freqs, txt_freqs = torch.view_as_real(img_freqs), torch.view_as_real(txt_freqs)  # [L, D/2, 2] fp32

        # Every block's modulation up front: [G, 6D] per block and stream. Text, norm_out: timestep t rows only.
        silu_temb = F.silu(temb)
        silu_temb_t = silu_temb.chunk(2, dim=0)[0] if self.zero_cond_t else silu_temb
        img_mods = [StreamMods(blk.img_mod(silu_temb)) for blk in self.blocks]
        txt_mods = [StreamMods(blk.txt_mod(silu_temb_t)) for blk in self.blocks]
        out_scale, out_shift = self.norm_out_linear(silu_temb_t).chunk(2, dim=1)  # [B, D] each

        img_x = self._norm_mod(hidden_states, img_mods[0].shift1, img_mods[0].scale1, mod_row, "img_qkv")
        txt_x = self._norm_mod(encoder_hidden_states, txt_mods[0].shift1, txt_mods[0].scale1, None, "txt_qkv")
        heads, head_dim = self.blocks[0].heads, self.blocks[0].head_dim
        seq = img_len + txt_len
        n_blocks = len(self.blocks)
        # Joint [image, text] Q/K/V, refilled by every block; image at offset 0 (attention.py says why).
        q, k, v = (hidden_states.new_empty(batch, seq, heads, head_dim) for _ in range(3))
        for i, blk in enumerate(self.blocks):
            im, tm = img_mods[i], txt_mods[i]
            last = i == n_blocks - 1
            qkv = blk.img_qkv(img_x).view(batch, img_len, -1)
            qkv_pack(qkv, blk.norm_q, blk.norm_k, img_freqs, q, k, v, 0, eps=blk.eps)
            qkv = blk.txt_qkv(txt_x).view(batch, txt_len, -1)
            qkv_pack(qkv, blk.norm_added_q, blk.norm_added_k, txt_freqs, q, k, v, img_len, eps=blk.eps)
            o = joint_attention(q, k, v, mask, self.attention_backend)  # [B, S, H, D]
            img_o, txt_o = self._split(o, img_len, blk)

            img_attn = blk.img_out(img_o).view(batch, img_len, dim)
            hidden_states, img_x = self._gate_norm_mod(
                hidden_states, img_attn, im.gate1, im.shift2, im.scale2, mod_row, "img_fc1")
            img_mlp = blk.img_fc2(self._gelu(blk.img_fc1(img_x), "img_fc2")).view(batch, img_len, dim)
            if controlnet_block_samples is not None:
                hidden_states = residual_gate(hidden_states, img_mlp, im.gate2, mod_row=mod_row)
                interval = -(-n_blocks // len(controlnet_block_samples))
                hidden_states = hidden_states + controlnet_block_samples[i // interval]
                if not last:
                    img_x = self._norm_mod(hidden_states, img_mods[i + 1].shift1, img_mods[i + 1].scale1,
                                           mod_row, "img_qkv")
            elif not last:
                nxt = img_mods[i + 1]
                hidden_states, img_x = self._gate_norm_mod(
                    hidden_states, img_mlp, im.gate2, nxt.shift1, nxt.scale1, mod_row, "img_qkv")
            elif mod_row is None:  # fused with norm_out's LayerNorm + modulation
                hidden_states, img_x = residual_gate_layer_norm_modulate(
                    hidden_states, img_mlp, im.gate2, out_shift, out_scale)
            else:  # norm_out modulates per sample, the gate per token
                hidden_states = residual_gate(hidden_states, img_mlp, im.gate2, mod_row=mod_row)
                img_x = layer_norm_modulate(hidden_states, out_shift, out_scale)

            if last:
                break  # the text stream's last MLP feeds nothing: diffusers discards it
            txt_attn = blk.txt_out(txt_o).view(batch, txt_len, dim)
            encoder_hidden_states, txt_x = self._gate_norm_mod(
                encoder_hidden_states, txt_attn, tm.gate1, tm.shift2, tm.scale2, None, "txt_fc1")
            txt_mlp = blk.txt_fc2(self._gelu(blk.txt_fc1(txt_x), "txt_fc2")).view(batch, txt_len, dim)
            nxt = txt_mods[i + 1]
            encoder_hidden_states, txt_x = self._gate_norm_mod(
                encoder_hidden_states, txt_mlp, tm.gate2, nxt.shift1, nxt.scale1, None, "txt_qkv")

        output = self.proj_out(img_x)  # img_x: norm_out(hidden_states), [B, L_img, D]
        if not return_dict:
            return (output,)
        return Transformer2DModelOutput(sample=output)

    # Producers of the next GEMM's operand: FP8 (q, scale) rows when that linear runs in FP8, else plain rows.

    def _norm_mod(self, x, shift, scale, mod_row, consumer: str) -> Operand:
        if self._fp8(consumer):
            return as_fp8_operand(*layer_norm_modulate_fp8(x, shift, scale, mod_row=mod_row,
                                                           q_dtype=q_dtype_for(x.device)))
        return layer_norm_modulate(x, shift, scale, mod_row=mod_row).view(-1, x.shape[-1])

    def _gate_norm_mod(self, residual, x, gate, shift, scale, mod_row, consumer: str):
        if self._fp8(consumer):
            residual, q, s = residual_gate_layer_norm_modulate_fp8(
                residual, x, gate, shift, scale, mod_row=mod_row, q_dtype=q_dtype_for(x.device))
            return residual, as_fp8_operand(q, s)
        residual, y = residual_gate_layer_norm_modulate(residual, x, gate, shift, scale, mod_row=mod_row)
        return residual, y.view(-1, y.shape[-1])

    def _gelu(self, h: torch.Tensor, consumer: str) -> Operand:
        if self._fp8(consumer):
            return as_fp8_operand(*gelu_fp8(h, q_dtype=q_dtype_for(h.device)))
        return F.gelu(h, approximate="tanh")

    def _split(self, o: torch.Tensor, img_len: int, blk) -> tuple[Operand, Operand]:
        """Joint output [B, S, H, D] -> the image and text operands of the two output projections."""
        batch, seq = o.shape[:2]
        o = o.view(batch, seq, -1)
        img_fp8, txt_fp8 = self._fp8("img_out"), self._fp8("txt_out")
        if img_fp8 and txt_fp8:
            qi, si, qt, st = attn_split_fp8(o, img_len, q_dtype=q_dtype_for(o.device))
            return as_fp8_operand(qi, si), as_fp8_operand(qt, st)
        parts = (o[:, :img_len].reshape(-1, o.shape[-1]), o[:, img_len:].reshape(-1, o.shape[-1]))
        return tuple(as_fp8_operand(*quantize_fp8_rowwise(p, q_dtype_for(o.device))) if fp8 else p
                     for p, fp8 in zip(parts, (img_fp8, txt_fp8)))
