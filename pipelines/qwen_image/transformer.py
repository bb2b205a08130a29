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
from diffusers.models.modeling_outputs import Transformer2DModelOutput
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
from .config import FP8_LINEARS, FastTransformerConfig

__all__ = ["FP8_LINEARS", "FastLinear", "FastQwenImageTransformer", "FastTransformerConfig"]

# The stock model's constructor arguments and defaults: its config, which ours keeps (plus "fast_config").
STOCK_CONFIG = {name: p.default for name, p in inspect.signature(QwenImageTransformer2DModel.__init__).parameters.items()
                if name != "self"}
LORA_ADVICE = ("LoRA adapters are not supported on the fast transformer yet: load the LoRA on the stock pipeline and "
               "fuse it before converting (pipe.load_lora_weights(...); pipe.fuse_lora(); pipe.unload_lora_weights(); "
               "then optimize(pipe))")


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


def unmerged_lora_modules(model: nn.Module) -> list[str]:
    """Names of modules with an active peft LoRA adapter that is not merged into the weights (duck-typed on peft's
    BaseTunerLayer attributes, so peft need not be installed)."""
    names = []
    for name, module in model.named_modules():
        active = getattr(module, "active_adapters", None)
        if active is None or not hasattr(module, "merged_adapters") or getattr(module, "disable_adapters", False):
            continue
        if set(active) - set(module.merged_adapters):
            names.append(name)
    return names


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
            return fp8_linear(q, s, self.weight_q, self.weight_scale, self.bias, self.bias.dtype, self.fast_accum)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8={self.fp8}"


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
    """What every block of one forward shares: lengths, text mask, rotary tables, timestep embeddings, attention
    backend, and the joint Q/K/V buffers [B, L_img + L_txt, H, D] each block refills (image first, attention.py
    says why)."""

    img_len: int
    txt_len: int
    mask: TextMask | None
    img_freqs: torch.Tensor  # [L_img, D_head / 2, 2] fp32 (cos, sin)
    txt_freqs: torch.Tensor  # [L_txt, D_head / 2, 2]
    silu_temb: torch.Tensor  # [G, D]: image modulation input (G = 2B with zero_cond_t: timestep t, then 0)
    silu_temb_t: torch.Tensor  # [B, D]: text and norm_out modulation input (timestep t)
    mod_row: torch.Tensor | None  # zero_cond_t: int32 [B * L_img], each image token's modulation row
    backend: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


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
    def from_stock(cls, block, config: FastTransformerConfig, device) -> "FastBlock":
        """From a diffusers QwenImageTransformerBlock; its img_mod / txt_mod modules are shared (moved to device)."""
        attn = block.attn
        with torch.device("meta"):
            fast = cls(block.dim, attn.heads, attn.inner_dim // attn.heads, config, attn.norm_q.eps)
        fast.img_mod, fast.txt_mod = block.img_mod.to(device), block.txt_mod.to(device)
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

    def forward(self, img: torch.Tensor, txt: torch.Tensor, img_tail: Tail | None, txt_tail: Tail | None,
                joint: JointInputs, text_out: bool = True):
        """img [B, L_img, D], txt [B, L_txt, D]: the residual streams before the previous block's tails are added.
        Returns (img, txt, img_tail, txt_tail) in the same form. text_out=False (the last block) skips the text
        stream's output projection and MLP, whose result diffusers discards."""
        batch, img_len, dim = img.shape
        txt_len, fp8 = txt.shape[1], self.config.is_fp8
        im = StreamMods(self.img_mod[1](joint.silu_temb))  # [G, 6D]
        tm = StreamMods(self.txt_mod[1](joint.silu_temb_t))  # [B, 6D]
        img, img_x = head(img, img_tail, im.shift1, im.scale1, joint.mod_row, fp8("img_qkv"))
        txt, txt_x = head(txt, txt_tail, tm.shift1, tm.scale1, None, fp8("txt_qkv"))
        q, k, v = joint.q, joint.k, joint.v
        qkv_pack(self.img_qkv(img_x).view(batch, img_len, -1), self.norm_q, self.norm_k, joint.img_freqs, q, k, v, 0,
                 eps=self.eps)
        qkv_pack(self.txt_qkv(txt_x).view(batch, txt_len, -1), self.norm_added_q, self.norm_added_k,
                 joint.txt_freqs, q, k, v, img_len, eps=self.eps)
        o = joint_attention(q, k, v, joint.mask, joint.backend)  # [B, S, H, D]
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
    **{name: LORA_ADVICE for name in (
        "load_lora_adapter", "add_adapter", "set_adapter", "set_adapters", "fuse_lora", "unfuse_lora", "unload_lora",
        "disable_lora", "enable_lora", "delete_adapters", "enable_adapters", "disable_adapters",
        "enable_lora_hotswap", "save_lora_adapter")},
}


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
        self.requires_grad_(False)
        self._mod_rows: dict = {}

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
    def from_diffusers(cls, stock, config: FastTransformerConfig | None = None, device=None):
        """stock: a diffusers QwenImageTransformer2DModel (any device; left unchanged except that the modules shared
        with this model (embedders, img_mod/txt_mod, norm_out, proj_out) move to `device`). Block by block, so at
        most one block's BF16 linears sit on the device beside the converted ones."""
        if not isinstance(stock, QwenImageTransformer2DModel):
            raise TypeError(f"from_diffusers takes a diffusers QwenImageTransformer2DModel, got {type(stock).__name__}")
        lora = unmerged_lora_modules(stock)
        if lora:
            raise ValueError(f"the transformer has LoRA adapters that are not fused into its weights (e.g. {lora[0]}); "
                             f"converting would drop them. {LORA_ADVICE}")
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
            fast.transformer_blocks[i] = FastBlock.from_stock(block, config, device)
        return fast.requires_grad_(False).eval()

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
        raises), so nothing to switch."""
        yield

    @property
    def attn_processors(self):
        raise NotImplementedError(f"FastQwenImageTransformer.attn_processors: {ATTENTION_ADVICE}")

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
            raise NotImplementedError(f"attention_kwargs={attention_kwargs!r}: {LORA_ADVICE}")
        device = hidden_states.device
        check_triton_runs_on(device)
        hidden_states = self.img_in(hidden_states)  # [B, L_img, D]
        timestep = timestep.to(hidden_states.dtype)
        batch, img_len, _ = hidden_states.shape
        mod_row = None
        if self.zero_cond_t:
            timestep = torch.cat([timestep, timestep * 0], dim=0)
            mod_row = self._mod_row(img_shapes, batch, device)
        encoder_hidden_states = self.txt_in(self.txt_norm(encoder_hidden_states))  # [B, L_txt, D]
        txt_len = encoder_hidden_states.shape[1]

        if guidance is not None:
            guidance = guidance.to(hidden_states.dtype) * 1000
        temb = (
            self.time_text_embed(timestep, hidden_states, additional_t_cond)
            if guidance is None
            else self.time_text_embed(timestep, guidance, hidden_states, additional_t_cond)
        )  # [G, D]
        img_freqs, txt_freqs = self.pos_embed(img_shapes, max_txt_seq_len=txt_len, device=device)
        silu_temb = F.silu(temb)
        block0 = self.transformer_blocks[0]
        joint = JointInputs(
            img_len=img_len, txt_len=txt_len,
            mask=None if encoder_hidden_states_mask is None else TextMask(encoder_hidden_states_mask, img_len),
            img_freqs=torch.view_as_real(img_freqs), txt_freqs=torch.view_as_real(txt_freqs),
            silu_temb=silu_temb, silu_temb_t=silu_temb.chunk(2, dim=0)[0] if self.zero_cond_t else silu_temb,
            mod_row=mod_row, backend=resolve_backend(self.fast_config.attention, device, hidden_states.dtype),
            **{name: hidden_states.new_empty(batch, img_len + txt_len, block0.heads, block0.head_dim)
               for name in ("q", "k", "v")},
        )

        img, txt, img_tail, txt_tail = hidden_states, encoder_hidden_states, None, None
        n_blocks = len(self.transformer_blocks)
        for i, block in enumerate(self.transformer_blocks):
            img, txt, img_tail, txt_tail = block(img, txt, img_tail, txt_tail, joint, text_out=i < n_blocks - 1)
            if controlnet_block_samples is not None:  # added after the block's residual, as diffusers does
                img = add_tail(img, img_tail, mod_row) + controlnet_block_samples[i // -(-n_blocks //
                                                                                       len(controlnet_block_samples))]
                img_tail = None

        out_scale, out_shift = self.norm_out.linear(joint.silu_temb_t).chunk(2, dim=1)  # [B, D] each
        if img_tail is not None and mod_row is None:  # last residual fused with norm_out's LayerNorm + modulation
            img, img_x = residual_gate_layer_norm_modulate(img, img_tail.out, img_tail.gate, out_shift, out_scale)
        else:  # norm_out modulates per sample, a zero_cond_t gate per token
            img_x = layer_norm_modulate(add_tail(img, img_tail, mod_row), out_shift, out_scale)
        output = self.proj_out(img_x)  # [B, L_img, p*p*C]
        if not return_dict:
            return (output,)
        return Transformer2DModelOutput(sample=output)


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
