"""Qwen3.5 text model (hybrid Gated-DeltaNet / gated full attention) on fused kernels, and its generation loop."""

from .generate import generate
from .model import FastQwen35ForCausalLM, HybridCache

__all__ = ["FastQwen35ForCausalLM", "HybridCache", "generate"]
