"""Channel-first RMS normalization of images, optionally followed by SiLU, in one pass: diffusers'
`QwenImageRMS_norm(dim, channel_first=True)` and the decoder's `nonlinearity` after it, with their casts (the
decoder's norms take [B, C, T, H, W] with images=False; on one frame that is this on [B, C, H, W]):

    n = F.normalize(x.float(), dim=1).to(x.dtype)   (fp32 x: no casts)   x / max(||x||_2 over C, 1e-12)
    y = n * scale * gamma + bias                      each product and the sum rounded to x.dtype
    y = silu(y)                                       (silu=True) computed in fp32, rounded to x.dtype

on x [B, C, H, W] contiguous, gamma [C], bias [C] or 0.0 (a float), scale a float (upstream's sqrt(C)). In eager
PyTorch that is ~9 passes over the image (upcast, norm, divide, downcast, three products and sums, SiLU); here one
write and one read from memory where the tile stays in L2. A program takes BLOCK_P pixels of one image: the first
loop over the channels sums the squares, the second reloads the same [C, BLOCK_P] tile and writes it normalized.
Rows of channels are strided by H * W, so the pixels are the contiguous axis of each load.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._utils import FLOAT_DTYPES, check_tensor, new_output, round_to

EPS = 1e-12  # F.normalize's default
BLOCK_C = 16  # channels a load: [BLOCK_C, BLOCK_P] tiles
BLOCK_P = 256  # pixels a program: 512 contiguous bytes of bf16 a channel


@triton.jit
def _channel_norm_kernel(X, GAMMA, BIAS, Y, C, P, scale, eps, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                         BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr):
    pixels = tl.program_id(0).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)  # [BLOCK_P]
    image = tl.program_id(1).to(tl.int64) * C * P
    dtype = Y.dtype.element_ty
    squares = tl.zeros([BLOCK_P], dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        channels = (c0 + tl.arange(0, BLOCK_C)).to(tl.int64)  # channels * P: past int32 in a large image
        mask = (channels[:, None] < C) & (pixels[None, :] < P)
        x = tl.load(X + image + channels[:, None] * P + pixels[None, :], mask=mask, other=0.0).to(tl.float32)
        squares += tl.sum(x * x, axis=0)
    denominator = tl.maximum(tl.sqrt_rn(squares), eps)[None, :]  # [1, BLOCK_P]
    for c0 in range(0, C, BLOCK_C):
        channels = (c0 + tl.arange(0, BLOCK_C)).to(tl.int64)
        mask = (channels[:, None] < C) & (pixels[None, :] < P)
        offsets = image + channels[:, None] * P + pixels[None, :]
        x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
        gamma = tl.load(GAMMA + channels, mask=channels < C, other=0.0).to(tl.float32)[:, None]
        y = round_to(tl.div_rn(x, denominator), dtype)
        y = round_to(round_to(y * scale, dtype) * gamma, dtype)
        if HAS_BIAS:
            y = round_to(y + tl.load(BIAS + channels, mask=channels < C, other=0.0).to(tl.float32)[:, None], dtype)
        if SILU:
            y = round_to(tl.fdiv(y, 1.0 + tl.exp(-y), ieee_rounding=False), dtype)
        tl.store(Y + offsets, y.to(dtype), mask=mask)


def channel_norm(x: torch.Tensor, gamma: torch.Tensor, scale: float, bias: torch.Tensor | float = 0.0,
                 silu: bool = False) -> torch.Tensor:
    """x [B, C, H, W] contiguous; gamma [C] (or [C, 1, 1]) and a tensor bias in x's dtype; bias 0.0 adds
    nothing. Returns y [B, C, H, W] (module docstring)."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES, ndim=4)
    if not x.is_contiguous():
        raise ValueError(f"x must be contiguous [B, C, H, W], got strides {x.stride()}")
    b, c, h, w = x.shape
    gamma = gamma.reshape(-1)
    check_tensor("gamma", gamma, dtypes=(x.dtype,), shape=(c,), device=x.device)
    has_bias = isinstance(bias, torch.Tensor)
    if has_bias:
        bias = bias.reshape(-1)
        check_tensor("bias", bias, dtypes=(x.dtype,), shape=(c,), device=x.device)
    elif bias != 0.0:
        raise ValueError(f"bias={bias!r}; allowed: a tensor [C] or 0.0 (upstream's bias=False)")
    y = new_output(x.shape, x.dtype, x.device)
    if x.numel():
        _channel_norm_kernel[(triton.cdiv(h * w, BLOCK_P), b)](
            x, gamma, bias if has_bias else gamma, y, c, h * w, float(scale), EPS, HAS_BIAS=has_bias, SILU=silu,
            BLOCK_C=BLOCK_C, BLOCK_P=BLOCK_P, num_warps=4)
    return y


def channel_norm_ref(x: torch.Tensor, gamma: torch.Tensor, scale: float, bias: torch.Tensor | float = 0.0,
                     silu: bool = False) -> torch.Tensor:
    """The semantics channel_norm reproduces: QwenImageRMS_norm.forward's ops (then F.silu) on [B, C, H, W]."""
    fp32 = x.dtype in (torch.float16, torch.bfloat16)
    normalized = F.normalize(x.float() if fp32 else x, dim=1).to(x.dtype)
    if isinstance(bias, torch.Tensor):
        bias = bias.view(-1, 1, 1)
    y = normalized * scale * gamma.view(-1, 1, 1) + bias
    return F.silu(y) if silu else y
