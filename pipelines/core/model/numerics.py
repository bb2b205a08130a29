"""Numerics diffusers' Qwen-Image blocks share (2512's and 2.1's)."""

import torch


def clip_float16(x: torch.Tensor) -> torch.Tensor:
    """diffusers' block clips its float16 outputs to the finite range (+-65504); other dtypes pass as they are."""
    return x.clip(-65504, 65504) if x.dtype == torch.float16 else x
