"""The fast Qwen-Image transformer: diffusers' `QwenImageTransformer2DModel` (0.42) rebuilt on fused kernels.

Built from a stock model (`FastQwenImageTransformer.from_diffusers`, which leaves it usable beside it) or loaded from
a folder its `save_pretrained` wrote (FP8 weights and scales as stored, nothing requantized). Same `forward`
arguments and output as diffusers. Per block and stream (image tokens L_img, text tokens L_txt):

    [previous block's residual + gate2 * mlp] + norm1 + mod1 (+fp8) in one kernel -> fused QKV GEMM
    -> qkv_pack (QK-norm, RoPE, into joint [B, L_img + L_txt, H, D] buffers) -> attention (padded text keys masked)
    -> attn_split (+fp8) -> output GEMM -> residual + gate1, norm2 + mod2 (+fp8) in one kernel -> fc1 GEMM
    -> gelu (+fp8) -> fc2 GEMM, whose gated residual add the next block's first kernel does (norm_out's after the
       last block)

Each block computes its own modulation vectors and reads only its own weights inside its forward, so offload hooks
(model CPU offload, group offload at block or leaf level) see every weight before it is used. Linears listed in
FP8_LINEARS run as rowwise FP8 `torch._scaled_mm` (per-token activation x per-channel weight scales, bias in the
epilogue) unless the config keeps them in BF16; the embedders, img_mod/txt_mod, norm_out and proj_out always stay in
the model's dtype and keep diffusers' module names (their state-dict keys equal the stock model's). Nothing in
forward synchronizes with the host, so it can be captured in a CUDA graph.
"""

import contextlib
import functools
import inspect
import json
from dataclasses import dataclass
from math import prod
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
import triton
from diffusers import ConfigMixin, ModelMixin, QwenImageTransformer2DModel
from diffusers.hooks.group_offloading import _maybe_remove_and_reapply_group_offloading
from diffusers.loaders.lora_base import _func_optionally_disable_offloading
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.utils import logging
from diffusers.models.normalization import AdaLayerNormContinuous, RMSNorm
from diffusers.models.transformers.transformer_qwenimage import (
    QwenEmbedLayer3DRope,
    QwenEmbedRope,
    QwenTimestepProjEmbeddings,
)

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
from .attention import TextMask, joint_attention, resolve_backend
from .cfg_pairing import CfgPairing, pad_text
from .config import FP8_LINEARS, FastTransformerConfig
from .cuda_graph import CallGraphs
from .lora import BLOCK_SITES, LoraLinear, LoraState, LoraTargetLinear, site_of
from .modulation import ModulationLayout, ModulationTables, tensor_key
from .offload import on_device, tensors_of
from .parallel import Ulysses, UlyssesPlan

logger = logging.get_logger(__name__)
BASELINE_ADVICE = "keep the stock transformer (FastConfig.preset('baseline')) for it"

__all__ = ["FP8_LINEARS", "FastLinear", "FastQwenImageTransformer", "FastTransformerConfig"]

# The stock model's constructor arguments and defaults: its config, which ours keeps (plus "fast_config").
STOCK_CONFIG = {name: p.default for name, p in inspect.signature(QwenImageTransformer2DModel.__init__).parameters.items()
                if name != "self"}
LORA_ADVICE = ("load the LoRA with pipe.load_lora_weights(...) (or transformer.load_lora_adapter(...)) on the fast "
               "pipeline, before or after optimize()")


@triton.jit
def _interpreter_probe(X):
    pass


def triton_runs_on(device: torch.device) -> bool:
    """Our Triton kernels run on CUDA, and on the CPU only when Triton's interpreter was on when they were defined
    (TRITON_INTERPRET=1 before triton was first imported), as this module's probe kernel was."""
    from triton.runtime.interpreter import InterpretedFunction

    return device.type == "cuda" or isinstance(_interpreter_probe, InterpretedFunction)


def check_triton_runs_on(device: torch.device):
    """Before converting onto `device` (a CPU build may be meant for offload to a GPU, so only without one) and in
    every forward (the inputs' device): a clear error instead of Triton's "0 active drivers"."""
    if not triton_runs_on(device):
        raise RuntimeError(
            f"the fast transformer's Triton kernels cannot run on {device}: on a CPU they need Triton's interpreter, "
            "turned on by TRITON_INTERPRET=1 before Python starts (before triton or diffusers is imported); or run "
            "on a CUDA GPU, or keep the stock transformer (FastConfig.preset('baseline'))")


def has_offload_hooks(model: nn.Module) -> bool:
    """accelerate's (model / sequential CPU offload) or diffusers' (group offload) hooks: they move weights between
    forwards (a captured graph would read stale addresses), and group offload with streams keeps its own host copies."""
    for module in model.modules():
        registry = getattr(module, "_diffusers_hook", None)
        if hasattr(module, "_hf_hook") or (registry is not None and registry.hooks):
            return True
    return False


def peft_lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """name -> module of every peft LoRA layer (duck-typed on peft's BaseTunerLayer attributes, so peft need not be
    installed to find out there is none)."""
    return {name: m for name, m in model.named_modules()
            if hasattr(m, "lora_A") and hasattr(m, "merged_adapters") and hasattr(m, "get_base_layer")}


# An activation operand: rows [M, K] in the model's dtype, or rowwise FP8 (q [M, K], scale [M, 1]).
Operand = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
FP8_TENSORS = ("weight_q", "weight_scale")


class FastLinear(nn.Module):
    """y = x @ W.T + b. BF16 mode: `weight` [N, K] in the model's dtype. FP8: `weight_q` [N, K] e4m3 and
    `weight_scale` [N] fp32 (per output channel), as buffers. `bias` [N] sets the output dtype."""

    def __init__(self, in_features: int, out_features: int, fp8: bool, fast_accum: bool = False, dtype=None,
                 device=None):
        super().__init__()
        self.in_features, self.out_features, self.fp8, self.fast_accum = in_features, out_features, fp8, fast_accum
        if fp8:
            self.register_buffer("weight_q", torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device))
            self.register_buffer("weight_scale", torch.empty(out_features, dtype=torch.float32, device=device))
        else:
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device),
                                       requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
        self.lora: LoraLinear | None = None  # LoRA adapters (lora.py), added by load_lora_adapter

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor, fp8: bool, device, fast_accum: bool = False):
        """From a stock nn.Linear's weight [N, K] and bias [N]: kept as is (BF16 mode; shares the stock tensor when
        it is already on `device`) or quantized once to e4m3 with a per-output-channel fp32 scale."""
        with torch.device("meta"):
            linear = cls(weight.shape[1], weight.shape[0], fp8, fast_accum, dtype=weight.dtype)
        weight = weight.detach().to(device)
        linear.bias = nn.Parameter(bias.detach().to(device), requires_grad=False)
        if fp8:
            linear.weight_q, w_s = quantize_fp8_rowwise_ref(weight)  # exact e4m3 rounding on any device
            linear.weight_scale = w_s.view(-1)
        else:
            linear.weight = nn.Parameter(weight, requires_grad=False)
        return linear

    def _apply(self, fn, recurse=True):
        """.to(dtype) / .half() / .float() cast the bias (so the output dtype) but never the e4m3 weight or its fp32
        scale, which only move: a cast would turn the FP8 model into an unquantized one without saying so."""
        if not self.fp8:
            return super()._apply(fn, recurse)
        before = {name: self._buffers[name] for name in FP8_TENSORS}
        super()._apply(fn, recurse)
        for name, tensor in before.items():
            if self._buffers[name].dtype != tensor.dtype:
                self._buffers[name] = tensor.to(self._buffers[name].device)
        return self

    def forward(self, x: Operand) -> torch.Tensor:
        """x: [M, K] (BF16 mode) or (q [M, K], scale [M, 1]) (FP8). Returns [M, N] in the bias's dtype."""
        if self.fp8:
            q, s = x
            y = fp8_linear(q, s, self.weight_q, self.weight_scale, self.bias, self.bias.dtype, self.fast_accum)
            return y if self.lora is None else self.lora(q, y, row_scale=s)  # the same operand, no dequantized copy
        y = F.linear(x, self.weight, self.bias)
        return y if self.lora is None else self.lora(x, y)

    def fold_lora(self, master=None):
        """FP8: the adapters fuse_lora froze here, into the weight, so that a fused adapter costs nothing per
        forward: requantized rowwise from master() plus their product, where master() gives the BF16 weight this FP8
        one was quantized from (None: not available), else from the dequantized weight (a second e4m3 rounding of
        each weight; the error is measured in RESULTS.md). The weight before is copied to the host, for unfold_lora
        to restore bit-exactly (from the GPU: into pinned memory, asynchronously; PyTorch's pinned-memory cache makes
        a later fold reuse it). Does nothing for a BF16 linear (it keeps the exact frozen low-rank terms)."""
        if not self.fp8 or self.lora is None:
            return
        self.unfold_lora()  # a second fuse_lora: fold everything frozen now, from the weight before the first
        delta = self.lora.frozen_delta(self.out_features)
        if delta is None:
            return
        base = master() if master is not None else None
        base = self.weight_q.float() * self.weight_scale[:, None] if base is None else base.float()
        self._unfolded = (host_copy(self.weight_q), host_copy(self.weight_scale))
        w = base + delta.to(self.weight_q.device)
        q, s = quantize_fp8_rowwise_ref(w)
        self.weight_q.copy_(q)
        self.weight_scale.copy_(s.view(-1))
        self.lora.folded = True

    def unfold_lora(self):
        """Undo fold_lora: the weight and scale as they were, bit for bit."""
        if self.lora is None or not self.lora.folded:
            return
        q, s = self._unfolded
        self.weight_q.copy_(q, non_blocking=True)
        self.weight_scale.copy_(s, non_blocking=True)
        del self._unfolded
        self.lora.folded = False

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8={self.fp8}"


