"""QwenImageFastPipeline: diffusers' QwenImagePipeline with the fast path inside, same call and output.

Differences from the stock denoising loop, each switched by a FastConfig field (`pipe.applied` says which ran):
- the fused transformer (FastQwenImageTransformer: FP8 block linears, fused kernels, FlashAttention-4);
- batched CFG: prompt and negative prompt go through one transformer forward of batch 2N; both texts are padded
  to one length and the padding is masked (never attended); Qwen's norm-rescaled combination is unchanged;
- the sampler: the pipeline's own scheduler (default; replacing `pipe.scheduler` works as in stock), or
  DPM-Solver++ 2M / UniPC derived from it at call time, driven with the same dynamic shift mu;
- CUDA graphs: the transformer forward replays from a graph per (resolution, batch, text-length bucket); not while
  offload hooks move the weights;
- selective CFG (lossy, off by default): guidance only on the first `cfg_fraction` of the steps.
- the VAE decode of an image as the 2D convolutions its causal 3D ones amount to for one frame (vae.py);
- one image on several processes (FastConfig.parallel, pipelines/qwen_image/parallel.py): with CFG-parallel each
  rank of a pair runs one of prompt / negative prompt and one all-gather per step gives both predictions to both;
  with Ulysses the transformer splits the sequence over its group. Every rank steps the same latents (the image
  group's first rank's starting noise) and returns the same images. A fast transformer serves the parallel
  setting of the last pipeline built around it (transformer.ulysses): do not share one between pipelines with
  different settings.
Text encoding, latent preparation and callbacks are diffusers' own.

Prompt enhancement (off by default; `enhance_prompt=`): a local Qwen3.5 (PromptEnhancer) rewrites `prompt` into a
detailed one before it is encoded; the negative prompt and prompt_embeds are left alone.

`save_pretrained` writes the fast transformer as stored (FP8 weights with their scales); `from_pretrained` loads
that folder back without requantizing, and the upstream layout by converting it.
"""

import logging
import math
import os

import torch
from diffusers import QwenImagePipeline
from diffusers.pipelines.qwenimage.pipeline_output import QwenImagePipelineOutput

from .config import FastConfig
from .pipelines.qwen_image.cfg_pairing import pad_text
from .pipelines.qwen_image.cuda_graph import GraphCaptureError, GraphedForward
from .memory import place_low_memory
from .pipelines.qwen_image.offload import TakingTurns
from .pipelines.qwen_image.parallel import MeshShape, ParallelMesh
from .pipelines.qwen_image.transformer import FastQwenImageTransformer, has_offload_hooks
from .pipelines.qwen_image.vae import can_decode_image, decode_image
from .samplers import dynamic_shift, make_scheduler, set_timesteps

logger = logging.getLogger(__name__)


def drop_all_ones(mask: torch.Tensor | None) -> torch.Tensor | None:
    """An all-valid mask becomes None, as diffusers' encode_prompt does (one host sync per call, before the loop)."""
    return None if mask is None or bool(mask.all()) else mask


def fp8_supported(device: torch.device) -> bool:
    return device.type == "cpu" or (device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9))


def fast_transformer(transformer, config: FastConfig, device) -> FastQwenImageTransformer:
    """A stock transformer converted on `device` (None: where it is) with config's transformer fields; BF16 GEMMs,
    with a warning, on a GPU without FP8 tensor cores."""
    device = torch.device(device) if device is not None else transformer.device
    transformer_config = config.transformer_config()
    if config.fp8 and not fp8_supported(device):
        logger.warning("fp8=True but %s has no FP8 tensor cores (compute capability < 8.9): running BF16 GEMMs",
                       torch.cuda.get_device_name(device))
        transformer_config = transformer_config.__class__(**{**transformer_config.to_dict(), "fp8": False})
    return FastQwenImageTransformer.from_diffusers(transformer, transformer_config, device,
                                                   modulation_device="cpu" if config.memory == "low" else None)


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


def is_fast_checkpoint(path_or_id) -> bool:
    """Whether a pipeline folder (or hub repo) was written by QwenImageFastPipeline.save_pretrained with the fast
    transformer: its model_index.json names FastQwenImageTransformer."""
    try:
        config = QwenImagePipeline.load_config(path_or_id)
    except OSError:  # not a pipeline folder or repo: diffusers' own loader says so
        return False
    return list(config.get("transformer", [None, None]))[-1] == FastQwenImageTransformer.__name__


