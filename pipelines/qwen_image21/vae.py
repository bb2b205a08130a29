"""One image through Qwen-Image-2.1's VAE decoder with the fused channel norm and no frame cache, with the stock
module's weights (FastConfig.vae_2d_decode; what it shares with 2512's: core/model/vae_2d.py).

diffusers' AutoencoderKLQwenImage21 is Wan 2.2's video decoder specialised to images: its convolutions are 2D
already (QwenImage21CausalConv3d is an nn.Conv2d that pads with F.pad and runs on the one frame), but it still
keeps a copy of each convolution's input in a frame cache that no second frame reads (a second frame raises), each
RMS norm is ~9 eager passes (fp32 upcast, normalize, downcast, scale, gamma, bias) with a SiLU after it, each
convolution first writes a padded copy of its input, and each residual up block clones its input. decode_image
runs the same modules on [B, C, H, W]: each norm and SiLU as one kernel, each convolution with its padding inside
(the same products: zeros pad both), no copies. The "upsample3d" time convolution is skipped for a first frame in
stock too, and its duplicated shortcut keeps the last time phase (DupUp3D's first_chunk), as stock's first frame.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers import AutoencoderKLQwenImage21, ModelMixin  # noqa: F401 (ModelMixin: see FastAutoencoderKLQwenImage21)
from diffusers.models.autoencoders.autoencoder_kl_qwenimage21 import QwenImage21ResidualUpBlock, _unpatchify

from ..core.model.vae_2d import Decodes2D, into_decoder, out_of_decoder, residual


class FastAutoencoderKLQwenImage21(Decodes2D, AutoencoderKLQwenImage21):
    """diffusers' AutoencoderKLQwenImage21 whose decode runs an image through decode_image wherever decodes_2d
    holds, and stock's decode otherwise (tiles, offload hooks, more than one frame: stock's raises); a pipeline call
    records when it did (applied: vae_2d_decode). A saved fast pipeline names this class in model_index.json;
    diffusers' loader looks for ModelMixin in the module that defines it, to know how to load it."""

    def decode_image_2d(self, latents: torch.Tensor) -> torch.Tensor:
        return decode_image(self, latents)


def conv(x: torch.Tensor, layer: nn.Conv2d) -> torch.Tensor:
    """QwenImage21CausalConv3d on [B, C, H, W]: its F.pad's zeros as the convolution's own padding."""
    w_pad, h_pad = layer._padding[0], layer._padding[2]  # F.pad order: (W, W, H, H)
    return F.conv2d(x, layer.weight, layer.bias, stride=layer.stride, padding=(h_pad, w_pad))


def up_block_2d(x: torch.Tensor, block: nn.Module) -> torch.Tensor:
    """QwenImage21ResidualUpBlock (is_residual, the default: a shortcut from the block's input, channels duplicated
    into the upsampled pixels) or QwenImage21UpBlock, on the first frame."""
    if isinstance(block, QwenImage21ResidualUpBlock):
        upsampler, shortcut = block.upsampler, block.avg_shortcut
    else:
        upsampler, shortcut = block.upsamplers[0] if block.upsamplers is not None else None, None
    skip = x
    for resnet in block.resnets:
        x = residual(x, resnet, conv)
    if upsampler is not None:
        x = upsampler.resample(x)  # nearest-exact 2x in fp32, then a 2D convolution
    if shortcut is not None:
        x = x + shortcut(skip.unsqueeze(2), first_chunk=True).squeeze(2)
    return x


@torch.no_grad()
def decode_image(vae, latents: torch.Tensor) -> torch.Tensor:
    """vae._decode(latents).sample for latents [B, z, 1, h, w] (decodes_2d): [B, C, 1, H, W] in [-1, 1]."""
    x = into_decoder(vae, latents, conv)
    for up_block in vae.decoder.up_blocks:
        x = up_block_2d(x, up_block)
    x = out_of_decoder(x, vae.decoder, conv)
    if vae.config.patch_size is not None:
        x = _unpatchify(x, patch_size=vae.config.patch_size)
    return x.clamp(-1.0, 1.0)
