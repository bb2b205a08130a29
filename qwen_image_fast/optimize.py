"""optimize(pipe, config): turn a diffusers QwenImagePipeline into a QwenImageFastPipeline in place.

One apply_<name> per optimization; each returns the entries it actually applied, which become `pipe.applied`.
Prompt enhancement is not an optimization (it changes the image) and is not in FastConfig: optimize's own
`enhance_prompt` argument sets it, and it shows in `pipe.applied` as "enhance_prompt".
"""

import inspect
import logging
import os

import torch
from diffusers import DPMSolverMultistepScheduler, QwenImagePipeline, UniPCMultistepScheduler

from .config import FastConfig
from .pipelines.qwen_image.attention import resolve_backend
from .pipelines.qwen_image.cuda_graph import GraphedForward
from .pipelines.qwen_image.transformer import FastQwenImageTransformer, FastTransformerConfig

logger = logging.getLogger(__name__)


def fp8_supported(device: torch.device) -> bool:
    return device.type == "cpu" or (device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9))


def apply_fused_transformer(pipe, config: FastConfig, device: torch.device) -> list[str]:
    """Replace pipe.transformer by the fused-kernel transformer (FP8 and attention backend inside it)."""
    if not config.fused_transformer:
        return []
    fp8 = config.fp8 and fp8_supported(device)
    if config.fp8 and not fp8:
        logger.warning("fp8=True but %s has no FP8 tensor cores (compute capability < 8.9): running BF16 GEMMs",
                       torch.cuda.get_device_name(device))
    transformer_config = FastTransformerConfig(
        fp8=fp8, bf16_linears=config.bf16_linears, fp8_fast_accum=config.fp8_fast_accum, attention=config.attention)
    fast = FastQwenImageTransformer.from_diffusers(pipe.transformer, transformer_config, device=device)
    pipe.register_modules(transformer=fast)
    applied = ["fused_transformer"]
    applied += ["fp8"] if fp8 else []
    applied += ["fp8_fast_accum"] if fp8 and config.fp8_fast_accum else []
    applied += [f"attention:{fast.attention_backend}"]
    return applied


def apply_batched_cfg(pipe, config: FastConfig) -> list[str]:
    return ["batched_cfg"] if config.batched_cfg else []


def apply_cuda_graphs(pipe, config: FastConfig, device: torch.device) -> list[str]:
    """Graph replay needs the fused transformer (no host sync in its forward) and a CUDA device."""
    pipe._graphed_transformer = None
    if config.cuda_graphs and config.fused_transformer and device.type == "cuda":
        pipe._graphed_transformer = GraphedForward(pipe.transformer)
        return ["cuda_graphs"]
    return []


def scheduler_kwargs(cls, config) -> dict:
    """The entries of a scheduler config that `cls` accepts (Qwen's FlowMatch config has extra keys)."""
    accepted = inspect.signature(cls.__init__).parameters
    return {k: v for k, v in config.items() if k in accepted}


def make_scheduler(name: str, base):
    """The sampler for `name`, configured from the checkpoint's FlowMatchEuler scheduler `base`."""
    if name == "euler":
        return base
    if name == "dpm++2m":
        return DPMSolverMultistepScheduler(**{
            **scheduler_kwargs(DPMSolverMultistepScheduler, base.config),
            "prediction_type": "flow_prediction", "use_flow_sigmas": True, "algorithm_type": "dpmsolver++",
            "solver_order": 2, "final_sigmas_type": "zero", "lower_order_final": True,
        })
    if name == "unipc":
        return UniPCMultistepScheduler(**{
            **scheduler_kwargs(UniPCMultistepScheduler, base.config),
            "prediction_type": "flow_prediction", "use_flow_sigmas": True,
        })
    raise ValueError(f"scheduler={name!r}; allowed: euler, dpm++2m, unipc")