class FastTransformerPipeline:
    """What a diffusers Qwen-Image pipeline holding a FastQwenImageTransformer answers through it (mixed in before
    the diffusers class): the pipeline-level LoRA methods that look for peft layers, `save_pretrained`'s refusal of
    adapters, and the transformer's entries of `applied`."""

    _graphs: GraphedForward | None = None  # the transformer's CUDA graphs (FastConfig.cuda_graphs), across calls
    _ran: list[str] | None = None  # what the last call ran (None before the first call)

    def _graphs_usable(self) -> bool:
        """Whether graphs will replay: kept, and the fast transformer on a CUDA device without offload hooks."""
        transformer = self._fast_transformer()
        return (self._graphs is not None and transformer is not None and transformer.device.type == "cuda"
                and not has_offload_hooks(transformer))

    def _transformer_entries(self) -> list[str]:
        transformer = self.transformer
        if not isinstance(transformer, FastQwenImageTransformer):
            return []
        fp8 = bool(transformer.fast_config.fp8_linears)
        return (["fused_transformer"] + (["fp8"] if fp8 else [])
                + (["fp8_fast_accum"] if fp8 and transformer.fast_config.fp8_fast_accum else [])
                + [f"attention:{transformer.attention_backend}"])

    # LoRA: diffusers' pipeline methods that look for peft layers, answered by the fast transformer

    def save_pretrained(self, save_directory, *args, **kwargs):
        """diffusers' save_pretrained, refused before anything is written while the fast transformer has LoRA
        adapters (its own save refuses them, but only after the components saved before it were written)."""
        fast = self._fast_transformer()
        if fast is not None and fast.lora_state.configs:
            fast.save_pretrained(save_directory)  # raises, saying what to do
        return super().save_pretrained(save_directory, *args, **kwargs)

    def _fast_transformer(self) -> FastQwenImageTransformer | None:
        return self.transformer if isinstance(self.transformer, FastQwenImageTransformer) else None

    def get_active_adapters(self) -> list[str]:
        fast = self._fast_transformer()
        if fast is None:
            return super().get_active_adapters()
        return list(fast.lora_state.active) if fast.lora_state.configs else []

    def fuse_lora(self, components: list[str] = ["transformer"], lora_scale: float = 1.0, safe_fusing: bool = False,
                  adapter_names: list[str] | None = None, **kwargs):
        fast = self._fast_transformer()
        if fast is None:
            return super().fuse_lora(components=components, lora_scale=lora_scale, safe_fusing=safe_fusing,
                                     adapter_names=adapter_names, **kwargs)
        self._check_lora_components(components)
        fast.fuse_lora(lora_scale, safe_fusing=safe_fusing, adapter_names=adapter_names)
        self._merged_adapters = self._merged_adapters | fast.fused_adapters

    def unfuse_lora(self, components: list[str] = ["transformer"], **kwargs):
        fast = self._fast_transformer()
        if fast is None:
            return super().unfuse_lora(components=components, **kwargs)
        self._check_lora_components(components)
        fast.unfuse_lora()
        self._merged_adapters = self._merged_adapters & fast.fused_adapters

    def _check_lora_components(self, components):
        if not components:
            raise ValueError("`components` cannot be an empty list.")
        for component in components:
            if component not in self._lora_loadable_modules:
                raise ValueError(f"{component} is not found in {self._lora_loadable_modules=}.")

    def set_lora_device(self, adapter_names, device):
        if self._fast_transformer() is None:
            return super().set_lora_device(adapter_names, device)
        raise NotImplementedError("set_lora_device: the fast transformer keeps adapters on its own device; "
                                  "delete_adapters(...) the ones you do not need")


