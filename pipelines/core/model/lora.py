"""LoRA adapters on the fast transformer, with the semantics diffusers + peft give the stock model.

A Qwen-Image LoRA names stock modules; each is a *site* here: a row range of one of the fast model's linears.
  transformer_blocks.{i}.attn.to_q / to_k / to_v          rows [0, HD) / [HD, 2HD) / [2HD, 3HD) of img_qkv
  transformer_blocks.{i}.attn.add_q_proj / add_k / add_v  the same rows of txt_qkv
  attn.to_out.0 / attn.to_add_out, img_mlp.net.0.proj / img_mlp.net.2 (txt_ likewise)
                                                           img_out / txt_out, img_fc1 / img_fc2 (txt_fc1 / txt_fc2)
  any other nn.Linear of the stock model (img_mod.1, txt_mod.1, img_in, txt_in, proj_out, norm_out.linear, the
  timestep embedder's linear_1 / linear_2)                 the same nn.Linear here, all of its rows
A linear with adapters computes y = base(x) + (x @ D.T) @ U.T on its input rows, where D [R, K] stacks the A
factors of every adapter in effect at each of its sites and U [N, R] their B factors times peft's scaling, each in
its site's rows (zero elsewhere). An FP8 linear's input is its rowwise-FP8 operand (q, s): x @ D.T is a rowwise-FP8
GEMM of that operand and D quantized rowwise (the LoRA term's error is measured in RESULTS.md).
Unfused adapters never touch the base weights, so adapters and strengths change without requantizing anything.

State follows peft's LoRA layer (peft 0.17+ as diffusers drives it):
- scaling[a] = weight[a] * alpha[a] / r[a] (alpha / sqrt(r) with rslora); set_adapters sets weight[a] and resets
  what scale_layer multiplied; fuse_lora(lora_scale) multiplies the active adapters' scaling (peft's scale_layer)
  and keeps it; attention_kwargs={"scale": s} multiplies it for one forward (the forward context's lora_scale).
- fuse_lora freezes the adapters in effect, at their scaling then, into each site; a site with frozen adapters
  runs base + those only (peft runs the merged weight and no unmerged adapter); unfuse_lora drops them, restoring
  the base exactly; a forward while disabled unfuses first, as peft does (so a fuse_lora while disabled leaves
  nothing fused). An adapter fused is fused once (peft skips those already merged). peft unmerges at the scaling
  of the moment, so a set_adapters that changed a fused adapter's scaling would leave part of it in the weights:
  that is refused (unfuse_lora first). An FP8 linear folds its frozen adapters
  into its weight (FastLinear.fold_lora: requantized, so the fused path costs nothing per forward); a BF16 one
  keeps them as a frozen low-rank product (exact, and its weight may be shared with the stock model).
"""

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers.utils import logging

from ....kernels.fp8 import fp8_linear, quantize_fp8_rowwise_ref
from ..runtime.context import get_context
from ..runtime.cuda_graph import read_by_graph

logger = logging.get_logger(__name__)

# Stock block module -> (fast linear, which part of its rows: the parts of one linear split its rows evenly, in this
# order; None: all rows). Qwen-Image-2.1's are its model's (pipelines/qwen_image21/model.py LORA_SITES).
BLOCK_SITES = {
    "attn.to_q": ("img_qkv", 0), "attn.to_k": ("img_qkv", 1), "attn.to_v": ("img_qkv", 2),
    "attn.add_q_proj": ("txt_qkv", 0), "attn.add_k_proj": ("txt_qkv", 1), "attn.add_v_proj": ("txt_qkv", 2),
    "attn.to_out.0": ("img_out", None), "attn.to_add_out": ("txt_out", None),
    "img_mlp.net.0.proj": ("img_fc1", None), "img_mlp.net.2": ("img_fc2", None),
    "txt_mlp.net.0.proj": ("txt_fc1", None), "txt_mlp.net.2": ("txt_fc2", None),
}


def lora_scale_of(attention_kwargs: dict | None, model: str) -> float:
    """attention_kwargs["scale"] (1.0 if absent), what diffusers' apply_lora_scale multiplies the adapters by; the
    other keys are ignored with a warning, as diffusers' attention processors do."""
    attention_kwargs = dict(attention_kwargs or {})
    scale = float(attention_kwargs.pop("scale", 1.0))
    if attention_kwargs:
        logger.warning(f"attention_kwargs {sorted(attention_kwargs)} are not expected by the {model} attention and "
                       "are ignored (as diffusers does)")
    return scale


