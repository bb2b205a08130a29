"""qwen-image-fast: fast, faithful Qwen-Image-2512 inference (rowwise FP8, fused Triton kernels, FlashAttention-4).

    from qwen_image_fast import QwenImageFastPipeline, FastConfig, optimize

The kernels live in `qwen_image_fast.kernels`, the model code in `qwen_image_fast.pipelines`."""

from .config import FastConfig
from .optimize import optimize
from .pipeline import QwenImageFastPipeline

__all__ = ["FastConfig", "QwenImageFastPipeline", "optimize"]
__version__ = "0.1.0"