class CheckpointWeights:
    """The stock transformer's weights as its diffusers folder stores them, read one tensor at a time in `dtype`:
    the BF16 masters of the FP8 weights, for fold_lora. Each is used only if it quantizes to the FP8 weight exactly
    (FastQwenImageTransformer._master), so a model changed since it was loaded falls back, saying so."""

    def __init__(self, folder: Path, dtype: torch.dtype):
        self.folder, self.dtype = folder, dtype
        self._files = None

    @classmethod
    def of(cls, stock) -> "CheckpointWeights | None":
        """Where diffusers loaded `stock` from (config._name_or_path: the transformer folder), if it is one."""
        folder = Path(str(stock.config.get("_name_or_path") or ""))
        has = any((folder / f).is_file() for f in ("diffusion_pytorch_model.safetensors",
                                                    "diffusion_pytorch_model.safetensors.index.json"))
        return cls(folder, stock.dtype) if str(folder) and has else None

    def get(self, name: str, device) -> torch.Tensor:
        from safetensors import safe_open

        if self._files is None:
            index = self.folder / "diffusion_pytorch_model.safetensors.index.json"
            if index.exists():
                self._files = json.loads(index.read_text())["weight_map"]
            else:
                with safe_open(self.folder / "diffusion_pytorch_model.safetensors", framework="pt") as f:
                    self._files = dict.fromkeys(f.keys(), "diffusion_pytorch_model.safetensors")
        with safe_open(self.folder / self._files[name], framework="pt", device=str(device)) as f:
            return f.get_tensor(name).to(self.dtype)


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of t in host memory: pinned and stream-ordered from a GPU (only copied back on the same stream)."""
    if t.device.type != "cuda":
        return t.to("cpu", copy=True)
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


def as_fp8_operand(q: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernels write e4m3 on CUDA; on the CPU they write the pre-cast fp32 values (the Triton interpreter
    mis-rounds fp32 -> fp8) and PyTorch does the exact cast here."""
    return (q if q.dtype == FP8_DTYPE else q.to(FP8_DTYPE)), s


def q_dtype_for(device: torch.device) -> torch.dtype:
    return FP8_DTYPE if device.type == "cuda" else torch.float32


# Producers of the next GEMM's operand: FP8 (q, scale) rows when that linear runs in FP8, else plain rows [M, D].

def norm_mod(x, shift, scale, mod_row, fp8: bool) -> Operand:
    if fp8:
        return as_fp8_operand(*layer_norm_modulate_fp8(x, shift, scale, mod_row=mod_row, q_dtype=q_dtype_for(x.device)))
    return layer_norm_modulate(x, shift, scale, mod_row=mod_row).view(-1, x.shape[-1])


def gate_norm_mod(residual, x, gate, shift, scale, mod_row, fp8: bool) -> tuple[torch.Tensor, Operand]:
    if fp8:
        residual, q, s = residual_gate_layer_norm_modulate_fp8(
            residual, x, gate, shift, scale, mod_row=mod_row, q_dtype=q_dtype_for(x.device))
        return residual, as_fp8_operand(q, s)
    residual, y = residual_gate_layer_norm_modulate(residual, x, gate, shift, scale, mod_row=mod_row)
    return residual, y.view(-1, y.shape[-1])


def gelu(h: torch.Tensor, fp8: bool) -> Operand:
    if fp8:
        return as_fp8_operand(*gelu_fp8(h, q_dtype=q_dtype_for(h.device)))
    return F.gelu(h, approximate="tanh")


def split_attention(o: torch.Tensor, img_len: int, img_fp8: bool, txt_fp8: bool) -> tuple[Operand, Operand]:
    """Joint output [B, S, H, D] -> the image and text operands of the two output projections."""
    batch, seq = o.shape[:2]
    o = o.view(batch, seq, -1)
    if img_fp8 and txt_fp8:
        qi, si, qt, st = attn_split_fp8(o, img_len, q_dtype=q_dtype_for(o.device))
        return as_fp8_operand(qi, si), as_fp8_operand(qt, st)
    parts = (o[:, :img_len].reshape(-1, o.shape[-1]), o[:, img_len:].reshape(-1, o.shape[-1]))
    return tuple(as_fp8_operand(*quantize_fp8_rowwise(p, q_dtype_for(o.device))) if fp8 else p
                 for p, fp8 in zip(parts, (img_fp8, txt_fp8)))


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
    the joint Q/K/V buffer [3, B, L_img + L_txt, H, D] each block refills (image first, attention.py says why),
    and under Ulysses the group and where this rank's rows are (parallel.py); then rotary tables, mod_row and the
    buffer cover this rank's rows only, the mask the whole sequence."""

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

    def attention(self) -> torch.Tensor:
        """Attention over the joint sequence of the rows in `qkv`: [B, rows, H, D]."""
        if self.ulysses is None:
            return joint_attention(*self.qkv.unbind(0), self.mask, self.backend)
        q, k, v = self.ulysses.to_heads(self.qkv, self.plan).unbind(0)
        return self.ulysses.to_rows(joint_attention(q, k, v, self.mask, self.backend), self.plan)


