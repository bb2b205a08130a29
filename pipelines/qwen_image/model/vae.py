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

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKLQwenImage, ModelMixin  # noqa: F401 (ModelMixin: see FastAutoencoderKLQwenImage)
from diffusers.models.autoencoders.autoencoder_kl_qwenimage import QwenImageCausalConv3d

from ...core.model.vae_2d import Decodes2D, into_decoder, out_of_decoder, residual


class FastAutoencoderKLQwenImage(Decodes2D, AutoencoderKLQwenImage):
    """diffusers' AutoencoderKLQwenImage whose decode runs an image as 2D convolutions (decode_image) wherever
    decodes_2d holds, and stock's decode otherwise (video, tiles, offload hooks); a pipeline call records when it
    did (applied: vae_2d_decode). A saved fast pipeline names this class in model_index.json; diffusers' loader
    looks for ModelMixin in the module that defines it, to know how to load it (hence that import here)."""

    def decode_image_2d(self, latents: torch.Tensor) -> torch.Tensor:
        return decode_image(self, latents)


def conv(x: torch.Tensor, layer: QwenImageCausalConv3d) -> torch.Tensor:
    """A causal 3D convolution of a first frame: its last temporal tap as a 2D convolution, same spatial padding."""
    w_pad, h_pad = layer._padding[0], layer._padding[2]  # F.pad order: (W, W, H, H, T front, T back)
    return F.conv2d(x, layer.weight[:, :, -1], layer.bias, stride=layer.stride[1:], padding=(h_pad, w_pad))


@torch.no_grad()
def decode_image(vae, latents: torch.Tensor) -> torch.Tensor:
    """vae._decode(latents).sample for latents [B, z, 1, h, w] (decodes_2d): [B, 3, 1, H, W] in [-1, 1]."""
    x = into_decoder(vae, latents, conv)
    for up_block in vae.decoder.up_blocks:
        for resnet in up_block.resnets:
            x = residual(x, resnet, conv)
        if up_block.upsamplers is not None:
            x = up_block.upsamplers[0].resample(x)  # nearest-exact 2x in fp32, then a 2D convolution
    return out_of_decoder(x, vae.decoder, conv).clamp(-1.0, 1.0)
