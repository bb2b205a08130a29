"""qwen-image-fast: fast, faithful Qwen-Image-2512 inference (rowwise FP8, fused Triton kernels, FlashAttention-4).

    from qwen_image_fast import QwenImageFastPipeline, FastConfig, optimize, PromptEnhancer

The kernels live in `qwen_image_fast.kernels`, the model code in `qwen_image_fast.pipelines`."""

from .config import FastConfig
from .optimize import optimize
from .pipeline import QwenImageFastPipeline

__all__ = ["FastConfig", "PromptEnhancer", "QwenImageFastPipeline", "optimize"]
__version__ = "0.1.0"


def __getattr__(name):
    if name == "PromptEnhancer":  # imported on first use: the Qwen3.5 model code is not needed otherwise
        from .pipelines.qwen35.enhance import PromptEnhancer

        return PromptEnhancer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
