"""One image through Qwen-Image's VAE decoder as 2D convolutions, with the stock module's weights.

diffusers' AutoencoderKLQwenImage decodes video frame by frame with causal 3D convolutions: the first frame has no
cache, so every 3x3x3 convolution sees it after two frames of zeros, and only its last temporal tap contributes.
For an image (one latent frame) the stock decoder therefore runs each convolution on a 3x longer padded input,
multiplies zeros by two thirds of its weights, and keeps a copy of each activation for a next frame that never
comes. decode_image runs the same modules as 2D convolutions on [B, C, H, W] with each kernel's last temporal tap
(the "upsample3d" time convolution is skipped for a first frame in stock too): the same products, summed without
the zero terms.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from diffusers import AutoencoderKLQwenImage
from diffusers.models.autoencoders.autoencoder_kl_qwenimage import QwenImageCausalConv3d


def can_decode_image(vae, latents: torch.Tensor, has_hooks: bool) -> bool:
    """Whether decode_image gives what vae.decode(latents) gives: one latent frame, a stock AutoencoderKLQwenImage
    whose dropout does nothing (eval mode or p = 0: decode_image has none), not tiling (its tiles are blended:
    another computation), no offload hooks (they move the weights in vae.decode's forward hook, which this does not
    call), weights on the latents' device."""
    dropout_off = all(not m.training or m.p == 0 for m in vae.decoder.modules() if isinstance(m, nn.Dropout))
    return (type(vae) is AutoencoderKLQwenImage and latents.ndim == 5 and latents.shape[2] == 1 and dropout_off
            and not vae.use_tiling and not has_hooks and vae.post_quant_conv.weight.device == latents.device)


def conv(x: torch.Tensor, layer: QwenImageCausalConv3d) -> torch.Tensor:
    """A causal 3D convolution of a first frame: its last temporal tap as a 2D convolution, same spatial padding."""
    w_pad, h_pad = layer._padding[0], layer._padding[2]  # F.pad order: (W, W, H, H, T front, T back)
    return F.conv2d(x, layer.weight[:, :, -1], layer.bias, stride=layer.stride[1:], padding=(h_pad, w_pad))


def rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """QwenImageRMS_norm (channel first) on [B, C, H, W], with its casts."""
    fp32 = x.dtype in (torch.float16, torch.bfloat16)
    normalized = F.normalize(x.float() if fp32 else x, dim=1).to(x.dtype)
    bias = norm.bias.view(-1, 1, 1) if isinstance(norm.bias, torch.Tensor) else norm.bias
    return normalized * norm.scale * norm.gamma.view(-1, 1, 1) + bias


def residual(x: torch.Tensor, block: nn.Module) -> torch.Tensor:
    """QwenImageResidualBlock (its dropout does nothing: can_decode_image)."""
    h = x if isinstance(block.conv_shortcut, nn.Identity) else conv(x, block.conv_shortcut)
    x = conv(block.nonlinearity(rms_norm(x, block.norm1)), block.conv1)
    x = conv(block.nonlinearity(rms_norm(x, block.norm2)), block.conv2)
    return x + h


@torch.no_grad()
def decode_image(vae, latents: torch.Tensor) -> torch.Tensor:
    """vae.decode(latents).sample for latents [B, z, 1, h, w] (can_decode_image): [B, 3, 1, H, W] in [-1, 1].
    With vae.use_slicing, one sample at a time, as stock."""
    if vae.use_slicing and latents.shape[0] > 1:
        return torch.cat([decode_image(vae, z) for z in latents.split(1)])
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
    x = conv(decoder.nonlinearity(rms_norm(x, decoder.norm_out)), decoder.conv_out)
    return x.clamp(-1.0, 1.0).unsqueeze(2)