def site_of(name: str, sites: dict = BLOCK_SITES) -> tuple[str, int | None]:
    """Stock module name -> (the fast model's module name, which part of its rows or None: all), by `sites` (a
    model's map of its stock block modules, BLOCK_SITES for Qwen-Image-2512)."""
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "transformer_blocks":
        inner = ".".join(parts[2:])
        if inner in sites:
            linear, part = sites[inner]
            return f"transformer_blocks.{parts[1]}.{linear}", part
    return name, None


@dataclass
class Factors:
    """One adapter at one site: A [r, K] and B [rows, r] (buffers of the host linear's LoraLinear) and alpha / r."""

    a: str  # buffer names
    b: str
    base_scale: float


@dataclass
class LoraState:
    """The transformer's adapters: what set_adapters / enable / disable / scale change (peft keeps it per layer;
    diffusers always sets every layer alike). `version` counts changes (CUDA graphs are recaptured on a change)."""

    configs: dict = field(default_factory=dict)  # adapter -> peft LoraConfig (the model's `peft_config`)
    active: list = field(default_factory=list)
    weight: dict = field(default_factory=dict)  # adapter -> set_adapters weight
    layer_scale: dict = field(default_factory=dict)  # adapter -> product of peft scale_layer factors since then
    enabled: bool = True
    version: int = 0

    def scaling(self, adapter: str, base_scale: float) -> float:
        """peft's scaling of `adapter` times the running forward's attention_kwargs["scale"]."""
        return base_scale * self.weight[adapter] * self.layer_scale[adapter] * get_context().lora_scale


