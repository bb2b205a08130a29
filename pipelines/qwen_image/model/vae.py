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
from diffusers.models.autoencoders.vae import DecoderOutput

from ...core.model.vae_2d import Decodes2D, decodes_2d, norm_activation, residual
from ...core.runtime.context import record


class FastAutoencoderKLQwenImage(Decodes2D, AutoencoderKLQwenImage):
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


@torch.no_grad()
def decode_image(vae, latents: torch.Tensor) -> torch.Tensor:
    """vae._decode(latents).sample for latents [B, z, 1, h, w] (decodes_2d): [B, 3, 1, H, W] in [-1, 1]."""
    decoder = vae.decoder
    x = conv(latents[:, :, 0], vae.post_quant_conv)
    x = conv(x, decoder.conv_in)
    mid = decoder.mid_block
    x = residual(x, mid.resnets[0], conv)
    for attention, resnet in zip(mid.attentions, mid.resnets[1:]):
        x = residual(attention(x.unsqueeze(2)).squeeze(2), resnet, conv)  # the attention reshapes 5D to 2D itself
    for up_block in decoder.up_blocks:
        for resnet in up_block.resnets:
            x = residual(x, resnet, conv)
        if up_block.upsamplers is not None:
            x = up_block.upsamplers[0].resample(x)  # nearest-exact 2x in fp32, then a 2D convolution
    x = conv(norm_activation(x, decoder.norm_out, decoder.nonlinearity), decoder.conv_out)
    return x.clamp(-1.0, 1.0).unsqueeze(2)
