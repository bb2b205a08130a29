"""A tiny random-weight Qwen-Image pipeline, built in memory with no download: for tests, CPU demos and
`--model tiny-random`. Its images are noise from random weights, never a rendering of the prompt.

The tiny Qwen3.5 prompt enhancer (`--enhance tiny-random`) is the qwen35 family's own (qwen35/tiny.py).

Same component classes as the real checkpoint, shrunk (real size in the comments). The tokenizer is byte-level
(every UTF-8 byte one token, no merges) with Qwen's chat special tokens, plus 18 added tokens for the fixed system
prompt of QwenImagePipeline's template, so that, as with the real tokenizer, the template's prefix is 34 tokens
(`prompt_template_encode_start_idx`) and the prompt's own tokens start right after it.
"""

import contextlib
import importlib
import inspect

import torch
from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Tokenizer,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from .qwen35.tiny import SPECIAL_TOKENS, byte_vocab
from .core.vl_processor import processor_without_torchvision

TINY_MODEL_ID = "tiny-random"
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# The tiny processor's image area bounds (Qwen-Image-Edit's: 56x56 to 3584x3584): the edit pipelines hand the VL a
# 1024x1024-area image, here seen as at most 4x4 merged 28x28 patches (16 <|image_pad|> tokens).
TINY_VL_PIXELS = (28 * 28, 112 * 112)
# QwenImagePipeline.prompt_template_encode's system prompt, in 18 pieces (the rest of its 34-token prefix is
# "<|im_start|>", "system\n" (7 bytes), "<|im_end|>", "\n", "<|im_start|>", "user\n" (5 bytes)).
SYSTEM_PROMPT_PIECES = (
    "Describe the", " image", " by", " detailing", " the", " color,", " shape,", " size,", " texture,",
    " quantity,", " text,", " spatial", " relationships", " of", " the", " objects", " and", " background:",
)

# Qwen-Image's scheduler_config.json (FlowMatchEuler, dynamic exponential shift, shift_terminal 0.02).
QWEN_IMAGE_SCHEDULER_CONFIG = dict(
    base_image_seq_len=256,
    base_shift=0.5,
    max_image_seq_len=8192,
    max_shift=0.9,
    num_train_timesteps=1000,
    shift=1.0,
    shift_terminal=0.02,
    time_shift_type="exponential",
    use_dynamic_shifting=True,
)


def tiny_tokenizer(vision: bool = False) -> Qwen2Tokenizer:
    """With vision: plus VISION_TOKENS, special (the processor expands <|image_pad|>), as the last four ids."""
    tokenizer = Qwen2Tokenizer(vocab=byte_vocab(), merges=[], additional_special_tokens=list(SPECIAL_TOKENS[1:]))
    tokenizer.add_tokens(sorted(set(SYSTEM_PROMPT_PIECES)))
    if vision:
        tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS[1:] + VISION_TOKENS)})
    return tokenizer


def tiny_vl_processor(tokenizer: Qwen2Tokenizer):
    """transformers' Qwen2VLProcessor without torchvision (vl_processor.py), on a tiny_tokenizer(vision=True)."""
    min_pixels, max_pixels = TINY_VL_PIXELS
    image_processor = Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels, patch_size=14,
                                               merge_size=2, temporal_patch_size=2)
    return processor_without_torchvision(image_processor, tokenizer)


# Qwen-Image-Layered's differences from the text-to-image checkpoint (its transformer's and VAE's config.json).
# The tiny VAE's 4 latent channels become 8 here: the pipeline takes a 4-channel image for latents.
LAYERED_TRANSFORMER = dict(use_layer3d_rope=True, use_additional_t_cond=True, in_channels=32, out_channels=8)
LAYERED_VAE = dict(input_channels=4, z_dim=8, latents_mean=[0.0] * 8, latents_std=[1.0] * 8)  # RGBA


