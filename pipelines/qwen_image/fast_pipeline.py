"""What every fast pipeline of the 2512 family adds to the diffusers pipeline class it extends (FastPipelineMixin,
mixed in before it): building the fast components, `fast_config` (build options fixed, call options changeable),
`applied` from the registry (core/optimizations.py); the runner of each call, the LoRA methods and saving /
loading come from the shared pipeline base (core/pipeline/base.py).

Building (optimize(), from_pretrained, the diffusers constructor): the stock transformer is converted into the
FastQwenImageTransformer (FastConfig.fused_transformer) and the VAE into the FastAutoencoderKLQwenImage
(vae_2d_decode), the others are diffusers' own. A saved fast pipeline is a diffusers folder whose model_index.json
names the fast classes; `from_pretrained` loads it back as stored (FP8 weights not requantized) and an upstream
checkpoint by converting it.
"""

import logging

import torch
from diffusers import AutoencoderKLQwenImage

from ..core.config import FastConfig
from ..core.gpu_support import fp8_gemm_why_not
from ..core.model.vae_2d import as_vae_class, why_not_2d
from ..core.optimizations import Facts
from ..core.pipeline.base import (FastCheckpointPipeline, FastLoraPipeline, FastPipelineState, check_blocks_for_cache,
                                  check_given_fast_transformer, refuse_text_to_image_only, transformer_config_on)
from ..core.runtime.offload import has_offload_hooks, retire_arenas_of
from .model.transformer import FastQwenImageTransformer
from .model.vae import FastAutoencoderKLQwenImage

logger = logging.getLogger(__name__)


def fast_transformer(transformer, config: FastConfig, device, modulation_device=None) -> FastQwenImageTransformer:
    """A stock transformer converted on `device` (None: where it is) with config's transformer options
    (transformer_config_on)."""
    device = torch.device(device) if device is not None else transformer.device
    return FastQwenImageTransformer.from_diffusers(transformer, transformer_config_on(config, device), device,
                                                   modulation_device=modulation_device)


class FastPipelineMixin(FastPipelineState, FastLoraPipeline, FastCheckpointPipeline):
    """Mixed in before a diffusers Qwen-Image pipeline class (`stock_class`)."""

    fast_transformer_class = FastQwenImageTransformer

    # ---- building

    def _set_up(self, config: FastConfig, device, **fast_state):
        """The fast components on `device` (None: where they are): the transformer converted unless it is fast
        already (then its stored options must match config's), the VAE converted; a new runner (_new_state).
        Components another pipeline placed with memory="low" are given back to the host first, and that pipeline
        refuses to run from then on (core/runtime/offload.py's retire_arenas_holding)."""
        retire_arenas_of(self.components.values())
        if self._image_conditioned:
            refuse_text_to_image_only(config, self.stock_class.__name__)
        transformer = self.transformer  # None: a pipeline built without one (e.g. to encode prompts only)
        check_blocks_for_cache(transformer, config)
        if isinstance(transformer, FastQwenImageTransformer):
            check_given_fast_transformer(transformer, config)
            transformer.block_arena = None  # a retired placement's; memory="low" sets this pipeline's
            transformer.modulation_tables.reset()  # an earlier pipeline's calls': this one's build their own
        elif config.fused_transformer and transformer is not None:
            self.register_modules(transformer=fast_transformer(
                transformer, config, device, modulation_device="cpu" if config.memory == "low" else None))
        if config.vae_2d_decode and type(self.vae) is AutoencoderKLQwenImage:
            self.register_modules(vae=as_vae_class(self.vae, FastAutoencoderKLQwenImage))
        elif not config.vae_2d_decode and type(self.vae) is FastAutoencoderKLQwenImage:  # a saved fast pipeline's
            self.register_modules(vae=as_vae_class(self.vae, AutoencoderKLQwenImage))
        self._new_state(config)
        self._set_up_pipeline(config, device, **fast_state)

    def _set_up_pipeline(self, config: FastConfig, device, **fast_state):
        """What a pipeline class adds to _set_up (the text-to-image one: mesh, enhancer, memory placement)."""

    # ---- options and what runs

    def _check_fast_config(self, config: FastConfig):
        check_blocks_for_cache(self.transformer, config)

    def facts(self) -> Facts:
        """What decides whether each optimization can run here (optimizations.Facts)."""
        transformer = self.transformer
        fused = isinstance(transformer, FastQwenImageTransformer)
        fp8 = fused and bool(transformer.fast_config.fp8_linears)
        fp8_attention, why = transformer.fp8_attention if fused else (None, None)
        return Facts(pipeline=self.stock_class.__name__, fused=fused, fp8_attention=fp8_attention,
                     fp8_attention_why=why,
                     device="cpu" if transformer is None else transformer.device.type, fp8=fp8,
                     fast_accum=fp8 and transformer.fast_config.fp8_fast_accum,
                     fp8_why=fp8_gemm_why_not(transformer.device) if fused and not fp8 else None,
                     attention=transformer.attention_backend if fused else None,
                     offload_hooks=transformer is not None and has_offload_hooks(transformer), vae_2d=why_not_2d(self.vae),
                     enhancer=getattr(self, "prompt_enhancer", None) is not None, parallel=self._parallel_labels(),
                     diffusers_cache=transformer.step_cache_name if fused else None,
                     cache_rule=getattr(transformer.native_step_cache, "kind", None) if fused else None,
                     loaded=transformer.single_file.applied if fused and transformer.single_file else ())

    def _parallel_labels(self) -> tuple[str, ...]:
        return ()

