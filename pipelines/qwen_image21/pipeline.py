"""FastQwenImage21Pipeline: diffusers' QwenImage21Pipeline (text-to-image and image-conditioned) with its own
__call__, unchanged, around the fast Qwen-Image-2.1 transformer (model.py).

What runs is the registry's (core/optimizations.py): fused_transformer, fp8 (every block linear),
fp8_fast_accum, attention, cuda_graphs (the cached steps, model.py, from the graphs of the pipeline's runner),
batched_cfg (the cached steps of both CFG branches paired, model.py), FastConfig(cache=...) (the step cache's pieces,
model.py), diffusers' TaylorSeerCacheConfig (its own hooks on the blocks' `attn`, model.py), memory="low" with or
without a budget (memory.py) and vae_2d_decode (the VAE converted: vae.py) run here; diffusers' other step caches
do not (enable_cache says why), and the options that would change diffusers' loop (sampler, cfg_fraction,
parallel) are refused, as for the 2512 family's image-conditioned pipelines.
Each call runs in the pipeline's runner (core/pipeline/base.py's _fast_call); `applied` after a call is what it
recorded running.
"""

import contextlib
import functools
import inspect

import torch
from diffusers import AutoencoderKLQwenImage21, QwenImage21Pipeline

from ..core.config import FastConfig
from ..core.gpu_support import fp8_gemm_why_not
from ..core.model.vae_2d import as_vae_class, why_not_2d
from ..core.optimizations import QWEN21_ALSO_RUNS, Facts, memory_label
from ..core.pipeline.turns import TurnTakingPipeline
from ..core.pipeline.base import (FastCheckpointPipeline, FastLoraPipeline, FastPipelineState, check_blocks_for_cache,
                                  check_given_fast_transformer, refuse_text_to_image_only, transformer_config_on)
from ..core.runtime.context import get_context, record
from ..core.runtime.memory import check_within_plan
from ..core.runtime.offload import has_offload_hooks, retire_arenas_of
from .memory import PLAN as MEMORY_PLAN
from .memory import place_low_memory
from .model import FastQwenImage21Transformer
from .vae import FastAutoencoderKLQwenImage21

CALL_SIGNATURE = inspect.signature(QwenImage21Pipeline.__call__)


def refuse_2512_only(config: FastConfig, pipeline: str):
    """ValueError for what `pipeline` would otherwise ignore: the text-to-image-only options (diffusers' loop runs)
    but memory and a memory budget (memory.py places 2.1's components), and text_bucket (the runner's padding of
    prompts: 2.1's text is in the prefix cache, at its own length)."""
    refuse_text_to_image_only(config, pipeline, runs=QWEN21_ALSO_RUNS)
    if config.text_bucket != FastConfig().text_bucket:
        raise ValueError(f"text_bucket={config.text_bucket!r}: {pipeline} keeps each prompt at its own length in "
                         "the prefix KV cache; leave text_bucket at its default")


def prefix_token_counter(processor):
    """str -> the tokens a prompt puts in a text-to-image call's prefix: diffusers' QwenImage21Pipeline's own
    template around it, tokenized, less its system message's tokens (_get_qwen_prompt_embeds; an empty prompt is
    " " there). processor: the checkpoint's (a Qwen3VLProcessor), or its folder or hub id."""
    if not hasattr(processor, "tokenizer"):
        from transformers.utils import is_torchvision_available

        if is_torchvision_available():
            from transformers import AutoProcessor

            processor = AutoProcessor.from_pretrained(processor, subfolder="processor")
        else:
            from ..core.hub import local_folder
            from ..core.vl_processor import load_processor_without_torchvision

            processor = load_processor_without_torchvision(local_folder(processor, "processor"))
    templates = QwenImage21Pipeline(scheduler=None, vae=None, text_encoder=None, processor=processor, transformer=None)

    def count(prompt: str) -> int:
        return len(processor.tokenizer(templates.prompt_template_t2i.format(prompt or " ")).input_ids) - (
            templates._drop_idx)

    return count