class QwenImageFastPipeline(FastTransformerPipeline, QwenImagePipeline):
    """Drop-in for QwenImagePipeline: `QwenImageFastPipeline(**components, fast_config=...)` (diffusers' constructor,
    converts a stock transformer where it is), `from_pretrained(..., fast_config=..., device=...)`, `from_pipe(pipe)`
    or `qwen_image_fast.optimize(pipe)` (in place). `fast_config` says what was asked for, `applied` what ran."""

    fast_config: FastConfig
    prompt_enhancer = None  # a PromptEnhancer, or None: prompts are encoded as given
    last_enhanced_prompts: list[str] | None = None  # the rewrites of the last call (None when there were none)
    sampler = None  # the scheduler the last call stepped with: pipe.scheduler itself, or one derived from it
    _turns: TakingTurns | None = None  # memory="low": the text encoder and the block linears on the GPU in turn
    parallel: ParallelMesh | None = None  # the process groups of FastConfig.parallel

    def __init__(self, scheduler, vae, text_encoder, tokenizer, transformer, fast_config: FastConfig | str | None = None,
                 enhance_prompt=None):
        super().__init__(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                         transformer=transformer)
        self._set_up(FastConfig.coerce(fast_config), None, resolve_enhancer(enhance_prompt))

    def _set_up(self, config: FastConfig, device, enhancer):
        """The fast state, in __init__ and in optimize(): the transformer converted on `device` (None: where it is)
        unless it is fast already, the graphs, the enhancer."""
        transformer = self.transformer
        mesh = (None if config.parallel == "none" else
                ParallelMesh.build(config.parallel, config.ulysses_degree, transformer.config.num_attention_heads))
        if isinstance(transformer, FastQwenImageTransformer):
            stored = transformer.fast_config
            if not config.fused_transformer or (stored.fp8, stored.bf16_linears) != (config.fp8, config.bf16_linears):
                raise ValueError(
                    f"the pipeline's transformer is a FastQwenImageTransformer (fp8={stored.fp8}, bf16_linears="
                    f"{list(stored.bf16_linears)}) but fast_config asks for fused_transformer={config.fused_transformer}"
                    f", fp8={config.fp8}, bf16_linears={list(config.bf16_linears)}: pass a FastConfig that matches "
                    "it, or build the pipeline from the stock transformer")
        elif config.fused_transformer:
            self.register_modules(transformer=fast_transformer(transformer, config, device))
        if isinstance(self.transformer, FastQwenImageTransformer):
            self.transformer.ulysses = mesh.ulysses() if mesh is not None else None
        self.parallel = mesh
        self.fast_config = config
        self.prompt_enhancer = enhancer
        self.last_enhanced_prompts = None
        self.sampler = None
        self._graphs = GraphedForward(self.transformer) if config.cuda_graphs and config.fused_transformer else None
        self._turns = (place_low_memory(self, torch.device(device) if device is not None else self.transformer.device)
                       if config.memory == "low" else None)
        self._ran = None

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, fast_config=None, device=None, enhance_prompt=None,
                        **kwargs):
        """The upstream checkpoint layout (hub id or local folder, loaded by diffusers, then converted on `device`:
        e.g. "cuda" from a CPU load keeps one BF16 copy, on the CPU), or a folder save_pretrained wrote (its FP8
        transformer loaded as stored, straight onto `device`). enhance_prompt: None / False (off), True
        (PromptEnhancer.from_pretrained()), a Qwen3.5 checkpoint's path or hub id, or a PromptEnhancer."""
        config = FastConfig.coerce(fast_config)
        check_parallel_setup(config, pretrained_model_name_or_path)  # before any weight is loaded
        enhancer = resolve_enhancer(enhance_prompt, device)  # a load error before anything else is loaded
        if "torch_dtype" not in kwargs:  # diffusers 0.42 names it dtype (torch_dtype is deprecated there)
            kwargs.setdefault("dtype", torch.bfloat16)
        if "transformer" not in kwargs and is_fast_checkpoint(pretrained_model_name_or_path):
            if not config.fused_transformer:
                raise ValueError(f"{pretrained_model_name_or_path} holds the fast transformer (no stock one): "
                                 "fast_config must keep fused_transformer=True")
            kwargs["transformer"] = FastQwenImageTransformer.from_pretrained(  # low: placed by _set_up
                pretrained_model_name_or_path, subfolder="transformer", device="cpu" if config.memory == "low" else device,
                torch_dtype=kwargs.get("dtype", kwargs.get("torch_dtype")), fast_config=config.transformer_config())
        pipe = QwenImagePipeline.from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        return convert(pipe, config, device, enhancer)

    @classmethod
    def from_pipe(cls, pipeline, fast_config=None, device=None, enhance_prompt=None, **kwargs):
        """A fast pipeline sharing `pipeline`'s components (its transformer is left as it is and stays usable).
        Unlike diffusers' from_pipe, which casts the shared components to float32 unless told otherwise (and so
        changes the source pipeline too), the dtype stays the source transformer's unless dtype is given.
        enhance_prompt: as in from_pretrained."""
        config = FastConfig.coerce(fast_config)
        enhancer = resolve_enhancer(enhance_prompt, device)
        if "torch_dtype" not in kwargs:
            kwargs.setdefault("dtype", pipeline.transformer.dtype)
        return convert(QwenImagePipeline.from_pipe(pipeline, **kwargs), config, device, enhancer)

    # ---- what ran

    @property
    def applied(self) -> list[str]:
        """After a call: what that call ran. Before the first: what is in force and will run when a call allows it
        (batched_cfg needs CFG, cuda_graphs a CUDA device and no offload hooks)."""
        if self._ran is not None:
            return list(self._ran)
        config = self.fast_config
        parallel = self.parallel.applied() if self.parallel is not None else []
        return (self._transformer_entries() + self._memory_entries(self._uses_table()) + parallel
                + (["batched_cfg"] if config.batched_cfg and "parallel:cfg2" not in parallel else [])
                + (["cuda_graphs"] if self._graphs_usable() else []) + self._sampler_entries()
                + ([f"cfg_fraction:{config.cfg_fraction:g}"] if config.cfg_fraction < 1 else [])
                + (["enhance_prompt"] if self.prompt_enhancer is not None else [])
                + (["vae_2d_decode"] if config.vae_2d_decode else []))

    @property
    def text_encoder_takes_turns(self) -> bool:
        """memory="low": encoding brings the text encoder onto the GPU in place of the transformer's block linears
        (and the next denoising call brings those back), so encode every prompt of a batch first."""
        return self._turns is not None

    def to(self, *args, **kwargs):
        """diffusers' DiffusionPipeline.to; refused with memory="low", which places the components itself."""
        if self._turns is not None:
            raise ValueError("pipe.to(...) with FastConfig(memory='low'): the pipeline places its components itself "
                             "(the text encoder and the transformer's block linears take turns on the GPU, the "
                             "modulation weights stay on the host); build it with device=... instead")
        return super().to(*args, **kwargs)

    def _uses_table(self) -> bool:
        """FastConfig.modulation_table, for the fast transformer; not under offload hooks, which bring the weights
        to the GPU only inside its forward (a table built outside it would be built where they wait)."""
        return (self.fast_config.modulation_table and isinstance(self.transformer, FastQwenImageTransformer)
                and not has_offload_hooks(self.transformer))

    def _memory_entries(self, table: bool) -> list[str]:
        return (["modulation_table"] if table else []) + (["memory:low"] if self._turns is not None else [])

    def _modulation_tables(self, timesteps, latents, guidance, both: bool, single: bool) -> dict[str, torch.Tensor]:
        """FastConfig.modulation_table: the tables of this call's forwards (modulation.py), "both" for the batched
        CFG ones (batch 2B), "single" for the others (batch B), each row what the loop passes for that step."""
        transformer = self.transformer
        if not self._uses_table():
            return {}
        steps = torch.stack([t.expand(latents.shape[0]).to(latents.dtype) / 1000 for t in timesteps])  # [N, B]
        rows = None if guidance is None else guidance.expand(len(timesteps), -1)
        scale = self._attention_kwargs.get("scale", 1.0)
        tables = {}
        if single:
            tables["single"] = transformer.modulation_table(steps, rows, lora_scale=scale)
        if both:
            tables["both"] = transformer.modulation_table(
                torch.cat([steps, steps], dim=1), None if rows is None else torch.cat([rows, rows], dim=1),
                lora_scale=scale)
        return tables

    def _get_qwen_prompt_embeds(self, *args, **kwargs):
        """diffusers' text encoding; with memory="low", the text encoder's turn on the GPU first."""
        if self._turns is not None:
            self._turns.use("text_encoder")
        return super()._get_qwen_prompt_embeds(*args, **kwargs)

    def _sampler_entries(self) -> list[str]:
        return [] if self.fast_config.scheduler == "euler" else [f"scheduler:{self.fast_config.scheduler}"]

    # ---- the call

    def _check_fast_inputs(self, prompt, negative_prompt, num_inference_steps, num_images_per_prompt):
        if isinstance(prompt, list) and not prompt:
            raise ValueError("prompt=[] is empty; pass a string or a non-empty list of strings")
        if isinstance(prompt, list) and isinstance(negative_prompt, list) and len(prompt) != len(negative_prompt):
            raise ValueError(f"negative_prompt has {len(negative_prompt)} entries but prompt has {len(prompt)}; "
                             "pass one negative prompt per prompt, or a single string for all")
        if not isinstance(num_inference_steps, int) or num_inference_steps < 1:
            raise ValueError(f"num_inference_steps={num_inference_steps!r}; allowed: an integer >= 1")
        if not isinstance(num_images_per_prompt, int) or num_images_per_prompt < 1:
            raise ValueError(f"num_images_per_prompt={num_images_per_prompt!r}; allowed: an integer >= 1")

    def _enhance(self, prompt, prompt_embeds):
        """`prompt` rewritten by the prompt enhancer when there is one (and no prompt_embeds), else as given."""
        self.last_enhanced_prompts = None
        if self.prompt_enhancer is None or prompt is None or prompt_embeds is not None:
            return prompt
        enhanced = self.prompt_enhancer.enhance(prompt)
        given = 1 if isinstance(prompt, str) else len(prompt)
        if len(enhanced) != given:
            raise ValueError(f"the prompt enhancer returned {len(enhanced)} prompts for the {given} it was given")
        self.last_enhanced_prompts = enhanced
        return enhanced[0] if isinstance(prompt, str) else enhanced

    def _text_inputs(self, embeds: list[torch.Tensor], masks: list[torch.Tensor | None], bucket: int) -> dict:
        """Text embeddings of one or more prompt sets, concatenated along the batch and padded to one length: the
        longest, rounded up to `bucket` (the graph bucket; 1 without graphs). The padding is masked."""
        length = math.ceil(max(e.shape[1] for e in embeds) / bucket) * bucket
        padded = [pad_text(e, m, length) for e, m in zip(embeds, masks)]
        return dict(encoder_hidden_states=torch.cat([e for e, _ in padded]),
                    encoder_hidden_states_mask=drop_all_ones(torch.cat([m for _, m in padded])))

    def _forward(self, use_graphs: bool, context: str, **kwargs) -> torch.Tensor:
        """One transformer forward: replayed from a CUDA graph when use_graphs, else eager under cache_context."""
        if use_graphs and self._graphs is not None:
            try:
                return self._graphs(return_dict=False, **kwargs)[0]
            except GraphCaptureError as e:
                logger.warning("CUDA graph capture failed, running the transformer eagerly: %s", e.__cause__ or e)
                self._graphs = None
        with self.transformer.cache_context(context):
            return self.transformer(return_dict=False, **kwargs)[0]

    @torch.no_grad()
    def __call__(
        self,
        prompt: str | list[str] = None,
        negative_prompt: str | list[str] = None,
        true_cfg_scale: float = 4.0,
        height: int | None = None,
        width: int | None = None,
        num_inference_steps: int = 50,
        sigmas: list[float] | None = None,
        guidance_scale: float | None = None,
        num_images_per_prompt: int = 1,
        generator: torch.Generator | list[torch.Generator] | None = None,
        latents: torch.Tensor | None = None,
        prompt_embeds: torch.Tensor | None = None,
        prompt_embeds_mask: torch.Tensor | None = None,
        negative_prompt_embeds: torch.Tensor | None = None,
        negative_prompt_embeds_mask: torch.Tensor | None = None,
        output_type: str | None = "pil",
        return_dict: bool = True,
        attention_kwargs: dict | None = None,
        callback_on_step_end=None,
        callback_on_step_end_tensor_inputs: list[str] = ["latents"],  # noqa: B006 (diffusers' signature)
        max_sequence_length: int = 512,
    ):
        """Same arguments, defaults and output as QwenImagePipeline.__call__ (see its documentation)."""
        config = self.fast_config
        height = height or self.default_sample_size * self.vae_scale_factor
        width = width or self.default_sample_size * self.vae_scale_factor

        # 1. Check inputs. Raise error if not correct
        self._check_fast_inputs(prompt, negative_prompt, num_inference_steps, num_images_per_prompt)
        self.check_inputs(
            prompt, height, width, negative_prompt=negative_prompt, prompt_embeds=prompt_embeds,
            negative_prompt_embeds=negative_prompt_embeds, prompt_embeds_mask=prompt_embeds_mask,
            negative_prompt_embeds_mask=negative_prompt_embeds_mask,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
            max_sequence_length=max_sequence_length,
        )
        prompt = self._enhance(prompt, prompt_embeds)
        self._guidance_scale = guidance_scale
        self._attention_kwargs = attention_kwargs or {}
        self._current_timestep = None
        self._interrupt = False

        # 2. Define call parameters
        if prompt is not None:
            batch_size = 1 if isinstance(prompt, str) else len(prompt)
        else:
            batch_size = prompt_embeds.shape[0]
        if isinstance(prompt, list) and isinstance(negative_prompt, str):
            negative_prompt = [negative_prompt] * batch_size
        device = self._execution_device

        has_neg_prompt = negative_prompt is not None or negative_prompt_embeds is not None
        if true_cfg_scale > 1 and not has_neg_prompt:
            logger.warning(f"true_cfg_scale is passed as {true_cfg_scale}, but classifier-free guidance is not "
                           "enabled since no negative_prompt is provided.")
        elif true_cfg_scale <= 1 and has_neg_prompt:
            logger.warning(" negative_prompt is passed but classifier-free guidance is not enabled since "
                           "true_cfg_scale <= 1")
        do_true_cfg = true_cfg_scale > 1 and has_neg_prompt
        mesh = self.parallel
        cfg_parallel = mesh is not None and mesh.shape.cfg > 1
        if cfg_parallel and not do_true_cfg:
            raise ValueError(f"FastConfig(parallel={config.parallel!r}) runs the prompt and the negative prompt on two "
                             f"ranks, which needs CFG: true_cfg_scale > 1 (got {true_cfg_scale}) and a negative "
                             "prompt; without CFG use parallel='ulysses'")

        # 3. Encode the prompts
        prompt_embeds, prompt_embeds_mask = self.encode_prompt(
            prompt=prompt, prompt_embeds=prompt_embeds, prompt_embeds_mask=prompt_embeds_mask, device=device,
            num_images_per_prompt=num_images_per_prompt, max_sequence_length=max_sequence_length,
        )
        if do_true_cfg:
            negative_prompt_embeds, negative_prompt_embeds_mask = self.encode_prompt(
                prompt=negative_prompt, prompt_embeds=negative_prompt_embeds,
                prompt_embeds_mask=negative_prompt_embeds_mask, device=device,
                num_images_per_prompt=num_images_per_prompt, max_sequence_length=max_sequence_length,
            )

        # 4. Prepare latent variables
        num_channels_latents = self.transformer.config.in_channels // 4
        latents = self.prepare_latents(batch_size * num_images_per_prompt, num_channels_latents, height, width,
                                       prompt_embeds.dtype, device, generator, latents)
        if mesh is not None:
            latents = mesh.broadcast_latents(latents.contiguous())
        img_shapes = [[(1, height // self.vae_scale_factor // 2, width // self.vae_scale_factor // 2)]] * batch_size

        # 5. Prepare timesteps: the sampler of this call, from the pipeline's scheduler as it is now
        sampler = self.sampler = make_scheduler(config.scheduler, self.scheduler)
        mu = dynamic_shift(self.scheduler.config, latents.shape[1])
        timesteps, num_inference_steps = set_timesteps(sampler, config.scheduler, num_inference_steps, sigmas, mu,
                                                       device)
        num_warmup_steps = max(len(timesteps) - num_inference_steps * sampler.order, 0)
        self._num_timesteps = len(timesteps)

        # handle guidance
        if self.transformer.config.guidance_embeds and guidance_scale is None:
            raise ValueError("guidance_scale is required for guidance-distilled model.")
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.full([1], guidance_scale, device=device, dtype=torch.float32).expand(latents.shape[0])
        elif guidance_scale is not None:
            logger.warning(f"guidance_scale is passed as {guidance_scale}, but ignored since the model is not "
                           "guidance-distilled.")

        # Text conditioning, padded to one length (rounded up to the graph bucket when graphs replay): cond, and
        # with CFG [cond; uncond] in one batch (batched) or uncond on its own. Rebuilt if a callback changes it.
        if self._turns is not None:  # the block linears' turn on the GPU (the text encoder's ends)
            self._turns.use("transformer")
        use_graphs = (self._graphs is not None and latents.is_cuda and not has_offload_hooks(self.transformer))
        if use_graphs:
            self._graphs.drop_if_weights_moved()
        bucket = config.text_bucket if use_graphs else 1
        batched = do_true_cfg and config.batched_cfg and not cfg_parallel

        def text_inputs(prompt_embeds):
            inputs = {"cond": self._text_inputs([prompt_embeds], [prompt_embeds_mask], bucket)}
            if batched:
                inputs["both"] = self._text_inputs([prompt_embeds, negative_prompt_embeds],
                                                   [prompt_embeds_mask, negative_prompt_embeds_mask], bucket)
            elif do_true_cfg:
                inputs["uncond"] = self._text_inputs([negative_prompt_embeds], [negative_prompt_embeds_mask], bucket)
            return inputs

        text = text_inputs(prompt_embeds)
        cfg_steps = math.ceil(config.cfg_fraction * len(timesteps)) if do_true_cfg else 0
        tables = self._modulation_tables(timesteps, latents, guidance, batched and cfg_steps > 0,
                                         not batched or cfg_steps < len(timesteps))

        # 6. Denoising loop
        sampler.set_begin_index(0)
        with self.progress_bar(total=num_inference_steps) as progress_bar:
            for i, t in enumerate(timesteps):
                if self.interrupt:
                    continue
                self._current_timestep = t
                timestep = t.expand(latents.shape[0]).to(latents.dtype)
                common = dict(timestep=timestep / 1000, guidance=guidance, img_shapes=img_shapes,
                              attention_kwargs=self._attention_kwargs)
                if "single" in tables:
                    common["modulation"] = tables["single"][i]
                cfg_now = i < cfg_steps
                if cfg_now and cfg_parallel:  # this rank's half, then both halves on both ranks
                    half = "cond" if mesh.cfg_rank == 0 else "uncond"
                    noise_pred, neg_noise_pred = mesh.gather_cfg(self._forward(
                        use_graphs, half, hidden_states=latents, **common, **text[half]))
                elif cfg_now and batched:
                    twice = dict(common, timestep=torch.cat([common["timestep"]] * 2), img_shapes=img_shapes * 2,
                                 guidance=None if guidance is None else torch.cat([guidance] * 2))
                    if "both" in tables:
                        twice["modulation"] = tables["both"][i]
                    noise_pred, neg_noise_pred = self._forward(
                        use_graphs, "cond_uncond", hidden_states=torch.cat([latents, latents]), **twice,
                        **text["both"]).chunk(2)
                else:
                    noise_pred = self._forward(use_graphs, "cond", hidden_states=latents, **common, **text["cond"])
                    if cfg_now:
                        neg_noise_pred = self._forward(use_graphs, "uncond", hidden_states=latents, **common,
                                                       **text["uncond"])
                if cfg_now:
                    comb_pred = neg_noise_pred + true_cfg_scale * (noise_pred - neg_noise_pred)
                    cond_norm = torch.norm(noise_pred, dim=-1, keepdim=True)
                    noise_norm = torch.norm(comb_pred, dim=-1, keepdim=True)
                    noise_pred = comb_pred * (cond_norm / noise_norm)

                # compute the previous noisy sample x_t -> x_t-1
                latents = sampler.step(noise_pred, t, latents, return_dict=False)[0]

                if callback_on_step_end is not None:  # as the stock pipeline: latents and prompt_embeds are taken back
                    values = dict(latents=latents, prompt_embeds=prompt_embeds)
                    callback_kwargs = {k: values[k] for k in callback_on_step_end_tensor_inputs}
                    callback_outputs = callback_on_step_end(self, i, t, callback_kwargs)
                    latents = callback_outputs.pop("latents", latents)
                    new_embeds = callback_outputs.pop("prompt_embeds", prompt_embeds)
                    if new_embeds is not prompt_embeds:
                        prompt_embeds, text = new_embeds, text_inputs(new_embeds)

                if i == len(timesteps) - 1 or ((i + 1) > num_warmup_steps and (i + 1) % sampler.order == 0):
                    progress_bar.update()

        self._current_timestep = None
        parallel = [entry for entry in (mesh.applied() if mesh is not None else [])
                    if entry != "parallel:cfg2" or cfg_steps]
        self._ran = (self._transformer_entries() + self._memory_entries(bool(tables)) + parallel
                     + (["batched_cfg"] if batched and cfg_steps else [])
                     + (["cuda_graphs"] if use_graphs and self._graphs is not None else [])
                     + self._sampler_entries()
                     + ([f"cfg_fraction:{config.cfg_fraction:g}"] if do_true_cfg and config.cfg_fraction < 1 else [])
                     + (["enhance_prompt"] if self.last_enhanced_prompts is not None else []))

        # 7. Decode
        if output_type == "latent":
            image = latents
        else:
            image, decoded_2d = self._decode(latents, height, width, output_type)
            self._ran += ["vae_2d_decode"] if decoded_2d else []
        self.maybe_free_model_hooks()
        if not return_dict:
            return (image,)
        return QwenImagePipelineOutput(images=image)

    def decode_latents(self, latents, height, width, output_type):
        """Packed latents -> images, as the stock pipeline decodes them."""
        return self._decode(latents, height, width, output_type)[0]

    @torch.no_grad()
    def _decode(self, latents, height, width, output_type):
        """(images, whether the VAE ran as 2D convolutions: FastConfig.vae_2d_decode, vae.py)."""
        latents = self._unpack_latents(latents, height, width, self.vae_scale_factor).to(self.vae.dtype)
        z_dim = self.vae.config.z_dim
        mean = torch.tensor(self.vae.config.latents_mean).view(1, z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        inv_std = 1.0 / torch.tensor(self.vae.config.latents_std).view(1, z_dim, 1, 1, 1).to(latents.device,
                                                                                               latents.dtype)
        latents = latents / inv_std + mean
        decoded_2d = self.fast_config.vae_2d_decode and can_decode_image(self.vae, latents, has_offload_hooks(self.vae))
        image = decode_image(self.vae, latents) if decoded_2d else self.vae.decode(latents, return_dict=False)[0]
        return self.image_processor.postprocess(image[:, :, 0], output_type=output_type), decoded_2d


def check_parallel_setup(config: FastConfig, path_or_id=None):
    """FastConfig.parallel's errors that need no model: no process group, degrees that do not divide the world
    size or (read from the checkpoint's transformer config when path_or_id is given) the head count."""
    if config.parallel != "none":
        MeshShape.of_group(config.parallel, config.ulysses_degree,
                           None if path_or_id is None else checkpoint_heads(path_or_id))


def checkpoint_heads(path_or_id) -> int | None:
    """The attention heads of a checkpoint's transformer, from its config alone (None when it cannot be read
    without loading: diffusers' loader reports a missing checkpoint itself, and the mesh checks again once loaded)."""
    from diffusers import QwenImageTransformer2DModel

    try:
        return QwenImageTransformer2DModel.load_config(path_or_id, subfolder="transformer")["num_attention_heads"]
    except (OSError, KeyError, ValueError):
        return None


def convert(pipe: QwenImagePipeline, config: FastConfig, device, enhancer) -> QwenImageFastPipeline:
    """A QwenImagePipeline -> QwenImageFastPipeline in place (its class and fast state; the transformer converted
    unless it is a FastQwenImageTransformer already)."""
    pipe.__class__ = QwenImageFastPipeline
    try:
        pipe._set_up(config, device, enhancer)
    except BaseException:
        pipe.__class__ = QwenImagePipeline  # a failed conversion leaves the pipeline as it was
        raise
    return pipe


def optimize(pipe, config: FastConfig | str | None = None, device=None, enhance_prompt=None):
    """Convert `pipe` (a diffusers QwenImagePipeline) into a QwenImageFastPipeline in place and return it; one of
    the image-conditioned pipelines in family.ACCELERATED keeps its own __call__ with the fast transformer
    (family.py). Any other pipeline: TypeError naming the supported ones.

    config: a FastConfig, a preset name ("fast", "baseline") or None (= "fast"). device: where the fused
    transformer is built (default: where pipe.transformer is); build from a CPU pipeline straight onto the GPU
    to never hold two BF16 copies there. enhance_prompt: rewrite each prompt with a local Qwen3.5 before encoding
    it (see resolve_enhancer; a loaded enhancer runs on `device`, or on CUDA when available if device is None)."""
    config = FastConfig.coerce(config)
    if isinstance(pipe, FastTransformerPipeline):
        raise ValueError("this pipeline is already optimized; call optimize() on a fresh diffusers pipeline")
    if type(pipe) is not QwenImagePipeline:
        from .family import check_family, is_accelerated, optimize_family

        if is_accelerated(pipe):
            return optimize_family(pipe, config, device, enhance_prompt)
        check_family(pipe)
    return convert(pipe, config, device, resolve_enhancer(enhance_prompt, device))