class FastBlock(nn.Module):
    """One dual-stream block, fused: per stream one QKV linear [3*H*D, D], the output linear, the MLP's two; the
    QK-norm weights [D_head]; img_mod / txt_mod as in diffusers (nn.Sequential(SiLU, Linear(D, 6D)))."""

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

    def modulation(self, silu_temb: torch.Tensor, silu_temb_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(img [G, 6D], txt [B, 6D]) from the forward's silu(temb) [G, D] and its timestep-t rows [B, D]."""
        return self.img_mod[1](silu_temb), self.txt_mod[1](silu_temb_t)

    def forward(self, img: torch.Tensor, txt: torch.Tensor, img_tail: Tail | None, txt_tail: Tail | None,
                joint: JointInputs, text_out: bool = True, mods: tuple[torch.Tensor, torch.Tensor] | None = None):
        """img [B, L_img, D], txt [B, L_txt, D]: the residual streams before the previous block's tails are added.
        Returns (img, txt, img_tail, txt_tail) in the same form. text_out=False (the last block) skips the text
        stream's output projection and MLP, whose result diffusers discards. mods: this block's modulation from a
        table (modulation.py); None: computed here."""
        batch, img_len, dim = img.shape
        txt_len, fp8 = txt.shape[1], self.config.is_fp8
        img_mods, txt_mods = mods if mods is not None else self.modulation(joint.silu_temb, joint.silu_temb_t)
        im, tm = StreamMods(img_mods), StreamMods(txt_mods)  # [G, 6D], [B, 6D]
        img, img_x = head(img, img_tail, im.shift1, im.scale1, joint.mod_row, fp8("img_qkv"))
        txt, txt_x = head(txt, txt_tail, tm.shift1, tm.scale1, None, fp8("txt_qkv"))
        q, k, v = joint.qkv.unbind(0)
        qkv_pack(self.img_qkv(img_x).view(batch, img_len, -1), self.norm_q, self.norm_k, joint.img_freqs, q, k, v, 0,
                 eps=self.eps)
        qkv_pack(self.txt_qkv(txt_x).view(batch, txt_len, -1), self.norm_added_q, self.norm_added_k,
                 joint.txt_freqs, q, k, v, img_len, eps=self.eps)
        o = joint.attention()  # [B, L_img + L_txt, H, D]
        img_o, txt_o = split_attention(o, img_len, fp8("img_out"), fp8("txt_out"))

        img, img_x = gate_norm_mod(img, self.img_out(img_o).view(batch, img_len, dim), im.gate1, im.shift2,
                                   im.scale2, joint.mod_row, fp8("img_fc1"))
        img_mlp = self.img_fc2(gelu(self.img_fc1(img_x), fp8("img_fc2"))).view(batch, img_len, dim)
        if not text_out:
            return img, txt, Tail(img_mlp, im.gate2), None
        txt, txt_x = gate_norm_mod(txt, self.txt_out(txt_o).view(batch, txt_len, dim), tm.gate1, tm.shift2,
                                   tm.scale2, None, fp8("txt_fc1"))
        txt_mlp = self.txt_fc2(gelu(self.txt_fc1(txt_x), fp8("txt_fc2"))).view(batch, txt_len, dim)
        return img, txt, Tail(img_mlp, im.gate2), Tail(txt_mlp, tm.gate2)


def not_supported(name: str, advice: str):
    def method(self, *args, **kwargs):
        raise NotImplementedError(f"FastQwenImageTransformer.{name}: {advice}")

    method.__name__ = name
    method.__doc__ = f"Not supported: {advice}"
    return method


ATTENTION_ADVICE = ("the fast transformer runs its own fused attention; choose it with FastConfig(attention=...) "
                    "(auto, fa4, cudnn, sdpa), or keep the stock transformer (FastConfig.preset('baseline'))")
CACHE_ADVICE = ("step caching (diffusers' enable_cache: FirstBlockCache, TaylorSeer, ...) is not supported on the fast "
                "transformer; keep the stock transformer (FastConfig.preset('baseline')) to use it")
NOT_SUPPORTED = {
    "enable_gradient_checkpointing": "the fast transformer is inference-only; train diffusers' QwenImageTransformer2DModel",
    "set_attention_backend": ATTENTION_ADVICE,
    "reset_attention_backend": ATTENTION_ADVICE,
    "set_attn_processor": ATTENTION_ADVICE,
    "set_default_attn_processor": ATTENTION_ADVICE,
    "enable_xformers_memory_efficient_attention": ATTENTION_ADVICE,
    "set_use_memory_efficient_attention_xformers": ATTENTION_ADVICE,
    "enable_npu_flash_attention": ATTENTION_ADVICE,
    "set_use_npu_flash_attention": ATTENTION_ADVICE,
    "enable_xla_flash_attention": ATTENTION_ADVICE,
    "set_use_xla_flash_attention": ATTENTION_ADVICE,
    "fuse_qkv_projections": "its Q/K/V projections are fused per stream already",
    "unfuse_qkv_projections": "its Q/K/V projections stay fused per stream; keep the stock transformer for unfused ones",
    "enable_layerwise_casting": "its block linears are stored in FP8 already (FastConfig(fp8=True)); the other "
                                "layers stay in the model's dtype",
    "compile_repeated_blocks": "its forward is fused Triton kernels, replayed from CUDA graphs by the fast pipeline "
                               "(FastConfig(cuda_graphs=True)); torch.compile of it is not supported",
    "enable_parallelism": "parallel inference is not supported on the fast transformer",
    "dequantize": "rebuild it from the BF16 checkpoint instead: FastQwenImageTransformer.from_diffusers("
                  "QwenImageTransformer2DModel.from_pretrained(...), FastTransformerConfig(fp8=False))",
    "enable_cache": CACHE_ADVICE,
    "disable_cache": CACHE_ADVICE,
    "add_adapter": "adding an untrained adapter (training) is not supported; " + LORA_ADVICE,
    "enable_lora_hotswap": "hotswapping is not needed here: load another adapter and set_adapters() switches "
                           "without recompiling (CUDA graphs are recaptured)",
    "save_lora_adapter": "save the LoRA file you loaded; the fast transformer keeps adapters as loaded",
}


def check_carriable(stock, peft_layers: dict[str, nn.Module]):
    """Raise unless the stock model's peft adapters can be carried over exactly: LoRA on linears (no DoRA, bias,
    embedding), none fused into the weights, every layer in the same active/enabled state."""
    for name, layer in peft_layers.items():
        if not isinstance(layer.get_base_layer(), nn.Linear) or getattr(layer, "lora_embedding_A", None):
            raise NotImplementedError(f"the peft adapter at {name} is not a LoRA on a linear layer; " + BASELINE_ADVICE)
        for adapter in layer.lora_A:
            if layer.use_dora.get(adapter) or getattr(layer, "lora_bias", {}).get(adapter):
                raise NotImplementedError(f"adapter {adapter!r} at {name} uses DoRA or a LoRA bias; " + BASELINE_ADVICE)
        if layer.merged_adapters:
            raise ValueError(
                f"adapter(s) {layer.merged_adapters} are fused into the stock weights and still loaded (at {name}): "
                "converting would leave them impossible to unfuse. Either pipe.unload_lora_weights() first (the fused "
                "weights are converted as they are), or pipe.unfuse_lora() (the adapters are carried over unfused)")
    states = {(tuple(m.active_adapters), bool(m.disable_adapters)) for m in peft_layers.values()}
    if len(states) > 1:
        raise NotImplementedError(f"the LoRA layers are in different states {sorted(states)}; set them alike with "
                                  "pipe.set_adapters(...) / enable_lora() before converting")


class FastQwenImageTransformer(ModelMixin, ConfigMixin):
    """Drop-in for diffusers' QwenImageTransformer2DModel: same forward arguments and output, its config (plus
    "fast_config": how the block linears are stored), dtype, device, cache_context, and every weight registered, so
    `.to()`, `state_dict()`, `save_pretrained()` and offload hooks see them all.

    A diffusers ModelMixin (not a QwenImageTransformer2DModel subclass): pipelines, offload hooks and
    save/load treat it as a model, while nothing of the stock model's block structure is inherited that it does
    not have. Stock methods it cannot honour (attention processors, step caches, gradient checkpointing, LoRA
    adapters for now: PeftAdapterMixin would inject adapters into the few nn.Linear it has and silently skip the
    fused FP8 ones) raise NotImplementedError saying what to do instead. `.to(dtype)` casts everything except
    the FP8 weights and their scales.
    """

    config_name = "config.json"
    _no_split_modules = ["FastBlock"]
    _supports_gradient_checkpointing = False
    _supports_group_offloading = True

    def __init__(self, fast_config: FastTransformerConfig | dict | None = None, **config):
        """The structure, with uninitialized weights (build under torch.device("meta") to allocate nothing; use
        from_diffusers / from_pretrained for a working model). config: QwenImageTransformer2DModel's arguments."""
        super().__init__()
        unknown = sorted(set(config) - set(STOCK_CONFIG))
        if unknown:
            raise TypeError(f"unknown QwenImageTransformer2DModel config field(s) {unknown}")
        config = {**STOCK_CONFIG, **config}
        if not isinstance(fast_config, FastTransformerConfig):
            fast_config = FastTransformerConfig.from_dict(fast_config or {})
        self.register_to_config(**config, fast_config=fast_config.to_dict())
        self.fast_config = fast_config
        heads, head_dim = config["num_attention_heads"], config["attention_head_dim"]
        inner = heads * head_dim
        self.pos_embed = self._pos_embed(config)
        self.time_text_embed = QwenTimestepProjEmbeddings(inner, use_additional_t_cond=config["use_additional_t_cond"])
        self.txt_norm = RMSNorm(config["joint_attention_dim"], eps=1e-6)
        self.img_in = nn.Linear(config["in_channels"], inner)
        self.txt_in = nn.Linear(config["joint_attention_dim"], inner)
        self.transformer_blocks = nn.ModuleList(FastBlock(inner, heads, head_dim, fast_config)
                                                for _ in range(config["num_layers"]))
        self.norm_out = AdaLayerNormContinuous(inner, inner, elementwise_affine=False, eps=1e-6)
        out_channels = config["out_channels"] or config["in_channels"]
        self.proj_out = nn.Linear(inner, config["patch_size"] ** 2 * out_channels)
        self.zero_cond_t = config["zero_cond_t"]
        self._context: str | None = None  # the cache_context a forward runs in
        self.cfg_pairing: CfgPairing | None = None  # set by a pipeline that batches CFG through it
        self.call_graphs: CallGraphs | None = None  # lent by a family pipeline for one call (cuda_graph.py)
        self.ulysses: Ulysses | None = None  # set by a pipeline that splits the sequence over ranks (parallel.py)
        self.requires_grad_(False)
        self._mod_rows: dict = {}
        self.modulation_tables = ModulationTables()
        self.compute_device: torch.device | None = None  # set while some weights live on the host between uses
        self.lora_state = LoraState()
        self.weight_source: CheckpointWeights | None = None  # the BF16 masters of the FP8 weights (fuse_lora)

    @staticmethod
    def _pos_embed(config: dict) -> nn.Module:
        """The rotary tables (plain CPU tensors, no parameters; cached per device on use). Built on the CPU even under a
        meta-device context: they are computed, not loaded."""
        rope = QwenEmbedLayer3DRope if config["use_layer3d_rope"] else QwenEmbedRope
        with torch.device("cpu"):
            return rope(theta=10000, axes_dim=list(config["axes_dims_rope"]), scale_rope=True)

    # ---- building and loading

    @classmethod
    @torch.no_grad()
    def from_diffusers(cls, stock, config: FastTransformerConfig | None = None, device=None, modulation_device=None):
        """stock: a diffusers QwenImageTransformer2DModel (any device; left unchanged except that the modules shared
        with this model (embedders, img_mod/txt_mod, norm_out, proj_out) move to `device`, img_mod / txt_mod to
        `modulation_device` if given: "cpu" keeps their 12.7 GiB off the GPU, for tables built from the host).
        Block by block, so at most one block's BF16 linears sit on the device beside the converted ones."""
        if not isinstance(stock, QwenImageTransformer2DModel):
            raise TypeError(f"from_diffusers takes a diffusers QwenImageTransformer2DModel, got {type(stock).__name__}")
        peft_layers = peft_lora_layers(stock)
        check_carriable(stock, peft_layers)
        config = config or FastTransformerConfig()
        device = torch.device(device) if device is not None else stock.device
        if not torch.cuda.is_available():
            check_triton_runs_on(device)
        if config.attention != "auto":
            resolve_backend(config.attention, device, stock.dtype)  # a clear error before any conversion
        stock_config = {name: stock.config[name] for name in STOCK_CONFIG if name in stock.config}
        with torch.device("meta"):
            fast = cls(config, **stock_config)
        fast.pos_embed = stock.pos_embed
        for name in ("time_text_embed", "txt_norm", "img_in", "txt_in", "norm_out", "proj_out"):
            setattr(fast, name, getattr(stock, name).to(device))
        for i, block in enumerate(stock.transformer_blocks):
            fast.transformer_blocks[i] = FastBlock.from_stock(block, config, device, modulation_device or device)
        if peft_layers:
            fast._carry_lora(stock, peft_layers)
        fast.weight_source = CheckpointWeights.of(stock)
        return fast.requires_grad_(False).eval()

    def _carry_lora(self, stock, peft_layers: dict[str, nn.Module]):
        """The stock model's peft adapters (check_carriable passed), as they are: factors, scaling, active set."""
        for name, layer in peft_layers.items():
            if self.get_submodule(site_of(name)[0]) is layer:  # shared with stock: take its bare base layer
                self._replace_unshared(name, layer.get_base_layer())
        first = next(iter(peft_layers.values()))
        state = self.lora_state
        for adapter, peft_config in stock.peft_config.items():
            state.configs[adapter] = peft_config
            state.layer_scale[adapter] = 1.0
        weights: dict[str, set] = {a: set() for a in state.configs}
        for name, layer in peft_layers.items():
            lora, device = self._lora_host(name)
            for adapter in layer.lora_A:
                r, alpha = layer.r[adapter], layer.lora_alpha[adapter]
                base = alpha / (r ** 0.5 if stock.peft_config[adapter].use_rslora else r)
                weights[adapter].add(round(layer.scaling[adapter] / base, 12))
                lora.add(name, adapter, layer.lora_A[adapter].weight.detach().to(device, self.dtype),
                         layer.lora_B[adapter].weight.detach().to(device, self.dtype), base)
        uneven = {a: sorted(w) for a, w in weights.items() if len(w) > 1}
        if uneven:
            raise NotImplementedError(f"adapter weights differ between layers {uneven}; the fast transformer keeps one "
                                      "weight per adapter: set_adapters(names, weights) with floats before converting")
        for adapter, w in weights.items():
            state.weight[adapter] = w.pop() if w else 1.0
        state.active, state.enabled = list(first.active_adapters), not first.disable_adapters
        self._lora_changed()

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, subfolder: str | None = None, *, device=None,
                        torch_dtype: torch.dtype | None = None, fast_config: FastTransformerConfig | None = None,
                        **unsupported):
        """Load what save_pretrained wrote (a local folder or a hub repo): weights as stored (FP8 ones with their
        scales, not requantized), straight onto `device` (default: the CPU). torch_dtype casts all but the FP8
        tensors. fast_config: how to run it (fp8 and bf16_linears must match the checkpoint; fp8_fast_accum and
        attention may differ); None: as saved, attention "auto"."""
        if unsupported:  # e.g. a diffusers pipeline's loader (device_map, low_cpu_mem_usage, variant, ...)
            raise ValueError(
                f"{pretrained_model_name_or_path} holds a qwen-image-fast transformer (FP8 block linears, fused "
                f"layout), which diffusers' own pipelines and loaders cannot run (arguments "
                f"{', '.join(sorted(unsupported))} are not supported): load it with "
                "qwen_image_fast.QwenImageFastPipeline.from_pretrained(folder), or this model with "
                "FastQwenImageTransformer.from_pretrained(folder, subfolder='transformer', device=...)")
        folder = local_folder(pretrained_model_name_or_path, subfolder)
        saved = json.loads((folder / cls.config_name).read_text())
        if saved.get("_class_name") != cls.__name__ or "fast_config" not in saved:
            raise ValueError(
                f"{folder} holds a {saved.get('_class_name')} checkpoint, not a FastQwenImageTransformer one; "
                "convert a stock model with FastQwenImageTransformer.from_diffusers(QwenImageTransformer2DModel."
                "from_pretrained(...)), or load the pipeline with QwenImageFastPipeline.from_pretrained(...)")
        stored = FastTransformerConfig.from_dict(saved["fast_config"])
        run = fast_config or FastTransformerConfig(**{**stored.to_dict(), "attention": "auto"})
        if (run.fp8, run.bf16_linears) != (stored.fp8, stored.bf16_linears):
            raise ValueError(
                f"{folder} stores the block linears with fp8={stored.fp8}, bf16_linears={list(stored.bf16_linears)}; "
                f"fast_config asks for fp8={run.fp8}, bf16_linears={list(run.bf16_linears)}: pass a config with the "
                "stored values, or convert the stock checkpoint with the ones you want")
        device = torch.device(device or "cpu")
        if not torch.cuda.is_available():
            check_triton_runs_on(device)
        stock_config = {name: saved[name] for name in STOCK_CONFIG if name in saved}
        with torch.device("meta"):
            model = cls(run, **stock_config)
        model.pos_embed = cls._pos_embed({**STOCK_CONFIG, **stock_config})
        model.load_state_dict(load_safetensors_folder(folder, device), strict=True, assign=True)
        if torch_dtype is not None:
            model.to(torch_dtype)
        if run.attention != "auto":
            resolve_backend(run.attention, device, model.dtype)
        return model.requires_grad_(False).eval()

    # ---- LoRA adapters (lora.py: where they attach, and how their state follows peft's)

    @property
    def peft_config(self) -> dict:
        """adapter name -> peft LoraConfig, as diffusers' PeftAdapterMixin keeps it; absent (AttributeError, as
        after diffusers' unload) while no adapter is loaded."""
        if not self.lora_state.configs:
            raise AttributeError("peft_config: no LoRA adapter is loaded")
        return self.lora_state.configs

    @property
    def _hf_peft_config_loaded(self) -> bool:
        return bool(self.lora_state.configs)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """ModelMixin.save_pretrained, refused while LoRA adapters are loaded: the checkpoint would silently lack
        them (they are not weights of the model)."""
        if self.lora_state.configs:
            raise ValueError(
                f"save_pretrained with LoRA adapters {sorted(self.lora_state.configs)} loaded would write the model "
                "without them: unload_lora_weights() first and keep the LoRA files to load again, or fuse the LoRA "
                "into the stock model, unload it there and convert (optimize) that")
        return super().save_pretrained(save_directory, *args, **kwargs)

    def _lora_changed(self):
        self.lora_state.version += 1

    def _lora_layers(self) -> list[LoraLinear]:
        return [m for m in self.modules() if isinstance(m, LoraLinear)]

    def _lora_host(self, stock_name: str, create: bool = True) -> tuple[LoraLinear, torch.device] | None:
        """The LoraLinear holding the site of a stock module name (created on first use), and its linear's device;
        ValueError if no linear of this model has that name (create=False: only that check)."""
        name, third = site_of(stock_name)
        try:
            module = self.get_submodule(name)
        except AttributeError:
            module = None
        if not isinstance(module, (FastLinear, nn.Linear)):
            raise ValueError(f"the LoRA targets {stock_name!r}, which is not a linear layer of QwenImageTransformer2DModel "
                             f"(config: {dict(num_layers=self.config.num_layers)})")
        if not create:
            return None
        lora = getattr(module, "lora", None)  # FastLinear: None until then; a plain nn.Linear: no such attribute
        if lora is None:
            if third is None:
                sites = {stock_name: (0, module.out_features)}
            else:
                n = module.out_features // 3
                block = stock_name.rsplit(".", 1)[0]  # transformer_blocks.{i}.attn
                names = (("to_q", "to_k", "to_v") if name.endswith("img_qkv") else
                         ("add_q_proj", "add_k_proj", "add_v_proj"))
                sites = {f"{block}.{q}": (i * n, (i + 1) * n) for i, q in enumerate(names)}
            lora = LoraLinear(sites, module.in_features, self.lora_state)
            if isinstance(module, FastLinear):
                module.lora = lora
            else:
                self._replace_unshared(name, LoraTargetLinear.wrap(module, lora))
        return lora, self.compute_device or next(module.parameters()).device

    def _replace_unshared(self, name: str, new: nn.Module):
        """Put `new` at `name` without touching modules the stock model may share (from_diffusers shares the
        embedders, img_mod / txt_mod, norm_out, proj_out): each container on the path is replaced by a shallow copy
        with its own child table."""
        *path, leaf = name.split(".")
        parent = self
        for part in path:
            child = parent._modules[part]
            if not isinstance(child, (FastBlock, nn.ModuleList)):
                copy = object.__new__(type(child))
                copy.__dict__ = {**child.__dict__, "_modules": dict(child._modules)}
                parent._modules[part] = copy
                child = copy
            parent = child
        parent._modules[leaf] = new

    def load_lora_adapter(self, pretrained_model_name_or_path_or_dict, prefix="transformer", hotswap: bool = False,
                          **kwargs):
        """diffusers' PeftAdapterMixin.load_lora_adapter: the same arguments, file formats and config inference
        (diffusers' own _fetch_state_dict and _create_lora_config); the adapter becomes the active one."""
        from diffusers.loaders.lora_base import _fetch_state_dict
        from diffusers.utils import convert_unet_state_dict_to_peft
        from diffusers.utils.peft_utils import _create_lora_config
        from peft.utils.other import get_pattern_key

        if hotswap:
            raise NotImplementedError("hotswap=True: " + NOT_SUPPORTED["enable_lora_hotswap"])
        adapter_name = kwargs.pop("adapter_name", None)
        network_alphas = kwargs.pop("network_alphas", None)
        metadata = kwargs.pop("metadata", None)
        pipeline = kwargs.pop("_pipeline", None)
        kwargs.pop("low_cpu_mem_usage", None)  # factors are small: always loaded as given
        fetch = {k: kwargs.pop(k, None) for k in ("cache_dir", "proxies", "local_files_only", "token", "revision",
                                                    "subfolder", "weight_name", "use_safetensors")}
        fetch["force_download"] = kwargs.pop("force_download", False)
        if kwargs:
            raise TypeError(f"load_lora_adapter got unexpected arguments {sorted(kwargs)}")
        state_dict, metadata = _fetch_state_dict(pretrained_model_name_or_path_or_dict=pretrained_model_name_or_path_or_dict,
                                                 user_agent={"file_type": "attn_procs_weights", "framework": "pytorch"},
                                                 allow_pickle=False, metadata=metadata, **fetch)
        if network_alphas is not None and prefix is None:
            raise ValueError("`network_alphas` cannot be None when `prefix` is None.")
        if prefix is not None:
            state_dict = {k.removeprefix(f"{prefix}."): v for k, v in state_dict.items() if k.startswith(f"{prefix}.")}
            if metadata is not None:
                metadata = {k.removeprefix(f"{prefix}."): v for k, v in metadata.items() if k.startswith(f"{prefix}.")}
            if network_alphas:
                network_alphas = {k.removeprefix(f"{prefix}."): v for k, v in network_alphas.items()
                                  if k.startswith(f"{prefix}.")}
        if not state_dict:
            logger.warning(f"No LoRA keys associated to {type(self).__name__} found with the prefix={prefix!r}: "
                           "nothing was loaded (as diffusers does); pass prefix=None for keys without it")
            return
        if adapter_name in self.lora_state.configs:
            raise ValueError(f"Adapter name {adapter_name} already in use in the model - please select a new adapter "
                             "name.")
        adapter_name = adapter_name or f"default_{len(self.lora_state.configs)}"
        if any(".lokr_" in k for k in state_dict):
            raise NotImplementedError("LoKr adapters are not supported on the fast transformer; " + BASELINE_ADVICE)
        if "lora_A" not in next(iter(state_dict)):
            state_dict = convert_unet_state_dict_to_peft(state_dict)
        rank = {f"^{k}": v.shape[1] for k, v in state_dict.items() if "lora_B" in k and v.ndim > 1}
        config = _create_lora_config(state_dict, network_alphas, metadata, rank, adapter_name=adapter_name)
        if config.use_dora or config.lora_bias:
            raise NotImplementedError(f"{'DoRA' if config.use_dora else 'LoRA bias'} adapters are not supported on "
                                      "the fast transformer; " + BASELINE_ADVICE)
        unknown = [k for k in state_dict if not (k.endswith(".lora_A.weight") or k.endswith(".lora_B.weight"))]
        if unknown:
            raise NotImplementedError(f"LoRA tensors {unknown[:3]} are not plain lora_A / lora_B weights; "
                                      + BASELINE_ADVICE)
        targets = sorted({k.rsplit(".lora_", 1)[0] for k in state_dict})
        for target in targets:  # every target checked before anything is added
            self._lora_host(target, create=False)
        # As diffusers' loader: accelerate's offload hooks come off for the injection and go back on after it
        model_offload, sequential_offload, _ = _func_optionally_disable_offloading(pipeline)
        hosts = [self._lora_host(t) for t in targets]
        for target, (lora, device) in zip(targets, hosts):
            a, b = state_dict[f"{target}.lora_A.weight"], state_dict[f"{target}.lora_B.weight"]
            r = config.rank_pattern.get(get_pattern_key(config.rank_pattern.keys(), target), config.r)
            alpha = config.alpha_pattern.get(get_pattern_key(config.alpha_pattern.keys(), target), config.lora_alpha)
            base_scale = alpha / (r ** 0.5 if config.use_rslora else r)
            lora.add(target, adapter_name, a.to(device, self.dtype), b.to(device, self.dtype), base_scale)
        state = self.lora_state
        state.configs[adapter_name] = config
        state.weight[adapter_name], state.layer_scale[adapter_name] = 1.0, 1.0
        state.active = [adapter_name]  # peft activates the adapter it just injected, on every layer
        self._lora_changed()
        if model_offload:
            pipeline.enable_model_cpu_offload()
        elif sequential_offload:
            pipeline.enable_sequential_cpu_offload()
        _maybe_remove_and_reapply_group_offloading(self)  # group offload's groups must take in the new factors

    def _check_adapters(self, names: list[str]):
        missing = [n for n in names if n not in self.lora_state.configs]
        if missing:
            raise ValueError(f"Adapter name(s) {missing} not in the list of present adapters: "
                             f"{set(self.lora_state.configs)}.")

    def set_adapters(self, adapter_names, weights=None):
        """Activate these adapters with these weights (None: 1.0), as diffusers' set_adapters."""
        names = [adapter_names] if isinstance(adapter_names, str) else list(adapter_names)
        weights = weights if isinstance(weights, list) else [weights] * len(names)
        if len(names) != len(weights):
            raise ValueError(f"Length of adapter names {len(names)} is not equal to the length of their weights "
                             f"{len(weights)}.")
        if any(isinstance(w, dict) for w in weights):
            raise NotImplementedError("per-block adapter weights (dicts) are not supported on the fast transformer; "
                                      "pass one float per adapter")
        self._check_adapters(names)
        state = self.lora_state
        state.active = names
        for name, w in zip(names, weights):
            state.weight[name], state.layer_scale[name] = 1.0 if w is None else float(w), 1.0
        self._lora_changed()

    def set_adapter(self, adapter_name):
        names = [adapter_name] if isinstance(adapter_name, str) else list(adapter_name)
        self._check_adapters(names)
        self.lora_state.active = names
        self._lora_changed()

    def active_adapters(self) -> list[str]:
        if not self.lora_state.configs:
            raise ValueError("No adapter loaded. Please load an adapter first.")
        return list(self.lora_state.active)

    def _set_enabled(self, enabled: bool):
        self.lora_state.enabled = enabled
        if not enabled:  # peft unfuses a disabled layer (at its next forward; nothing runs in between here)
            self._unfreeze_all()
        self._lora_changed()

    def disable_lora(self):
        self._set_enabled(False)

    def enable_lora(self):
        self._set_enabled(True)

    disable_adapters, enable_adapters = disable_lora, enable_lora

    def fuse_lora(self, lora_scale=1.0, safe_fusing=False, adapter_names=None):
        """peft's merge per layer: the active adapters (or adapter_names) at their scaling times lora_scale (which,
        as in peft, stays on their scaling) are frozen into the layers; see lora.py."""
        names = list(self.lora_state.active) if adapter_names is None else list(adapter_names)
        self._check_adapters(names)
        if lora_scale != 1.0:
            for name in self.lora_state.active:
                self.lora_state.layer_scale[name] *= lora_scale
        for lora in self._lora_layers():
            lora.freeze(names, safe_fusing)
        # Folded into FP8 weights unless offload hooks hold their own copies of the weights (group offload with
        # streams onloads from pinned host copies, which a fold would not reach): then kept low-rank, still exact.
        if not has_offload_hooks(self):
            fallback = []  # (linear, why)
            for name, module in self.named_modules():
                if isinstance(module, FastLinear) and module.lora is not None:
                    module.fold_lora(master=functools.partial(self._master, name, module, fallback))
            if fallback:
                logger.warning(f"fuse_lora: {len(fallback)} FP8 linears were requantized from their dequantized FP8 "
                               f"weights, a second e4m3 rounding ({fallback[0][0]}: {fallback[0][1]}); fusing on "
                               "the stock pipeline before optimize(), or loading the upstream checkpoint with "
                               "QwenImageFastPipeline.from_pretrained, quantizes the merged weights once")
        self._lora_changed()

    def _master(self, name: str, linear: FastLinear, fallback: list) -> torch.Tensor | None:
        """The BF16 weight the FP8 linear `name` was quantized from, read from weight_source ([N, K], the stock
        q / k / v weights stacked for a qkv linear), if it quantizes to that FP8 weight bit-exactly; else None,
        recorded in `fallback`."""
        why = "no checkpoint folder is known (the stock model was not loaded from one)"
        if self.weight_source is not None and name.startswith("transformer_blocks."):
            i, fast_name = name.split(".")[1:]
            stock = [n for n, (linear_name, _) in sorted(BLOCK_SITES.items(), key=lambda kv: kv[1][1] or 0)
                     if linear_name == fast_name]
            device = linear.weight_q.device
            try:
                master = torch.cat([self.weight_source.get(f"transformer_blocks.{i}.{n}.weight", device)
                                    for n in stock])
            except (OSError, KeyError) as e:
                why = f"{self.weight_source.folder} cannot be read ({type(e).__name__}: {e})"
            else:
                q, s = quantize_fp8_rowwise_ref(master)
                if torch.equal(q.view(torch.uint8), linear.weight_q.view(torch.uint8)) and \
                        torch.equal(s.view(-1), linear.weight_scale):
                    return master
                why = f"its weight in {self.weight_source.folder} no longer quantizes to the model's"
        fallback.append((name, why))
        return None

    def unfuse_lora(self):
        self._unfreeze_all()
        self._lora_changed()

    def _unfreeze_all(self):
        folded = [m for m in self.modules() if isinstance(m, FastLinear) and m.lora is not None and m.lora.folded]
        if folded and has_offload_hooks(self):
            raise RuntimeError("the fused LoRA adapters are folded into the FP8 weights, and offload hooks were added "
                               "since, which may hold their own copies of the weights: remove the offloading "
                               "(e.g. pipe.remove_all_hooks()), unfuse, then enable it again")
        for module in folded:
            module.unfold_lora()
        for lora in self._lora_layers():
            lora.unfreeze()

    @property
    def fused_adapters(self) -> set[str]:
        return {a for lora in self._lora_layers() for frozen in lora.frozen.values() for a, _ in frozen}

    def delete_adapters(self, adapter_names):
        names = [adapter_names] if isinstance(adapter_names, str) else list(adapter_names)
        fused = set(names) & self.fused_adapters
        if fused:
            raise ValueError(f"adapter(s) {sorted(fused)} are fused: unfuse_lora() first, then delete them")
        state = self.lora_state
        for name in names:
            for lora in self._lora_layers():
                lora.delete(name)
            for table in (state.configs, state.weight, state.layer_scale):
                table.pop(name, None)
            if name in state.active:  # as peft: the other active ones stay, else the first remaining adapter
                state.active = [a for a in state.active if a != name] or list(state.configs)[:1]
        self._drop_empty_lora_layers()
        self._lora_changed()
        _maybe_remove_and_reapply_group_offloading(self)

    def unload_lora(self):
        """Remove every adapter: fused ones stay in effect, as diffusers' unload keeps merged weights; unfused
        ones are gone (the base weights are untouched, so unfusing first restores the model exactly)."""
        fused = self.fused_adapters
        if fused:
            raise NotImplementedError(
                f"adapter(s) {sorted(fused)} are fused, and unloading would have to bake them into the weights, which "
                "the fast transformer does not do (an FP8 weight would be requantized): call unfuse_lora() before "
                "unloading, or keep them loaded")
        state = self.lora_state
        for lora in self._lora_layers():
            for name in list(lora.adapters):
                lora.delete(name)
        state.configs.clear(), state.weight.clear(), state.layer_scale.clear()
        state.active, state.enabled = [], True
        self._drop_empty_lora_layers()
        self._lora_changed()
        _maybe_remove_and_reapply_group_offloading(self)

    def _drop_empty_lora_layers(self):
        for name, module in list(self.named_modules()):
            if isinstance(module, FastLinear) and module.lora is not None and not module.lora.adapters:
                module.lora = None
            elif isinstance(module, LoraTargetLinear) and not module.lora.adapters:
                self._replace_unshared(name, module.original[0])

    @contextlib.contextmanager
    def _lora_call_scale(self, scale: float):
        self.lora_state.call_scale = float(scale)
        try:
            yield
        finally:
            self.lora_state.call_scale = 1.0

    # ---- what pipelines and users touch on a diffusers model

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (that of every weight except the FP8 ones and their fp32 scales)."""
        return self.img_in.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.img_in.weight.device

    @property
    def attention_backend(self) -> str:
        """The attention that runs on the model's current device and dtype."""
        return resolve_backend(self.fast_config.attention, self.device, self.dtype)

    @contextlib.contextmanager
    def cache_context(self, name: str):
        """Diffusers' pipelines mark the cond / uncond passes for step caches; there are none here (enable_cache
        raises). The name tells cfg_pairing which pass a forward is."""
        previous, self._context = self._context, name
        try:
            yield
        finally:
            self._context = previous

    @property
    def attn_processors(self):
        raise NotImplementedError(f"FastQwenImageTransformer.attn_processors: {ATTENTION_ADVICE}")

    def _check_weights_on(self, device: torch.device, modulation: bool):
        """With weights on the host between uses (compute_device set: memory="low"), the block linears, and for a
        forward without a table the modulation weights, must be where it runs (offload hooks move weights
        themselves, block by block)."""
        if self.compute_device is None:
            return
        where = self.transformer_blocks[0].img_qkv.bias.device
        if where != device:
            raise RuntimeError(
                f"the transformer's block linears are on {where} and the forward on {device}: with "
                "FastConfig(memory='low') they take turns with the text encoder on the GPU, and "
                "QwenImageFastPipeline brings them in before its loop; call the pipeline, not the transformer")
        if not modulation:
            return
        where = self.transformer_blocks[0].img_mod[1].weight.device
        if where != device:
            raise RuntimeError(
                f"the modulation weights (img_mod / txt_mod) are on {where} and the forward on {device} "
                "(FastConfig(memory='low') keeps them on the host): pass this step's row of "
                "transformer.modulation_table(...) as modulation=, which QwenImageFastPipeline does, or move the "
                "transformer with .to(device)")

    def _mod_row(self, img_shapes, batch: int, device, plan: UlyssesPlan | None = None) -> torch.Tensor:
        """zero_cond_t: the modulation row of each image token, b (its sample, timestep t) for the first image's
        tokens and b + B (timestep 0) for condition images. int32 [B * L_img] (under Ulysses this rank's image
        tokens only), cached per shape."""
        img = plan.img if plan else slice(None)
        key = (str(img_shapes), batch, str(device), img.start, img.stop)
        if key not in self._mod_rows:
            index = torch.tensor(
                [[0] * prod(sample[0]) + [1] * sum(prod(s) for s in sample[1:]) for sample in img_shapes],
                dtype=torch.int32,
            )
            rows = torch.arange(batch, dtype=torch.int32)[:, None] + batch * index
            self._mod_rows[key] = rows[:, img].flatten().to(device)
        return self._mod_rows[key]

    # ---- the modulation table (modulation.py)

    def modulation_layout(self, batch: int) -> ModulationLayout:
        return ModulationLayout(blocks=len(self.transformer_blocks), batch=batch,
                                img_rows=2 * batch if self.zero_cond_t else batch, dim=self.inner_dim)

    @property
    def inner_dim(self) -> int:
        return self.config.num_attention_heads * self.config.attention_head_dim

    def time_embedding(self, timestep: torch.Tensor, guidance: torch.Tensor | None, additional_t_cond,
                       dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The modulation inputs of a forward given `timestep` [B] (and guidance, additional_t_cond) in `dtype`:
        silu(temb) [G, D] and its timestep-t rows [B, D] (G = 2B with zero_cond_t: timestep t, then 0)."""
        timestep = timestep.to(dtype)
        if self.zero_cond_t:
            timestep = torch.cat([timestep, timestep * 0], dim=0)
        like = timestep.new_empty(0)  # QwenTimestepProjEmbeddings reads only its dtype
        if guidance is not None:
            guidance = guidance.to(dtype) * 1000
        temb = (
            self.time_text_embed(timestep, like, additional_t_cond)
            if guidance is None
            else self.time_text_embed(timestep, guidance, like, additional_t_cond)
        )  # [G, D]
        silu_temb = F.silu(temb)
        return silu_temb, silu_temb.chunk(2, dim=0)[0] if self.zero_cond_t else silu_temb

    def _modulation_modules(self) -> list[nn.Module]:
        return [self.time_text_embed, self.norm_out.linear] + [
            m for block in self.transformer_blocks for m in (block.img_mod, block.txt_mod)]

    @torch.no_grad()
    def modulation_table(self, timesteps: torch.Tensor, guidance: torch.Tensor | None = None, additional_t_cond=None,
                         lora_scale: float = 1.0) -> torch.Tensor:
        """[N, layout.size]: row n is the modulation of a forward given timestep=timesteps[n] ([N, B], on the
        model's device, exactly as passed to forward), guidance=guidance[n] (None or [N, B]), additional_t_cond and
        attention_kwargs={"scale": lora_scale}; pass it as forward(..., modulation=table[n]). Built one step and one
        block at a time, each block's img_mod / txt_mod put on the model's device while it is used (they may live
        on the host: FastConfig.memory="low"). The last few tables are kept (modulation.py says what the key holds)."""
        device, dtype = self.device, self.dtype
        layout = self.modulation_layout(timesteps.shape[1])
        weights = tuple((t.data_ptr(), t._version) for m in self._modulation_modules() for t in tensors_of(m))
        key = (tensor_key(timesteps), tensor_key(guidance), tensor_key(additional_t_cond), self.zero_cond_t,
               str(dtype), str(device), self.lora_state.version, float(lora_scale), weights)

        def build() -> torch.Tensor:
            table = torch.empty(timesteps.shape[0], layout.size, dtype=dtype, device=device)
            with self._lora_call_scale(lora_scale):
                inputs = [self.time_embedding(timesteps[n], None if guidance is None else guidance[n],
                                              additional_t_cond, dtype) for n in range(timesteps.shape[0])]
                for n, (_, silu_temb_t) in enumerate(inputs):
                    layout.out(table[n]).copy_(self.norm_out.linear(silu_temb_t))
                for i, block in enumerate(self.transformer_blocks):
                    with on_device([block.img_mod, block.txt_mod], device):
                        for n, (silu_temb, silu_temb_t) in enumerate(inputs):
                            img, txt = layout.block(table[n], i)
                            mods = block.modulation(silu_temb, silu_temb_t)
                            img.copy_(mods[0])
                            txt.copy_(mods[1])
            return table

        return self.modulation_tables.get(key, build)

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
        modulation: torch.Tensor | None = None,
    ):
        """diffusers' forward. modulation (not a diffusers argument): this step's row of modulation_table(...)
        built for the same timestep, guidance, additional_t_cond and attention_kwargs scale; then the timestep
        embedding and the modulation linears are not run (their weights are not read)."""
        attention_kwargs = dict(attention_kwargs or {})
        scale = attention_kwargs.pop("scale", 1.0)
        if attention_kwargs:  # diffusers' attention processors ignore these too (with a warning)
            logger.warning(f"attention_kwargs {sorted(attention_kwargs)} are not expected by the Qwen-Image "
                           "attention and are ignored (as diffusers does)")
        inputs = dict(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                      encoder_hidden_states_mask=encoder_hidden_states_mask, timestep=timestep, img_shapes=img_shapes,
                      guidance=guidance, controlnet_block_samples=controlnet_block_samples,
                      additional_t_cond=additional_t_cond, modulation=modulation)
        with self._lora_call_scale(scale):
            state = (scale, self.lora_state.version)
            graphs = self.call_graphs
            forward = self._forward if graphs is None else (lambda **kwargs: graphs(self._forward, kwargs, state))
            if self.cfg_pairing is None:
                output = forward(**inputs)
            elif modulation is not None:
                raise ValueError("modulation= is for one forward; a pipeline that pairs CFG forwards computes it")
            else:
                output = self.cfg_pairing(forward, self._context, inputs, state)
        return Transformer2DModelOutput(sample=output) if return_dict else (output,)

    def _forward(self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, timestep, img_shapes,
                 guidance, controlnet_block_samples, additional_t_cond, modulation=None) -> torch.Tensor:
        device = hidden_states.device
        check_triton_runs_on(device)
        batch, img_len, _ = hidden_states.shape
        ulysses, plan = self.ulysses, None
        if ulysses is not None and encoder_hidden_states.shape[1] < ulysses.degree:  # every rank holds text
            encoder_hidden_states, encoder_hidden_states_mask = pad_text(
                encoder_hidden_states, encoder_hidden_states_mask, ulysses.degree)
        txt_len = encoder_hidden_states.shape[1]  # the whole text (RoPE positions, mask)
        if ulysses is not None:  # this rank's rows only from here on (parallel.py)
            plan = ulysses.plan(img_len, txt_len, device)
            hidden_states, encoder_hidden_states = hidden_states[:, plan.img], encoder_hidden_states[:, plan.txt]
            if controlnet_block_samples is not None:
                controlnet_block_samples = [sample[:, plan.img] for sample in controlnet_block_samples]
        hidden_states = self.img_in(hidden_states)  # [B, L_img, D]
        mod_row = self._mod_row(img_shapes, batch, device, plan) if self.zero_cond_t else None
        encoder_hidden_states = self.txt_in(self.txt_norm(encoder_hidden_states))  # [B, L_txt, D]

        layout = self.modulation_layout(batch)
        self._check_weights_on(device, modulation=modulation is None)
        if modulation is None:
            silu_temb, silu_temb_t = self.time_embedding(timestep, guidance, additional_t_cond, hidden_states.dtype)
        elif modulation.shape != (layout.size,) or modulation.dtype != hidden_states.dtype:
            raise ValueError(f"modulation {tuple(modulation.shape)} {modulation.dtype}: a forward of batch {batch} "
                             f"takes a row of modulation_table(...) ({layout.size},) {hidden_states.dtype}")
        else:
            silu_temb = silu_temb_t = None
        img_freqs, txt_freqs = self.pos_embed(img_shapes, max_txt_seq_len=txt_len, device=device)
        if plan:
            img_freqs, txt_freqs = img_freqs[plan.img], txt_freqs[plan.txt]
        block0 = self.transformer_blocks[0]
        rows = plan.local_len if plan else img_len + txt_len
        joint = JointInputs(
            mask=None if encoder_hidden_states_mask is None else TextMask(encoder_hidden_states_mask, img_len),
            img_freqs=torch.view_as_real(img_freqs), txt_freqs=torch.view_as_real(txt_freqs),
            silu_temb=silu_temb, silu_temb_t=silu_temb_t,
            mod_row=mod_row, backend=resolve_backend(self.fast_config.attention, device, hidden_states.dtype),
            qkv=hidden_states.new_empty(3, batch, rows, block0.heads, block0.head_dim), ulysses=ulysses, plan=plan,
        )

        img, txt, img_tail, txt_tail = hidden_states, encoder_hidden_states, None, None
        n_blocks = len(self.transformer_blocks)
        for i, block in enumerate(self.transformer_blocks):
            mods = None if modulation is None else layout.block(modulation, i)
            img, txt, img_tail, txt_tail = block(img, txt, img_tail, txt_tail, joint, i < n_blocks - 1, mods)
            if controlnet_block_samples is not None:  # added after the block's residual, as diffusers does
                img = add_tail(img, img_tail, mod_row) + controlnet_block_samples[i // -(-n_blocks //
                                                                                       len(controlnet_block_samples))]
                img_tail = None

        out_mod = self.norm_out.linear(silu_temb_t) if modulation is None else layout.out(modulation)
        out_scale, out_shift = out_mod.chunk(2, dim=1)  # [B, D] each
        if img_tail is not None and mod_row is None:  # last residual fused with norm_out's LayerNorm + modulation
            img, img_x = residual_gate_layer_norm_modulate(img, img_tail.out, img_tail.gate, out_shift, out_scale)
        else:  # norm_out modulates per sample, a zero_cond_t gate per token
            img_x = layer_norm_modulate(add_tail(img, img_tail, mod_row), out_shift, out_scale)
        out = self.proj_out(img_x)  # [B, L_img, p*p*C]
        return out if plan is None else ulysses.gather_image(out, plan)


for _name, _advice in NOT_SUPPORTED.items():
    setattr(FastQwenImageTransformer, _name, not_supported(_name, _advice))


def local_folder(path_or_id, subfolder: str | None) -> Path:
    """A local folder as is; a hub repo id: its snapshot (the subfolder's files only)."""
    path = Path(path_or_id)
    if not path.is_dir():
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(str(path_or_id), allow_patterns=[f"{subfolder}/*"] if subfolder else None))
    return path / subfolder if subfolder else path


def load_safetensors_folder(folder: Path, device: torch.device) -> dict[str, torch.Tensor]:
    """Every tensor of a diffusers model folder (one safetensors file, or shards with an index) onto device."""
    from safetensors.torch import load_file

    index = folder / "diffusion_pytorch_model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists()
             else ["diffusion_pytorch_model.safetensors"])
    state = {}
    for name in files:
        state.update(load_file(folder / name, device=str(device)))
    return state
