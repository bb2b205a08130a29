"""Gated delta rule (Gated DeltaNet, Qwen3.5's linear-attention layers): pure-PyTorch references in naive.py, the
fused single-token decode kernel in decode.py, the prefill's causal conv + SiLU in conv.py. Prefill's recurrence on
the GPU uses fla's `chunk_gated_delta_rule`."""

from .conv import causal_conv1d
from .decode import gated_delta_rule_decode
from .naive import (
    causal_conv1d_ref,
    chunk_gated_delta_rule_ref,
    conv_ring,
    gated_delta_rule_decode_ref,
    l2norm_ref,
    recurrent_gated_delta_rule_ref,
    ring_window,
)

__all__ = [
    "causal_conv1d",
    "causal_conv1d_ref",
    "chunk_gated_delta_rule_ref",
    "conv_ring",
    "gated_delta_rule_decode",
    "gated_delta_rule_decode_ref",
    "l2norm_ref",
    "recurrent_gated_delta_rule_ref",
    "ring_window",
]
