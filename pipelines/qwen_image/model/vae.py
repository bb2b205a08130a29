"""One image through Qwen-Image's VAE decoder as 2D convolutions, with the stock module's weights.

diffusers' AutoencoderKLQwenImage decodes video frame by frame with causal 3D convolutions: the first frame has no
cache, so every 3x3x3 convolution sees it after two frames of zeros, and only its last temporal tap contributes.
For an image (one latent frame) the stock decoder therefore runs each convolution on a 3x longer padded input,
multiplies zeros by two thirds of its weights, and keeps a copy of each activation for a next frame that never
comes. decode_image runs the same modules as 2D convolutions on [B, C, H, W] with each kernel's last temporal tap
(the "upsample3d" time convolution is skipped for a first frame in stock too): the same products, summed without
the zero terms. FastAutoencoderKLQwenImage is the stock VAE (same weights, config and methods) whose decode does this
wherever it gives what stock's gives (FastConfig.vae_2d_decode).
"""

import copy
from collections import OrderedDict

import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers import AutoencoderKLQwenImage, ModelMixin  # noqa: F401 (ModelMixin: see FastAutoencoderKLQwenImage)
from diffusers.models.autoencoders.autoencoder_kl_qwenimage import QwenImageCausalConv3d
from diffusers.models.autoencoders.vae import DecoderOutput

from ....kernels._utils import FLOAT_DTYPES, INTERPRETED
from ....kernels.channel_norm import channel_norm, channel_norm_ref
from ...core.runtime.context import record
from ...core.runtime.offload import has_offload_hooks

def why_not_2d(vae) -> str | None:
    """Why the VAE's image decodes would not run as 2D convolutions (None: they do where the latents allow it)."""
    if not isinstance(vae, FastAutoencoderKLQwenImage):
        return f"the VAE is a {type(vae).__name__}, not the converted AutoencoderKLQwenImage"
    if any(m.training and m.p != 0 for m in vae.decoder.modules() if isinstance(m, nn.Dropout)):
        return "the VAE is in training mode with dropout (decode_image has none)"
    if has_offload_hooks(vae):
        return "offload hooks move the VAE's weights inside its forward, which the 2D decode does not call"
    return None


def decodes_2d(vae, latents: torch.Tensor) -> bool:
    """Whether decode_image gives what stock's _decode gives for these latents [B, z, frames, h, w]: one frame, not
    tiled (stock tiles only latents beyond a tile), weights on the latents' device, and why_not_2d says nothing."""
    tile = (vae.tile_sample_min_height // vae.spatial_compression_ratio,
            vae.tile_sample_min_width // vae.spatial_compression_ratio)
    tiled = vae.use_tiling and (latents.shape[-2] > tile[0] or latents.shape[-1] > tile[1])
    return (latents.ndim == 5 and latents.shape[2] == 1 and not tiled
            and vae.post_quant_conv.weight.device == latents.device and why_not_2d(vae) is None)


def as_vae_class(vae: AutoencoderKLQwenImage, cls: type) -> AutoencoderKLQwenImage:
    """`vae` as an instance of cls (AutoencoderKLQwenImage or FastAutoencoderKLQwenImage): a second module over the
    same submodules and weights, as diffusers' pipelines share their components (.to() and weight changes through
    either reach both), with the same config and settings (enable_tiling's); its own registries, so a module or a
    hook registered on one of the two later is not on the other."""
    converted = cls.__new__(cls)
    converted.__dict__.update({name: copy.copy(value) if type(value) in (dict, OrderedDict) else value
                               for name, value in vae.__dict__.items()})
    return converted


class FastAutoencoderKLQwenImage(AutoencoderKLQwenImage):
    """diffusers' AutoencoderKLQwenImage whose decode runs an image as 2D convolutions (decode_image) wherever
    decodes_2d holds, and stock's decode otherwise (video, tiles, offload hooks); a pipeline call records when it
    did (applied: vae_2d_decode). A saved fast pipeline names this class in model_index.json; diffusers' loader
    looks for ModelMixin in the module that defines it, to know how to load it (hence that import here)."""

    def _decode(self, z: torch.Tensor, return_dict: bool = True):
        if not decodes_2d(self, z):
            return super()._decode(z, return_dict=return_dict)
        record("vae_2d_decode")
        image = decode_image(self, z)
        return DecoderOutput(sample=image) if return_dict else (image,)


def conv(x: torch.Tensor, layer: QwenImageCausalConv3d) -> torch.Tensor:
    """A causal 3D convolution of a first frame: its last temporal tap as a 2D convolution, same spatial padding."""
    w_pad, h_pad = layer._padding[0], layer._padding[2]  # F.pad order: (W, W, H, H, T front, T back)
    return F.conv2d(x, layer.weight[:, :, -1], layer.bias, stride=layer.stride[1:], padding=(h_pad, w_pad))


def norm_activation(x: torch.Tensor, norm: nn.Module, nonlinearity: nn.Module) -> torch.Tensor:
    """nonlinearity(norm(x)) on [B, C, H, W]: with SiLU (the decoder's) in fp32 / fp16 / bf16, one kernel where
    Triton runs (kernels/channel_norm.py), else its reference, upstream's ops (a CPU without the interpreter, fp64)."""
    if isinstance(nonlinearity, nn.SiLU) and x.dtype in FLOAT_DTYPES and (x.is_cuda or INTERPRETED):
        return channel_norm(x.contiguous(), norm.gamma, norm.scale, norm.bias, silu=True)
    return nonlinearity(channel_norm_ref(x, norm.gamma, norm.scale, norm.bias))


def residual(x: torch.Tensor, block: nn.Module) -> torch.Tensor:
    """QwenImageResidualBlock (its dropout does nothing: why_not_2d)."""
    h = x if isinstance(block.conv_shortcut, nn.Identity) else conv(x, block.conv_shortcut)
    x = conv(norm_activation(x, block.norm1, block.nonlinearity), block.conv1)
    x = conv(norm_activation(x, block.norm2, block.nonlinearity), block.conv2)
    return x + h


@torch.no_grad()
def decode_image(vae, latents: torch.Tensor) -> torch.Tensor:
    """vae._decode(latents).sample for latents [B, z, 1, h, w] (decodes_2d): [B, 3, 1, H, W] in [-1, 1]."""
    decoder = vae.decoder
    x = conv(latents[:, :, 0], vae.post_quant_conv)
    x = conv(x, decoder.conv_in)
    mid = decoder.mid_block
    x = residual(x, mid.resnets[0])
    for attention, resnet in zip(mid.attentions, mid.resnets[1:]):
        x = residual(attention(x.unsqueeze(2)).squeeze(2), resnet)  # the attention block reshapes 5D to 2D itself
    for up_block in decoder.up_blocks:
        for resnet in up_block.resnets:
            x = residual(x, resnet)
        if up_block.upsamplers is not None:
            x = up_block.upsamplers[0].resample(x)  # nearest-exact 2x in fp32, then a 2D convolution
    x = conv(norm_activation(x, decoder.norm_out, decoder.nonlinearity), decoder.conv_out)
    return x.clamp(-1.0, 1.0).unsqueeze(2)