class FastQwenImage21Pipeline(TurnTakingPipeline, FastPipelineState, FastLoraPipeline, FastCheckpointPipeline,
                              QwenImage21Pipeline):
    stock_class, fast_transformer_class = QwenImage21Pipeline, FastQwenImage21Transformer
    _image_conditioned = False  # its text-to-image-only options are refuse_2512_only's

    def __init__(self, scheduler, vae, text_encoder, processor, transformer, sample_sigmas=None, *,
                 fast_config: FastConfig | str | None = None):
        super().__init__(scheduler, vae, text_encoder, processor, transformer, sample_sigmas=sample_sigmas)
        self._set_up(FastConfig.coerce(fast_config), None)

    def _set_up(self, config: FastConfig, device):
        refuse_2512_only(config, type(self).__name__)
        retire_arenas_of(self.components.values())  # another pipeline's memory="low" placement of them ends
        transformer = self.transformer
        check_blocks_for_cache(transformer, config)
        if isinstance(transformer, FastQwenImage21Transformer):
            check_given_fast_transformer(transformer, config)
        elif config.fused_transformer and transformer is not None:
            device = torch.device(device) if device is not None else transformer.device
            self.register_modules(transformer=FastQwenImage21Transformer.from_diffusers(
                transformer, transformer_config_on(config, device), device))
        if config.vae_2d_decode and type(self.vae) is AutoencoderKLQwenImage21:
            self.register_modules(vae=as_vae_class(self.vae, FastAutoencoderKLQwenImage21))
        elif not config.vae_2d_decode and type(self.vae) is FastAutoencoderKLQwenImage21:  # a saved fast pipeline's
            self.register_modules(vae=as_vae_class(self.vae, AutoencoderKLQwenImage21))
        self._new_state(config)
        self._turns = None
        if isinstance(self.transformer, FastQwenImage21Transformer):
            self.transformer.block_arena, self.transformer.planned_prefix = None, None  # an earlier placement's
            self.transformer.prefix_cache.release()  # an earlier pipeline's calls': this one's calls bind their own
        if config.memory == "low":
            device = torch.device(device) if device is not None else self.transformer.device
            self._turns = place_low_memory(self, device, config.max_memory_gib)

    def _check_fast_config(self, config: FastConfig):
        refuse_2512_only(config, type(self).__name__)  # as when the pipeline is built
        check_blocks_for_cache(self.transformer, config)

    def facts(self) -> Facts:
        transformer = self.transformer
        fused = isinstance(transformer, FastQwenImage21Transformer)
        return Facts(pipeline=QwenImage21Pipeline.__name__, fused=fused,
                     device="cpu" if transformer is None else transformer.device.type,
                     fp8=fused and transformer.fast_config.fp8,
                     fast_accum=fused and transformer.fast_config.fp8 and transformer.fast_config.fp8_fast_accum,
                     fp8_why=fp8_gemm_why_not(transformer.device) if fused and not transformer.fast_config.fp8 else None,
                     attention=transformer.attention_backend if fused else None,
                     fp8_attention=transformer.fp8_attention[0] if fused else None,
                     fp8_attention_why=transformer.fp8_attention[1] if fused else None,
                     offload_hooks=transformer is not None and has_offload_hooks(transformer),
                     vae_2d=why_not_2d(self.vae),
                     enhancer=False, loaded=transformer.single_file.applied if fused and transformer.single_file else (),
                     diffusers_cache=(type(transformer._cache_config).__name__
                                      if fused and transformer.is_cache_enabled else None))

    @functools.wraps(QwenImage21Pipeline.__call__)
    def __call__(self, *args, **kwargs):
        if self._turns is not None and self.fast_config.max_memory_gib is not None:
            self._check_within_budget(CALL_SIGNATURE.bind(self, *args, **kwargs))
        with self._fast_call(kwargs.get("attention_kwargs")), self._blocks_take_turns():
            return QwenImage21Pipeline.__call__(self, *args, **kwargs)

    def _check_within_budget(self, call: inspect.BoundArguments):
        """ValueError before anything runs for a call beyond what the memory budget is planned for (memory.PLAN)."""
        call.apply_defaults()
        a = call.arguments
        if a["prompt"] is None and a["prompt_embeds"] is not None:
            prompts = a["prompt_embeds"].shape[0]
        else:
            prompts = 1 if a["prompt"] is None or isinstance(a["prompt"], str) else len(a["prompt"])
        conditions = a["image"] if isinstance(a["image"], list) else [] if a["image"] is None else [a["image"]]
        steps = len(a["sigmas"]) if a["sigmas"] is not None else a["num_inference_steps"]
        check_within_plan(self.fast_config.max_memory_gib, prompts * a["num_images_per_prompt"],
                          a["height"] or a["output_resolution"], a["width"] or a["output_resolution"], steps,
                          MEMORY_PLAN, len(conditions))

    def _unpack_latents(self, latents, height, width, vae_scale_factor):
        """diffusers' (a staticmethod there), which its __call__ runs once, after the denoising loop and before the
        VAE decode: under a memory budget the prefix caches go back first, their room the decode's (memory.py)."""
        if self._turns is not None and self.fast_config.max_memory_gib is not None:
            self.transformer.prefix_cache.release(get_context().step_graphs)
        return QwenImage21Pipeline._unpack_latents(latents, height, width, vae_scale_factor)

    # ---- memory="low" (memory.py; encoding's turn: core/pipeline/turns.py)

    @contextlib.contextmanager
    def _blocks_take_turns(self):
        """With memory="low", in a call (its record in the forward context): each transformer forward brings the
        blocks' turn first (nothing to do once they are in)."""
        if self._turns is None:
            yield
            return
        record("memory", memory_label(self.fast_config))
        handle = self.transformer.register_forward_pre_hook(lambda module, args: self._turns.use("transformer"))
        try:
            yield
        finally:
            handle.remove()
