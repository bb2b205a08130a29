"""The Qwen-Image pipelines' other components from single files, with their configs from a diffusers folder (or hub
id) that holds the configs and tokenizer: the VAE (ComfyUI's Wan-2.1 layout, read through diffusers' own
convert_wan_vae_to_diffusers, or diffusers' layout) and the Qwen2.5-VL text encoder (ComfyUI's legacy Hugging Face
layout `model.layers.*` / `visual.*`, or transformers' own; FP8 and scaled-FP8 tensors dequantized: the text encoder
runs in its dtype)."""

import json
import logging
import re

import torch
from accelerate import init_empty_weights

from ..core.hub import local_folder
from ..core.single_file.formats import CheckpointFile, CheckpointFileError

logger = logging.getLogger(__name__)
WAN_VAE_KEY = "decoder.middle.0.residual.0.gamma"  # ComfyUI's Wan-2.1-layout VAE (comfy/sd.py detects it so)
# transformers' Qwen2-VL key renames (transformers/conversion_mapping.py): the legacy layout ComfyUI's files keep
TEXT_ENCODER_RENAMES = ((re.compile(r"^visual\."), "model.visual."),
                        (re.compile(r"^model\.(?!language_model\.|visual\.)"), "model.language_model."))


def _config(base, subfolder: str) -> dict:
    return json.loads((local_folder(base, subfolder) / "config.json").read_text())


def _values(file: CheckpointFile, dtype: torch.dtype, rename=lambda name: name) -> tuple[dict, set]:
    """Every tensor of the file as it means it, in dtype (quantized ones dequantized: their sources returned)."""
    state, dequantized = {}, set()
    for name in file.names:
        stored = file.get(name)
        if stored.quantized:
            dequantized.add(stored.source)
        state[rename(name)] = stored.value(dtype) if stored.values.is_floating_point() else stored.values
    return state, dequantized


def _load_strict(model, state: dict, path, what: str):
    expected = model.state_dict()
    missing = [k for k in expected if k not in state]
    unknown = [k for k in state if k not in expected]
    if missing:
        raise CheckpointFileError(f"{path}: missing '{missing[0]}' ({len(missing)} of the {what}'s tensors missing)")
    if unknown:
        raise CheckpointFileError(f"{path}: unknown key '{unknown[0]}' ({len(unknown)} tensors the {what} does not "
                                  "have)")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointFileError(f"{path}: '{name}' has shape {tuple(tensor.shape)}; the {what}'s is "
                                      f"{tuple(expected[name].shape)} (a file of another size)")
    model.load_state_dict(state, strict=True, assign=True)
    return model


def vae_from_file(path, base, dtype: torch.dtype):
    """AutoencoderKLQwenImage with base's vae/config.json, weights from `path`."""
    from diffusers import AutoencoderKLQwenImage
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    file = CheckpointFile(path)
    state, dequantized = _values(file, dtype)
    if WAN_VAE_KEY in state:
        state = convert_wan_vae_to_diffusers(state)
    elif "decoder.mid_block.resnets.0.norm1.gamma" not in state:
        raise CheckpointFileError(f"{path} is not a Qwen-Image VAE file: it has neither {WAN_VAE_KEY} (ComfyUI) nor "
                                  "decoder.mid_block.resnets.0.norm1.gamma (diffusers)")
    with init_empty_weights(include_buffers=False):  # weights on the meta device, computed buffers real
        vae = AutoencoderKLQwenImage.from_config(_config(base, "vae"))
    if dequantized:
        logger.warning("%s: the VAE's %s tensors dequantized to %s", path, ", ".join(sorted(dequantized)), dtype)
    return _load_strict(vae, state, path, "VAE").eval()


def text_encoder_from_file(path, base, dtype: torch.dtype):
    """Qwen2_5_VLForConditionalGeneration with base's text_encoder/config.json, weights from `path`. A file without
    lm_head (ComfyUI's: its encoders read hidden states, as the Qwen-Image pipelines do) gets zeros there, with a
    warning: the pipelines never use its logits; generate() with it would."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    file = CheckpointFile(path)
    if "model.layers.0.self_attn.q_proj.weight" not in file.names and \
            "model.language_model.layers.0.self_attn.q_proj.weight" not in file.names:
        raise CheckpointFileError(f"{path} is not a Qwen2.5-VL text encoder file: it has no "
                                  "model.layers.0.self_attn.q_proj.weight")

    def rename(name: str) -> str:
        for pattern, replacement in TEXT_ENCODER_RENAMES:
            name = pattern.sub(replacement, name)
        return name

    state, dequantized = _values(file, dtype, rename)
    config = Qwen2_5_VLConfig.from_dict(_config(base, "text_encoder"))
    with init_empty_weights(include_buffers=False):  # weights on the meta device, rotary tables computed
        encoder = Qwen2_5_VLForConditionalGeneration(config)
    if "lm_head.weight" not in state:
        if config.tie_word_embeddings:
            state["lm_head.weight"] = state["model.language_model.embed_tokens.weight"]
        else:
            logger.warning("%s has no lm_head: zeros (the pipelines read the text encoder's hidden states only)", path)
            state["lm_head.weight"] = torch.zeros(encoder.lm_head.weight.shape, dtype=dtype)
    if dequantized:
        logger.warning("%s: the text encoder's %s tensors dequantized to %s", path, ", ".join(sorted(dequantized)),
                       dtype)
    encoder = _load_strict(encoder, state, path, "text encoder")
    encoder.tie_weights()
    return encoder.eval()
