"""The fast versions of Qwen-Image's image-conditioned diffusers pipelines: their own __call__, unchanged, with the
fast transformer and VAE.

These pipelines call `self.transformer(...)` as the text-to-image one does, with condition images' latents joining
the image stream (edit, layered: `img_shapes` lists them, Edit-2511 sets zero_cond_t), or ControlNet residuals; the
fast transformer gives what the stock one gives there (tests against each stock pipeline). Each call runs inside the
pipeline's runner (core/runtime/runner.py): the transformer's forwards pair their CFG passes (batched_cfg) and replay
from CUDA graphs (cuda_graphs) as in text-to-image, and the VAE decodes as 2D convolutions (vae_2d_decode). The
options that would change what the text-to-image loop computes (sampler, cfg_fraction, memory, parallel) are refused
here (core/pipeline/base.py's refuse_text_to_image_only), not ignored. The measurements are in benchmarks/RESULTS.md,
"Editing and image-conditioned generation".

Each fast class is its diffusers class with FastPipelineMixin before it; its constructor takes the stock one's
arguments plus `fast_config`, and its __call__ is the stock one's (the same signature), run under `_fast_call`.
"""

import functools
import inspect

import diffusers

from ..core.config import FastConfig
from .fast_pipeline import FastPipelineMixin
from .samplers import check_not_one_step


def fast_init(stock_init):
    """The constructor of a fast class: the stock one's arguments (its signature) plus fast_config."""

    @functools.wraps(stock_init)
    def __init__(self, *args, fast_config: FastConfig | str | None = None, **kwargs):
        stock_init(self, *args, **kwargs)
        self._set_up(FastConfig.coerce(fast_config), None)

    stock = inspect.signature(stock_init)
    extra = inspect.Parameter("fast_config", inspect.Parameter.KEYWORD_ONLY, default=None)
    __init__.__signature__ = stock.replace(parameters=[*stock.parameters.values(), extra])
    return __init__


def fast_call(stock_call):
    """The __call__ of a fast class: the stock one (its signature), inside the pipeline's runner for the call."""

    signature = inspect.signature(stock_call)

    @functools.wraps(stock_call)
    def __call__(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        check_not_one_step(self.scheduler, bound.arguments.get("num_inference_steps"), bound.arguments.get("sigmas"))
        with self._fast_call(kwargs.get("attention_kwargs")):
            return stock_call(self, *args, **kwargs)

    return __call__


class FastQwenImageImg2ImgPipeline(FastPipelineMixin, diffusers.QwenImageImg2ImgPipeline):
    stock_class = diffusers.QwenImageImg2ImgPipeline
    __init__ = fast_init(diffusers.QwenImageImg2ImgPipeline.__init__)
    __call__ = fast_call(diffusers.QwenImageImg2ImgPipeline.__call__)


class FastQwenImageInpaintPipeline(FastPipelineMixin, diffusers.QwenImageInpaintPipeline):
    stock_class = diffusers.QwenImageInpaintPipeline
    __init__ = fast_init(diffusers.QwenImageInpaintPipeline.__init__)
    __call__ = fast_call(diffusers.QwenImageInpaintPipeline.__call__)


class FastQwenImageEditPipeline(FastPipelineMixin, diffusers.QwenImageEditPipeline):
    stock_class = diffusers.QwenImageEditPipeline
    __init__ = fast_init(diffusers.QwenImageEditPipeline.__init__)
    __call__ = fast_call(diffusers.QwenImageEditPipeline.__call__)


class FastQwenImageEditPlusPipeline(FastPipelineMixin, diffusers.QwenImageEditPlusPipeline):
    stock_class = diffusers.QwenImageEditPlusPipeline
    __init__ = fast_init(diffusers.QwenImageEditPlusPipeline.__init__)
    __call__ = fast_call(diffusers.QwenImageEditPlusPipeline.__call__)


class FastQwenImageEditInpaintPipeline(FastPipelineMixin, diffusers.QwenImageEditInpaintPipeline):
    stock_class = diffusers.QwenImageEditInpaintPipeline
    __init__ = fast_init(diffusers.QwenImageEditInpaintPipeline.__init__)
    __call__ = fast_call(diffusers.QwenImageEditInpaintPipeline.__call__)


class FastQwenImageLayeredPipeline(FastPipelineMixin, diffusers.QwenImageLayeredPipeline):
    stock_class = diffusers.QwenImageLayeredPipeline
    __init__ = fast_init(diffusers.QwenImageLayeredPipeline.__init__)
    __call__ = fast_call(diffusers.QwenImageLayeredPipeline.__call__)


class FastQwenImageControlNetPipeline(FastPipelineMixin, diffusers.QwenImageControlNetPipeline):
    stock_class = diffusers.QwenImageControlNetPipeline
    __init__ = fast_init(diffusers.QwenImageControlNetPipeline.__init__)
    __call__ = fast_call(diffusers.QwenImageControlNetPipeline.__call__)


class FastQwenImageControlNetInpaintPipeline(FastPipelineMixin, diffusers.QwenImageControlNetInpaintPipeline):
    stock_class = diffusers.QwenImageControlNetInpaintPipeline
    __init__ = fast_init(diffusers.QwenImageControlNetInpaintPipeline.__init__)
    __call__ = fast_call(diffusers.QwenImageControlNetInpaintPipeline.__call__)


IMAGE_CONDITIONED = (FastQwenImageImg2ImgPipeline, FastQwenImageInpaintPipeline, FastQwenImageEditPipeline,
                     FastQwenImageEditPlusPipeline, FastQwenImageEditInpaintPipeline, FastQwenImageLayeredPipeline,
                     FastQwenImageControlNetPipeline, FastQwenImageControlNetInpaintPipeline)
