"""What the fast VAEs' image decodes share (vae_2d_decode): Qwen-Image-2512's (qwen_image/model/vae.py, over
diffusers' AutoencoderKLQwenImage) and Qwen-Image-2.1's (qwen_image21/vae.py, over AutoencoderKLQwenImage21).

Both decoders are Wan's video decoder: RMS channel norms, SiLU, causal convolutions that keep a copy of each
activation for the next frame. For an image (one latent frame) each leaf's decode_image runs the same modules as
plain 2D convolutions on [B, C, H, W], every norm and its SiLU as one kernel (kernels/channel_norm.py), and no frame
cache. Here: the class marker and the checks of when that computes what stock's _decode computes, the conversion
between the stock and the fast class, and what the two decoders have alike in 2D (a residual block, the way in
through the middle block, the way out); each leaf's `conv` runs its convolution class as a 2D one, and its up blocks
are its own.
"""

import copy
from collections import OrderedDict
from typing import Callable

import torch
import torch.nn as nn
from diffusers.models.autoencoders.vae import DecoderOutput

from ....kernels._utils import FLOAT_DTYPES, INTERPRETED
from ....kernels.channel_norm import channel_norm, channel_norm_ref
from ..runtime.context import record
from ..runtime.offload import has_offload_hooks


class Decodes2D:
    """The fast VAE classes' base, before diffusers' class (FastAutoencoderKLQwenImage, FastAutoencoderKLQwenImage21):
    _decode runs an image through the leaf's decode_image_2d wherever decodes_2d holds, and records that it did
    (applied: vae_2d_decode); stock's _decode otherwise (video, tiles, offload hooks)."""

    def decode_image_2d(self, latents: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _decode(self, z: torch.Tensor, return_dict: bool = True):
        if not decodes_2d(self, z):
            return super()._decode(z, return_dict=return_dict)
        record("vae_2d_decode")
        image = self.decode_image_2d(z)
        return DecoderOutput(sample=image) if return_dict else (image,)


def why_not_2d(vae) -> str | None:
    """Why the VAE's image decodes would not run as 2D convolutions (None: they do where the latents allow it)."""
    if vae is None:
        return "the pipeline has no VAE"
    if not isinstance(vae, Decodes2D):
        return f"the VAE is a {type(vae).__name__}, not a converted one (FastConfig.vae_2d_decode)"
    if any(m.training and m.p != 0 for m in vae.decoder.modules() if isinstance(m, nn.Dropout)):
        return "the VAE is in training mode with dropout (the 2D decode has none)"
    if has_offload_hooks(vae):
        return "offload hooks move the VAE's weights inside its forward, which the 2D decode does not call"
    return None


def decodes_2d(vae, latents: torch.Tensor) -> bool:
    """Whether the 2D decode gives what stock's _decode gives for these latents [B, z, frames, h, w]: one frame, not
    tiled (stock tiles only latents beyond a tile), weights on the latents' device, and why_not_2d says nothing."""
    tile = (vae.tile_sample_min_height // vae.spatial_compression_ratio,
            vae.tile_sample_min_width // vae.spatial_compression_ratio)
    tiled = vae.use_tiling and (latents.shape[-2] > tile[0] or latents.shape[-1] > tile[1])
    return (latents.ndim == 5 and latents.shape[2] == 1 and not tiled
            and vae.post_quant_conv.weight.device == latents.device and why_not_2d(vae) is None)


def as_vae_class(vae, cls: type):
    """`vae` as an instance of cls (the stock or the fast class of the same VAE): a second module over the same
    submodules and weights, as diffusers' pipelines share their components (.to() and weight changes through
    either reach both), with the same config and settings (enable_tiling's); its own registries, so a module or a
    hook registered on one of the two later is not on the other."""
    converted = cls.__new__(cls)
    converted.__dict__.update({name: copy.copy(value) if type(value) in (dict, OrderedDict) else value
                               for name, value in vae.__dict__.items()})
    return converted


def norm_activation(x: torch.Tensor, norm: nn.Module, nonlinearity: nn.Module) -> torch.Tensor:
    """nonlinearity(norm(x)) on [B, C, H, W]: with SiLU (the decoders') in fp32 / fp16 / bf16, one kernel where
    Triton runs (kernels/channel_norm.py), else its reference, upstream's ops (a CPU without the interpreter, fp64)."""
    if isinstance(nonlinearity, nn.SiLU) and x.dtype in FLOAT_DTYPES and (x.is_cuda or INTERPRETED):
        return channel_norm(x.contiguous(), norm.gamma, norm.scale, norm.bias, silu=True)
    return nonlinearity(channel_norm_ref(x, norm.gamma, norm.scale, norm.bias))


def residual(x: torch.Tensor, block: nn.Module, conv: Callable[[torch.Tensor, nn.Module], torch.Tensor]
             ) -> torch.Tensor:
    """A decoder residual block (QwenImageResidualBlock, QwenImage21ResidualBlock) on [B, C, H, W], `conv` running
    its convolutions as 2D ones (its dropout does nothing: why_not_2d)."""
    h = x if isinstance(block.conv_shortcut, nn.Identity) else conv(x, block.conv_shortcut)
    x = conv(norm_activation(x, block.norm1, block.nonlinearity), block.conv1)
    x = conv(norm_activation(x, block.norm2, block.nonlinearity), block.conv2)
    return x + h


def into_decoder(vae, latents: torch.Tensor, conv: Callable[[torch.Tensor, nn.Module], torch.Tensor]
                 ) -> torch.Tensor:
    """The first frame of latents [B, z, frames, h, w] through post_quant_conv, the decoder's conv_in and its middle
    block (a residual block, then attention and residual block pairs): [B, C, h, w]."""
    decoder = vae.decoder
    x = conv(latents[:, :, 0], vae.post_quant_conv)
    x = conv(x, decoder.conv_in)
    mid = decoder.mid_block
    x = residual(x, mid.resnets[0], conv)
    for attention, resnet in zip(mid.attentions, mid.resnets[1:]):
        if attention is not None:
            x = attention(x.unsqueeze(2)).squeeze(2)  # it reshapes 5D to 2D itself
        x = residual(x, resnet, conv)
    return x


def out_of_decoder(x: torch.Tensor, decoder: nn.Module, conv: Callable[[torch.Tensor, nn.Module], torch.Tensor]
                   ) -> torch.Tensor:
    """The decoder's head on [B, C, H, W]: norm_out and SiLU, conv_out; [B, C_out, 1, H, W] (one frame)."""
    return conv(norm_activation(x, decoder.norm_out, decoder.nonlinearity), decoder.conv_out).unsqueeze(2)