TINY_HEADS = 3  # the tiny transformer's attention heads (24 in the real model)
# The tiny transformer's and VAE's constructor arguments (the real values in the comments).
TINY_TRANSFORMER = {
    "patch_size": 2,
    "in_channels": 16,  # 64
    "out_channels": 4,  # 16
    "num_layers": 2,  # 60
    "attention_head_dim": 16,  # 128
    "num_attention_heads": TINY_HEADS,  # 24
    "joint_attention_dim": 16,  # 3584
    "axes_dims_rope": (8, 4, 4),  # (16, 56, 56)
}
TINY_VAE = {
    "base_dim": 24,  # 96
    "z_dim": 4,  # 16
    "dim_mult": [1, 2, 4],  # [1, 2, 4, 4]
    "num_res_blocks": 1,  # 2
    "temperal_downsample": [False, True],  # [False, True, True]
    "latents_mean": [0.0] * 4,
    "latents_std": [1.0] * 4,
}


def tiny_components(seed: int = 0, vision: bool = False, transformer_config: dict | None = None,
                    vae_config: dict | None = None, text_layers: int = 2) -> dict:
    """The components of a tiny QwenImagePipeline; vision: plus the `processor` of the edit and layered pipelines
    (tiny_vl_processor) and a text encoder that reads images. transformer_config / vae_config: constructor overrides
    (e.g. zero_cond_t=True for Edit-2511, LAYERED_TRANSFORMER); text_layers: the text encoder's decoder layers."""
    torch.manual_seed(seed)
    transformer = QwenImageTransformer2DModel(**{**TINY_TRANSFORMER, **(transformer_config or {})})
    torch.manual_seed(seed)
    vae = AutoencoderKLQwenImage(**{**TINY_VAE, **(vae_config or {})})
    torch.manual_seed(seed)
    tokenizer = tiny_tokenizer(vision)
    config = Qwen2_5_VLConfig(
        text_config=dict(
            hidden_size=16,  # 3584
            intermediate_size=16,  # 18944
            num_hidden_layers=text_layers,  # 28
            num_attention_heads=2,  # 28
            num_key_value_heads=2,  # 4
            rope_scaling=dict(mrope_section=[1, 1, 2], rope_type="default", type="default"),
            rope_theta=1000000.0,
            vocab_size=len(tokenizer),
            bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
            eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        ),
        vision_config=dict(depth=2, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16),
        hidden_size=16,
        vocab_size=len(tokenizer),  # 152064
        **(dict(zip(("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"),
                    tokenizer.convert_tokens_to_ids(list(VISION_TOKENS)))) if vision else
           dict(vision_start_token_id=len(tokenizer) - 3, vision_end_token_id=len(tokenizer) - 2,
                vision_token_id=len(tokenizer) - 1, image_token_id=len(tokenizer) - 1,
                video_token_id=len(tokenizer) - 1)),
    )
    text_encoder = Qwen2_5_VLForConditionalGeneration(config).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER_CONFIG)
    components = dict(transformer=transformer, vae=vae, scheduler=scheduler, text_encoder=text_encoder,
                      tokenizer=tokenizer)
    return components | (dict(processor=tiny_vl_processor(tokenizer)) if vision else {})


# The edit, layered and 2.1 pipelines resize their input images to a fixed area (1024x1024 for the VAE, 384x384 for
# the VL; 640x640 or 1024x1024 for layered; 2.1's output_resolution, 1024): 4096 condition tokens take minutes in
# Triton's interpreter with a test model.
CONDITION_AREA_DIVISOR = 256
CONDITION_IMAGE_PIPELINES = tuple(f"diffusers.pipelines.qwenimage.pipeline_qwenimage_{name}"
                                  for name in ("edit", "edit_plus", "edit_inpaint", "layered")) + (
    "diffusers.pipelines.qwenimage21.pipeline_qwenimage21",)


@contextlib.contextmanager
def small_condition_images(divisor: int = CONDITION_AREA_DIVISOR):
    """Inside: diffusers' edit, layered and 2.1 pipelines (stock and fast alike) resize their input images, and size
    an output sized from them, to 1/divisor of the area they use (1024x1024 -> 64x64). For test-size models only: it
    changes what the pipelines compute, so the command line records it with each image."""
    modules = [importlib.import_module(name) for name in CONDITION_IMAGE_PIPELINES]
    originals = [module.calculate_dimensions for module in modules]
    for module, dims in zip(modules, originals):
        module.calculate_dimensions = lambda area, ratio, dims=dims: dims(area / divisor, ratio)
    try:
        yield
    finally:
        for module, dims in zip(modules, originals):
            module.calculate_dimensions = dims