class LoraLinear(nn.Module):
    """The adapters of one fast linear (a child of it, named `lora`). sites: stock name -> (row0, row1). Factor
    tensors are non-persistent buffers (they move with .to() and offload hooks; state_dict() stays the base's)."""

    def __init__(self, sites: dict[str, tuple[int, int]], in_features: int, state: LoraState):
        super().__init__()
        self.sites, self.in_features = sites, in_features
        self.state = state
        self.factors: dict[str, dict[str, Factors]] = {site: {} for site in sites}  # site -> adapter -> factors
        self.frozen: dict[str, list[tuple[str, float]]] = {site: [] for site in sites}  # fuse_lora: (adapter, scaling)
        self.folded = False  # the frozen adapters are in the host FastLinear's weight (fold_lora)
        self._count = 0
        # (version, lora scale, dtype, device) -> packed factors. Every lora scale of the current version stays: a
        # CUDA graph captured at one scale keeps reading its tensors while another scale's run builds its own.
        self._packed: dict[tuple, tuple | None] = {}
        self._packed_fp8: dict[tuple, tuple | None] = {}

    def add(self, site: str, adapter: str, a: torch.Tensor, b: torch.Tensor, base_scale: float):
        row0, row1 = self.sites[site]
        if b.shape[0] != row1 - row0 or a.shape[1] != self.in_features or a.shape[0] != b.shape[1]:
            raise ValueError(f"LoRA {adapter!r} at {site}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit a "
                             f"[{row1 - row0}, {self.in_features}] linear")
        names = (f"a{self._count}", f"b{self._count}")
        self._count += 1
        for name, t in zip(names, (a, b)):
            self.register_buffer(name, t, persistent=False)
        self.factors[site][adapter] = Factors(*names, base_scale)

    def delete(self, adapter: str):
        for site, by_adapter in self.factors.items():
            f = by_adapter.pop(adapter, None)
            if f is not None:
                delattr(self, f.a)
                delattr(self, f.b)
        self._drop_packed()

    @property
    def adapters(self) -> set[str]:
        return {a for by_adapter in self.factors.values() for a in by_adapter}

    def in_effect(self, site: str) -> list[tuple[Factors, float]]:
        """(factors, scaling) of what this site adds now."""
        state = self.state
        if self.frozen[site]:
            return [] if self.folded else [(self.factors[site][a], s) for a, s in self.frozen[site]]
        if not state.enabled:
            return []
        return [(self.factors[site][a], state.scaling(a, self.factors[site][a].base_scale))
                for a in state.active if a in self.factors[site]]

    def freeze(self, adapters: list[str], check_finite: bool):
        """Freeze these adapters at their scaling now into each site that has them and has not frozen them yet
        (peft merges an adapter into a layer once: a second fuse_lora leaves it as it is)."""
        for site in self.sites:
            for a in adapters:
                f = self.factors[site].get(a)
                if f is None or any(name == a for name, _ in self.frozen[site]):
                    continue
                s = self.state.scaling(a, f.base_scale)
                if check_finite and not torch.isfinite(getattr(self, f.b) @ getattr(self, f.a) * s).all():
                    raise ValueError(f"NaNs detected in the fused weights of {site} (adapter {a!r}): the LoRA "
                                     "adapter seems to be broken; nothing was fused there")
                self.frozen[site].append((a, s))
        self._drop_packed()

    def unfreeze(self):
        if self.folded:
            raise RuntimeError("unfreeze while the adapters are folded into the weight: FastLinear.unfold_lora first")
        for site in self.sites:
            self.frozen[site] = []
        self._drop_packed()

    def _drop_packed(self):
        self._packed.clear()
        self._packed_fp8.clear()

    def _cached(self, store: dict, like: torch.Tensor, build):
        """store's entry for the state now and like's dtype and device, built on a miss; entries of an earlier
        version are dropped (the graphs that read them are recaptured: GraphedForward.drop_if_weights_moved)."""
        key = (self.state.version, get_context().lora_scale, like.dtype, like.device)
        if key not in store:
            if any(k[0] != key[0] for k in store):
                store.clear()
            store[key] = build()
        read_by_graph(*(store[key] or ()))  # a graph captured at this scale keeps reading them
        return store[key]

    def frozen_delta(self, n_out: int) -> torch.Tensor | None:
        """The frozen adapters' sum of scaling * B @ A, [n_out, K] fp32 (zero outside their sites' rows); None when
        nothing is frozen."""
        delta = None
        for site, (row0, row1) in self.sites.items():
            for a, scaling in self.frozen[site]:
                f = self.factors[site][a]
                down, up = getattr(self, f.a), getattr(self, f.b)
                if delta is None:
                    delta = torch.zeros(n_out, self.in_features, dtype=torch.float32, device=down.device)
                delta[row0:row1].addmm_(up.float(), down.float(), alpha=scaling)
        return delta

    def packed(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(D [R, K], U [N, R]) in like's dtype and on its device, rebuilt when the state changed or the model moved;
        None when nothing is in effect."""
        return self._cached(self._packed, like, lambda: self._pack(like.dtype))

    def _pack(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        downs, ups = [], []
        n_out = max(row1 for _, row1 in self.sites.values())
        for site, (row0, row1) in self.sites.items():
            for f, scaling in self.in_effect(site):
                a, b = getattr(self, f.a), getattr(self, f.b)
                up = b.new_zeros(n_out, b.shape[1], dtype=torch.float32)
                up[row0:row1] = b.float() * scaling
                downs.append(a)
                ups.append(up)
        return None if not downs else (torch.cat(downs).to(dtype), torch.cat(ups, dim=1).to(dtype))

    def packed_fp8(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """For an FP8 host: (D rowwise e4m3 [R16, K], its scale [R16] fp32, U [N, R16] in like's dtype), R padded
        with zero rows / columns to a multiple of 16 (torch._scaled_mm's N); None when nothing is in effect."""
        def build():
            packed = self.packed(like)
            if packed is None:
                return None
            down, up = packed
            pad = -down.shape[0] % 16
            down_q, down_scale = quantize_fp8_rowwise_ref(F.pad(down, (0, 0, 0, pad)))
            return down_q, down_scale.view(-1), F.pad(up, (0, pad))

        return self._cached(self._packed_fp8, like, build)

    def forward(self, x: torch.Tensor, y: torch.Tensor, row_scale: torch.Tensor | None = None) -> torch.Tensor:
        """y [M, N] (the base output, which this adds to in place) + the low-rank terms of the input rows: x [M, K]
        in y's dtype, or an FP8 linear's operand, e4m3 rows x with row_scale [M, 1] fp32: then x @ D.T is one
        rowwise-FP8 GEMM on that operand with D quantized rowwise (no dequantized [M, K] copy)."""
        if row_scale is None:
            packed = self.packed(y)
            if packed is None:
                return y
            down, up = packed
            return y.addmm_(x @ down.t(), up.t())
        packed = self.packed_fp8(y)
        if packed is None:
            return y
        down_q, down_scale, up = packed
        t = fp8_linear(x, row_scale, down_q, down_scale, None, y.dtype)  # [M, R16]
        return y.addmm_(t, up.t())


class LoraTargetLinear(nn.Linear):
    """An nn.Linear of the fast model that carries adapters: the same weight and bias Parameters as the module it
    replaces (which the stock model may share), plus `lora`. State-dict keys are unchanged."""

    @classmethod
    def wrap(cls, linear: nn.Linear, lora: LoraLinear) -> "LoraTargetLinear":
        with torch.device("meta"):
            new = cls(1, 1)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias
        new.lora = lora
        new.original = [linear]  # a list: not registered as a submodule
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return self.lora(x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])).view(y.shape)
