"""qwen-image-fast: fast, faithful Qwen-Image-2512 inference (rowwise FP8, fused Triton kernels, FlashAttention-4).

The kernels live in `qwen_image_fast.kernels`, the model code in `qwen_image_fast.pipelines`."""

__version__ = "0.1.0"