def tiny_pipeline(pipeline_class=QwenImagePipeline, seed: int = 0, transformer_config: dict | None = None,
                  text_layers: int = 2, **init_kwargs):
    """A tiny random-weight pipeline of `pipeline_class` (fp32, CPU): with a processor if the class takes one,
    Qwen-Image-Layered's transformer and VAE options for QwenImageLayeredPipeline."""
    vision = "processor" in inspect.signature(pipeline_class.__init__).parameters
    layered = pipeline_class.__name__ == "QwenImageLayeredPipeline"
    components = tiny_components(seed, vision, {**(LAYERED_TRANSFORMER if layered else {}), **(transformer_config or {})},
                                 LAYERED_VAE if layered else None, text_layers)
    return pipeline_class(**components, **init_kwargs)


# ---- Qwen-Image-2.1

# The tiny 2.1 transformer's constructor arguments (the real values in the comments); z_dim = in_channels.
TINY_QWEN21_TRANSFORMER = dict(
    num_layers=2,  # 32
    attention_head_dim=16,  # 128
    num_attention_heads=2,  # 32
    in_channels=16,  # 64
    out_channels=16,  # 64
    context_in_dim=24,  # 4096
    axes_dims_rope=(4, 6, 6),  # (16, 56, 56)
)
# Five levels (4 downsamplings): the pipeline's fixed 16x; RGBA in and out.
TINY_QWEN21_VAE = dict(base_dim=8, decoder_base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1, 1], num_res_blocks=1,
                       temperal_downsample=[False, False, False, False], latents_mean=[0.0] * 16,
                       latents_std=[1.0] * 16)
# The processor's chat template: the system turn QwenImage21Pipeline tokenizes to count its prefix.
QWEN21_CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for c in m['content'] %}"
                        "{{ c['text'] }}{% endfor %}<|im_end|>\n{% endfor %}")
# Qwen-Image-2.1's scheduler: FlowMatchEuler, dynamic exponential shift (the pipeline's defaults for the rest).
QWEN21_SCHEDULER_CONFIG = dict(use_dynamic_shifting=True, time_shift_type="exponential", base_shift=0.5,
                               max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)


def tiny_qwen21_components(seed: int = 0, num_layers: int = 2, text_layers: int = 1) -> dict:
    """The components of a tiny QwenImage21Pipeline (fp32, CPU): a Qwen3-VL text encoder and processor (patch 16,
    2x2 merge: one image slot per 32x32 pixels, as the 2.1 transformer's 2x2 latent tokens), the RGBA VAE at 16x,
    the transformer (num_layers blocks; text_layers: the text encoder's decoder layers)."""
    from diffusers import AutoencoderKLQwenImage21, QwenImage21Transformer2DModel
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLProcessor

    torch.manual_seed(seed)
    transformer = QwenImage21Transformer2DModel(**TINY_QWEN21_TRANSFORMER | dict(num_layers=num_layers))
    torch.manual_seed(seed)
    vae = AutoencoderKLQwenImage21(**TINY_QWEN21_VAE)
    tokenizer = tiny_tokenizer(vision=True)
    image_processor = Qwen2VLImageProcessorPil(min_pixels=32 * 32, max_pixels=256 * 256, patch_size=16, merge_size=2,
                                               temporal_patch_size=2)
    processor = processor_without_torchvision(image_processor, tokenizer, Qwen3VLProcessor,
                                              chat_template=QWEN21_CHAT_TEMPLATE)
    vision_ids = dict(zip(("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"),
                          tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))))
    config = Qwen3VLConfig(
        text_config=dict(hidden_size=24, intermediate_size=48, num_attention_heads=2,  # 4096, ..
                         num_hidden_layers=text_layers, num_key_value_heads=1, head_dim=12, vocab_size=len(tokenizer),
                         rope_scaling=dict(rope_type="default", mrope_section=[2, 2, 2])),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=24,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                           deepstack_visual_indexes=[0]),
        **vision_ids,
    )
    torch.manual_seed(seed)
    text_encoder = Qwen3VLForConditionalGeneration(config).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(**QWEN21_SCHEDULER_CONFIG)
    return dict(scheduler=scheduler, vae=vae, text_encoder=text_encoder, processor=processor, transformer=transformer)
