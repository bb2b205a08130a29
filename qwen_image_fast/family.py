"""optimize() for Qwen-Image's other diffusers pipelines: their own __call__, unchanged, with the fast transformer.

The pipelines in ACCELERATED call `self.transformer(...)` as the text-to-image one does (with condition latents in
the image stream, or ControlNet residuals), and the fast transformer gives what the stock one gives there (tests:
tests/pipelines/test_family.py against each stock pipeline). What their loops do around the transformer (batched
CFG, CUDA graphs, other samplers, the 2D VAE decode) is the text-to-image pipeline's own and does not run here;
`applied` says what did. The edit pipelines are not accelerated yet: their Qwen2.5-VL processor is untested here.
"""

import diffusers

from .config import FastConfig
from .pipeline import FastTransformerPipeline, fast_transformer
from .pipelines.qwen_image.transformer import FastQwenImageTransformer

ACCELERATED = ("QwenImageImg2ImgPipeline", "QwenImageInpaintPipeline", "QwenImageControlNetPipeline",
               "QwenImageControlNetInpaintPipeline")
NOT_YET = ("QwenImageEditPipeline", "QwenImageEditPlusPipeline", "QwenImageEditInpaintPipeline",
           "QwenImageLayeredPipeline")


class FastFamilyPipeline(FastTransformerPipeline):
    """Mixed in before one of ACCELERATED (fast_class): the fast transformer's answers, `fast_config`, `applied`."""

    fast_config: FastConfig

    @property
    def applied(self) -> list[str]:
        """What a call runs: the fast transformer's entries (the pipeline's own loop runs as in diffusers)."""
        return self._transformer_entries()

    def save_pretrained(self, save_directory, *args, **kwargs):
        raise NotImplementedError(
            f"save_pretrained of an optimized {type(self).__bases__[-1].__name__} is not supported yet (its folder "
            "would name a class diffusers cannot load): save the stock pipeline, or save the text-to-image "
            "QwenImageFastPipeline, whose transformer folder this pipeline can be built from")


_FAST_CLASSES: dict[type, type] = {}


def fast_class(cls: type) -> type:
    """The fast counterpart of a diffusers pipeline class in ACCELERATED (one class per stock class)."""
    if cls not in _FAST_CLASSES:
        _FAST_CLASSES[cls] = type(f"Fast{cls.__name__}", (FastFamilyPipeline, cls), {"__module__": __name__})
    return _FAST_CLASSES[cls]


def is_accelerated(pipe) -> bool:
    return type(pipe).__name__ in ACCELERATED and type(pipe) is getattr(diffusers, type(pipe).__name__)


def check_family(pipe):
    """TypeError for a pipeline optimize() does not take, naming the ones it does."""
    name = type(pipe).__name__
    supported = ", ".join(("QwenImagePipeline",) + ACCELERATED)
    if name in NOT_YET:
        raise TypeError(f"optimize() does not accelerate {name} yet (supported: {supported}); its stock pipeline "
                        "runs as is")
    raise TypeError(f"optimize() takes one of diffusers' {supported}; got {name}")


def optimize_family(pipe, config: FastConfig, device, enhance_prompt):
    """pipe (is_accelerated) with its transformer converted on `device` and its class made fast_class(type(pipe)),
    in place. The options that would change what its own loop computes are refused, not ignored."""
    if enhance_prompt is not None and enhance_prompt is not False:
        raise ValueError(f"enhance_prompt is supported by the text-to-image QwenImageFastPipeline only, not by "
                         f"{type(pipe).__name__}")
    if config.scheduler != "euler" or config.cfg_fraction < 1:
        raise ValueError(f"FastConfig(scheduler={config.scheduler!r}, cfg_fraction={config.cfg_fraction:g}) changes "
                         f"the text-to-image pipeline's loop, which {type(pipe).__name__} does not run; replace "
                         "pipe.scheduler to sample otherwise")
    if config.fused_transformer and not isinstance(pipe.transformer, FastQwenImageTransformer):
        pipe.register_modules(transformer=fast_transformer(pipe.transformer, config, device))
    pipe.__class__ = fast_class(type(pipe))
    pipe.fast_config = config
    return pipe
