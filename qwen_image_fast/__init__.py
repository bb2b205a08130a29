"""qwen-image-fast: fast, faithful Qwen-Image-2512 inference (rowwise FP8, fused Triton kernels, FlashAttention-4).

    from qwen_image_fast import QwenImageFastPipeline, FastConfig, optimize, PromptEnhancer, lightning_scheduler
    from qwen_image_fast import from_pretrained  # any accelerated pipeline, by its model_index.json

The kernels live in `qwen_image_fast.kernels`, the model code in `qwen_image_fast.pipelines`. Importing the package
imports neither torch nor diffusers: each name below loads its module on first use (the CLI starts fast).
"""

import importlib

__all__ = ["FastConfig", "FastQwenImageTransformer", "PromptEnhancer", "QwenImageFastPipeline", "from_pretrained",
           "lightning_scheduler", "optimize"]
__version__ = "0.1.0"

_WHERE = {
    "FastConfig": ".config",
    "QwenImageFastPipeline": ".pipeline",
    "optimize": ".pipeline",
    "FastQwenImageTransformer": ".pipelines.qwen_image.transformer",
    "PromptEnhancer": ".pipelines.qwen35.enhance",
    "lightning_scheduler": ".samplers",
    "from_pretrained": ".family",
}


def __getattr__(name):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
