"""The fast transformer's linear layer and the operands it takes: BF16 rows, or rowwise FP8 (e4m3 codes with a
per-row fp32 scale) produced by the fused kernel before it (block.py)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from ....kernels._utils import FP8_DTYPE
from ....kernels.fp8 import fp8_linear, quantize_fp8_rowwise_ref
from .lora import LoraLinear

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
