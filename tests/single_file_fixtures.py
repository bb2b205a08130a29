"""Single checkpoint files as the tests write them (pipelines/core/single_file/writers.py names the tools whose rules
it follows): what a file means computed from its raw tensors, ComfyUI's Wan-layout VAE keys and legacy text-encoder
keys, and a tiny pipeline written as ComfyUI's three files (tests/pipelines/test_single_file.py,
tests/server/test_serve_files.py)."""

import re
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from qwen_image_fast.pipelines.core.single_file import writers
from qwen_image_fast.pipelines.core.single_file.formats import COMFY_PREFIX

# widths of whole Q8_0 / Q4_0 blocks (32), so the GGUF fixtures quantize every block weight, as at the real sizes
CONFIG = dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
              joint_attention_dim=16, axes_dims_rope=(8, 4, 4))


def meaning(path) -> dict[str, torch.Tensor]:
    """What a file means, in fp32, computed here from the raw file (safetensors: codes x scale_weight /
    weight_scale; GGUF: gguf's own dequantization), for the stock reference."""
    if str(path).endswith(".gguf"):
        import gguf

        reader = gguf.GGUFReader(path)
        return {t.name: torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
                .reshape(tuple(int(d) for d in reversed(t.shape))) for t in reader.tensors}
    raw = {k.removeprefix(COMFY_PREFIX): v for k, v in load_file(path).items()}
    out = {}
    for name, t in raw.items():
        if name.endswith((".scale_weight", ".weight_scale", ".scale_input", ".comfy_quant")) or name == "scaled_fp8":
            continue
        layer = name.removesuffix(".weight")
        scale = raw.get(f"{layer}.scale_weight", raw.get(f"{layer}.weight_scale", torch.ones(())))
        out[name] = t.float() * scale.float() if t.dtype == torch.float8_e4m3fn else t.float()
    return out



# A Qwen-Image VAE with the real block structure (4 stages, 2 residual blocks: diffusers' Wan-layout converter
# counts its blocks so), tiny widths
WAN_STRUCTURE_VAE = dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                         temperal_downsample=[False, True, True], latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
RESIDUAL = {"norm1.gamma": "residual.0.gamma", "conv1": "residual.2", "norm2.gamma": "residual.3.gamma",
            "conv2": "residual.6", "conv_shortcut": "shortcut"}


def wan_key(key: str) -> str:
    """A diffusers AutoencoderKLQwenImage key in ComfyUI's Wan-2.1 layout: the inverse of diffusers'
    convert_wan_vae_to_diffusers (the fixture checks the round trip)."""

    def residual(rest):
        part = next(d for d in RESIDUAL if rest == d or rest.startswith(d + "."))
        return RESIDUAL[part] + rest[len(part):]

    fixed = {"quant_conv": "conv1", "post_quant_conv": "conv2", "encoder.conv_in": "encoder.conv1",
             "decoder.conv_in": "decoder.conv1", "encoder.norm_out.gamma": "encoder.head.0.gamma",
             "decoder.norm_out.gamma": "decoder.head.0.gamma", "encoder.conv_out": "encoder.head.2",
             "decoder.conv_out": "decoder.head.2"}
    for d, w in fixed.items():
        if key == d or key.startswith(d + "."):
            return w + key[len(d):]
    rules = ((r"(encoder|decoder)\.mid_block\.resnets\.(\d)\.(.+)", lambda m: f"{m[1]}.middle.{2 * int(m[2])}."
              f"{residual(m[3])}"),
             (r"(encoder|decoder)\.mid_block\.attentions\.0\.(.+)", lambda m: f"{m[1]}.middle.1.{m[2]}"),
             (r"encoder\.down_blocks\.(\d+)\.(resample|time_conv)(.*)", lambda m: f"encoder.downsamples.{m[1]}.{m[2]}"
              f"{m[3]}"),
             (r"encoder\.down_blocks\.(\d+)\.(.+)", lambda m: f"encoder.downsamples.{m[1]}.{residual(m[2])}"),
             (r"decoder\.up_blocks\.(\d+)\.upsamplers\.0\.(.+)", lambda m: f"decoder.upsamples.{4 * int(m[1]) + 3}."
              f"{m[2]}"),
             (r"decoder\.up_blocks\.1\.resnets\.0\.conv_shortcut\.(.+)", lambda m: f"decoder.upsamples.4.shortcut."
              f"{m[1]}"),
             (r"decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(.+)", lambda m: f"decoder.upsamples."
              f"{4 * int(m[1]) + int(m[2])}.{residual(m[3])}"))
    for pattern, wan in rules:
        if m := re.fullmatch(pattern, key):
            return wan(m)
    raise KeyError(key)


def legacy_text_encoder_key(key: str) -> str:
    """transformers 5's Qwen2.5-VL key in the legacy layout ComfyUI's text encoder files keep."""
    return key.replace("model.language_model.", "model.", 1).replace("model.visual.", "visual.", 1)


def write_comfy_files(root: Path) -> dict:
    """A tiny pipeline as ComfyUI's three files under root (scaled-FP8 transformer and text encoder without lm_head,
    a Wan-layout VAE), a base folder with its configs and tokenizer only, and the stock pipeline holding what the
    files mean (`stock`)."""
    from diffusers import QwenImagePipeline
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    from qwen_image_fast.pipelines.tiny import tiny_components

    stock = QwenImagePipeline(**tiny_components(transformer_config={k: CONFIG[k] for k in (
        "num_attention_heads",)}, vae_config=WAN_STRUCTURE_VAE))
    stock.save_pretrained(root / "base")
    for part in ("transformer", "text_encoder", "vae"):
        for weights in (root / "base" / part).glob("*.safetensors"):
            weights.unlink()
    transformer = writers.write(stock.transformer.state_dict(), root / "transformer.safetensors",
                                "comfyui_scaled_fp8")
    te_state = {legacy_text_encoder_key(k): v for k, v in stock.text_encoder.state_dict().items()
                if k != "lm_head.weight"}
    text_encoder = writers.write(te_state, root / "text_encoder.safetensors", "comfyui_scaled_fp8", prefix="",
                                 quantized=lambda name, t: t.dim() == 2 and ".layers." in name)
    vae_state = {wan_key(k): v.contiguous() for k, v in stock.vae.state_dict().items()}
    assert set(convert_wan_vae_to_diffusers(dict(vae_state))) == set(stock.vae.state_dict())
    save_file(vae_state, root / "vae.safetensors")
    stock.transformer.load_state_dict(meaning(transformer))
    te_meaning = meaning(text_encoder)
    stock.text_encoder.load_state_dict({k: te_meaning[legacy_text_encoder_key(k)] for k in
                                        stock.text_encoder.state_dict() if k != "lm_head.weight"}, strict=False)
    return dict(base=root / "base", transformer=transformer, text_encoder=text_encoder, vae=root / "vae.safetensors",
                stock=stock)


