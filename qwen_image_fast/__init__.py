"""qwen-image-fast: fast, faithful Qwen-Image inference (rowwise FP8, fused Triton kernels, FlashAttention-4).

    from qwen_image_fast import QwenImageFastPipeline, FastConfig, optimize, PromptEnhancer, lightning_scheduler
    from qwen_image_fast import from_pretrained  # any accelerated pipeline, by its model_index.json
    from qwen_image_fast import from_single_files  # ComfyUI / GGUF / diffusers single files, configs from a folder

The kernels live in `qwen_image_fast.kernels`, the models and pipelines in `qwen_image_fast.pipelines`, the command
line in `qwen_image_fast.cli`. Importing the package imports neither torch nor diffusers: each name below loads its
module on first use (the CLI starts fast). The fast classes are exported here by name, which is how diffusers finds
them in a saved fast pipeline's model_index.json (library "qwen_image_fast").
"""

import importlib

_WHERE = {
    "FastConfig": ".pipelines.core.config",
    "QwenImageFastPipeline": ".pipelines.qwen_image.text_to_image",
    "optimize": ".pipelines.loading",
    "from_pretrained": ".pipelines.loading",
    "from_single_files": ".pipelines.loading",
    "FastQwenImageTransformer": ".pipelines.qwen_image.model.transformer",
    "FastQwenImage21Pipeline": ".pipelines.qwen_image21.pipeline",
    "FastQwenImage21Transformer": ".pipelines.qwen_image21.model",
    "FastAutoencoderKLQwenImage": ".pipelines.qwen_image.model.vae",
    "FastAutoencoderKLQwenImage21": ".pipelines.qwen_image21.vae",
    "PromptEnhancer": ".pipelines.qwen35.enhance",
    "lightning_scheduler": ".pipelines.qwen_image.samplers",
    **{name: ".pipelines.qwen_image.family" for name in (
        "FastQwenImageImg2ImgPipeline", "FastQwenImageInpaintPipeline", "FastQwenImageEditPipeline",
        "FastQwenImageEditPlusPipeline", "FastQwenImageEditInpaintPipeline", "FastQwenImageLayeredPipeline",
        "FastQwenImageControlNetPipeline", "FastQwenImageControlNetInpaintPipeline")},
}
__all__ = sorted(_WHERE)
__version__ = "0.1.0"


def __getattr__(name):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