def apply_scheduler(pipe, config: FastConfig) -> list[str]:
    pipe._sampler = make_scheduler(config.scheduler, pipe.scheduler)
    return [] if config.scheduler == "euler" else [f"scheduler:{config.scheduler}"]


def apply_selective_cfg(pipe, config: FastConfig) -> list[str]:
    return [] if config.cfg_fraction == 1.0 else [f"cfg_fraction:{config.cfg_fraction:g}"]


def resolve_enhancer(enhance_prompt, device=None):
    """None / False: no enhancer. True: PromptEnhancer.from_pretrained() (DEFAULT_ENHANCER_ID). A str or path: a
    Qwen3.5 checkpoint (local folder or hub id); "tiny-random": tiny_enhancer(), random weights, for tests. An object
    with an enhance(prompts) -> list[str] method (a PromptEnhancer): itself. device: where a loaded enhancer runs
    (None: CUDA when available)."""
    if enhance_prompt is None or enhance_prompt is False:
        return None
    from .pipelines.qwen35.enhance import DEFAULT_ENHANCER_ID, PromptEnhancer
    from .tiny import TINY_ENHANCER_ID, tiny_enhancer

    if enhance_prompt is True:
        return PromptEnhancer.from_pretrained(DEFAULT_ENHANCER_ID, device=device)
    if enhance_prompt == TINY_ENHANCER_ID:
        return tiny_enhancer(device=device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if isinstance(enhance_prompt, (str, os.PathLike)):
        return PromptEnhancer.from_pretrained(os.fspath(enhance_prompt), device=device)
    if callable(getattr(enhance_prompt, "enhance", None)):
        return enhance_prompt
    raise TypeError(f"enhance_prompt={enhance_prompt!r}; allowed: None, False, True, a checkpoint path or hub id, "
                    "or a PromptEnhancer")


def apply_enhance_prompt(pipe, enhancer) -> list[str]:
    """Prompts are rewritten by `enhancer` (None: off) before they are encoded; see QwenImageFastPipeline.__call__."""
    pipe.prompt_enhancer = enhancer
    pipe.last_enhanced_prompts = None
    return [] if enhancer is None else ["enhance_prompt"]


def optimize(pipe, config: FastConfig | str | None = None, device=None, enhance_prompt=None):
    """Convert `pipe` (a diffusers QwenImagePipeline) into a QwenImageFastPipeline in place and return it.

    config: a FastConfig, a preset name ("fast", "baseline") or None (= "fast"). device: where the fused
    transformer is built (default: where pipe.transformer is); build from a CPU pipeline straight onto the GPU
    to never hold two BF16 copies there. enhance_prompt: rewrite each prompt with a local Qwen3.5 before encoding
    it (see resolve_enhancer; a loaded enhancer runs on `device`, or on CUDA when available if device is None)."""
    from .pipeline import QwenImageFastPipeline

    if not isinstance(pipe, QwenImagePipeline):
        raise TypeError(f"optimize() takes a diffusers QwenImagePipeline, got {type(pipe).__name__}")
    if isinstance(pipe.transformer, FastQwenImageTransformer):
        raise ValueError("this pipeline is already optimized; call optimize() on a fresh QwenImagePipeline")
    config = FastConfig.preset(config or "fast") if not isinstance(config, FastConfig) else config
    enhancer = resolve_enhancer(enhance_prompt, device)  # before any conversion: a load error leaves pipe as it was
    device = torch.device(device) if device is not None else pipe.transformer.device
    if config.attention != "auto" and config.fused_transformer:
        resolve_backend(config.attention, device, pipe.transformer.dtype)  # a clear error before any conversion
    pipe.__class__ = QwenImageFastPipeline
    pipe.fast_config = config
    pipe.applied = (
        apply_fused_transformer(pipe, config, device)
        + apply_batched_cfg(pipe, config)
        + apply_cuda_graphs(pipe, config, device)
        + apply_scheduler(pipe, config)
        + apply_selective_cfg(pipe, config)
        + apply_enhance_prompt(pipe, enhancer)
    )
    return pipe
