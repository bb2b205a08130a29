"""QwenImageFastPipeline: diffusers' QwenImagePipeline with the fast path inside, same call and output.

Its denoising loop is ours (diffusers' steps, numbered as upstream's); what differs from stock is switched by
FastConfig (core/optimizations.py declares each; `pipe.applied` says which ran):
- the fused transformer and the VAE's 2D decode (fast_pipeline.py builds them);
- batched CFG and CUDA graphs, through the runner (core/runtime/runner.py), as in the image-conditioned pipelines;
- the sampler: the pipeline's own scheduler (default; replacing `pipe.scheduler` works as in stock), or
  DPM-Solver++ 2M / UniPC derived from it at call time, driven with the same dynamic shift mu (samplers.py);
- selective CFG (cfg_fraction): guidance only on the first fraction of the steps;
- the modulation table (model/modulation.py): every step's modulation computed once per schedule;
- memory="low" (core/runtime/memory.py): the text encoder and the block linears take turns on the GPU;
- one image on several processes (FastConfig.parallel, core/runtime/parallel.py): with CFG-parallel each rank of a pair
  runs one of prompt / negative prompt and one all-gather per step gives both predictions to both; with Ulysses
  the transformer splits the sequence over its group (the forward context carries it). Every rank steps the same
  latents (the image group's first rank's starting noise) and returns the same images.
Text encoding, latent preparation and callbacks are diffusers' own.

Prompt enhancement (off by default; `enhance_prompt=`): a local Qwen3.5 (PromptEnhancer) rewrites `prompt` into a
detailed one before it is encoded; the negative prompt and prompt_embeds are left alone.
"""

import logging
import math

import torch
from diffusers import QwenImagePipeline
from diffusers.pipelines.qwenimage.pipeline_output import QwenImagePipelineOutput

from ..core.config import QWEN_IMAGE_2512_SHAPE, STREAMING_MIN_GIB, FastConfig
from ..core.pipeline.turns import TurnTakingPipeline
from ..core.optimizations import memory_label
from ..core.prompt_enhancer import resolve_enhancer
from .fast_pipeline import FastPipelineMixin
from ..core.runtime.memory import check_within_plan, place_low_memory
from ..core.runtime.parallel import MeshShape, ParallelMesh
from .samplers import check_not_one_step, dynamic_shift, fewest_steps, make_scheduler, set_timesteps

logger = logging.getLogger(__name__)


def drop_all_ones(mask: torch.Tensor | None) -> torch.Tensor | None:
    """An all-valid mask becomes None, as diffusers' encode_prompt does (one host sync per call, before the loop)."""
    return None if mask is None or bool(mask.all()) else mask


def checkpoint_config(path_or_id) -> dict | None:
    """A checkpoint's transformer config, read alone (None when it cannot be read without loading: diffusers'
    loader reports a missing checkpoint itself, and what is checked from it is checked again once loaded)."""
    from diffusers import QwenImageTransformer2DModel

    try:
        return QwenImageTransformer2DModel.load_config(path_or_id, subfolder="transformer")
    except (OSError, ValueError):
        return None


def checkpoint_heads(path_or_id) -> int | None:
    """The attention heads of a checkpoint's transformer, from its config alone (None where it cannot be read)."""
    return (checkpoint_config(path_or_id) or {}).get("num_attention_heads")


def check_budget_before_loading(config: FastConfig, path_or_id):
    """FastConfig(max_memory_gib=...) below what a Qwen-Image-2512-size model needs streamed: refused before its
    weights load (another size is checked once placed: runtime/memory.py)."""
    transformer = checkpoint_config(path_or_id) if config.max_memory_gib is not None and path_or_id else None
    if transformer is None:
        return
    shape = (transformer.get("num_attention_heads", 0) * transformer.get("attention_head_dim", 0),
             transformer.get("num_layers"))
    if shape == QWEN_IMAGE_2512_SHAPE and config.max_memory_gib < STREAMING_MIN_GIB:
        raise ValueError(f"max_memory_gib={config.max_memory_gib:g} is too small for {path_or_id}: it needs at least "
                         f"{STREAMING_MIN_GIB:g} GiB (its blocks and text encoder layers streamed; "
                         "benchmarks/RESULTS.md, 'Running in 16 GiB and 12 GiB')")


def check_parallel_setup(config: FastConfig, path_or_id=None):
    """FastConfig.parallel's errors that need no model: no process group, degrees that do not divide the world
    size or (read from the checkpoint's transformer config when path_or_id is given) the head count."""
    if config.parallel != "none":
        MeshShape.of_group(config.parallel, config.ulysses_degree,
                           None if path_or_id is None else checkpoint_heads(path_or_id))


class QwenImageFastPipeline(TurnTakingPipeline, FastPipelineMixin, QwenImagePipeline):
    """Drop-in for QwenImagePipeline: `QwenImageFastPipeline(**components, fast_config=...)` (diffusers' constructor,
    converts a stock transformer where it is), `from_pretrained(..., fast_config=..., device=...)`, `from_pipe(pipe)`
    or `qwen_image_fast.optimize(pipe)`. `fast_config` says what was asked for, `applied` what ran."""

    stock_class = QwenImagePipeline
    prompt_enhancer = None  # a PromptEnhancer, or None: prompts are encoded as given
    last_enhanced_prompts: list[str] | None = None  # the rewrites of the last call (None when there were none)
    sampler = None  # the scheduler the last call stepped with: pipe.scheduler itself, or one derived from it
    parallel: ParallelMesh | None = None  # the process groups of FastConfig.parallel

    def __init__(self, scheduler, vae, text_encoder, tokenizer, transformer, fast_config: FastConfig | str | None = None,
                 enhance_prompt=None):
        super().__init__(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                         transformer=transformer)
        self._set_up(FastConfig.coerce(fast_config), None, enhancer=resolve_enhancer(enhance_prompt))

    def _set_up_pipeline(self, config: FastConfig, device, enhancer=None):
        self.parallel = (None if config.parallel == "none" else
                         ParallelMesh.build(config.parallel, config.ulysses_degree,
                                            None if self.transformer is None else
                                            self.transformer.config.num_attention_heads))
        self.prompt_enhancer = enhancer
        self.last_enhanced_prompts = None
        self.sampler = None
        self._turns = (place_low_memory(self, torch.device(device) if device is not None else self.transformer.device,
                                        config.max_memory_gib) if config.memory == "low" else None)

    @classmethod
    def _before_loading(cls, config: FastConfig, path_or_id, device, kwargs: dict) -> dict:
        check_parallel_setup(config, path_or_id)  # before any weight is loaded
        check_budget_before_loading(config, path_or_id)
        return {"enhancer": resolve_enhancer(kwargs.pop("enhance_prompt", None), device)}

    def _parallel_labels(self) -> tuple[str, ...]:
        if self.parallel is None:
            return ()
        shape = self.parallel.shape
        return ((("cfg2",) if shape.cfg > 1 else ()) + ((f"ulysses{shape.ulysses}",) if shape.ulysses > 1 else ()))

    def _modulation_tables(self, timesteps, latents, guidance, scale: float, both: bool,
                           single: bool) -> dict[str, torch.Tensor]:
        """The modulation tables of this call's forwards (model/modulation.py): "both" for the batched CFG ones
        (batch 2B), "single" for the others (batch B), each row what the loop passes for that step."""
        transformer = self.transformer
        steps = torch.stack([t.expand(latents.shape[0]).to(latents.dtype) / 1000 for t in timesteps])  # [N, B]
        rows = None if guidance is None else guidance.expand(len(timesteps), -1)
        tables = {}
        if single:
            tables["single"] = transformer.modulation_table(steps, rows, lora_scale=scale)
        if both:
            tables["both"] = transformer.modulation_table(
                torch.cat([steps, steps], dim=1), None if rows is None else torch.cat([rows, rows], dim=1),
                lora_scale=scale)
        return tables

    # ---- the call

    def _check_fast_inputs(self, prompt, negative_prompt, num_inference_steps, num_images_per_prompt):
        if isinstance(prompt, list) and not prompt:
            raise ValueError("prompt=[] is empty; pass a string or a non-empty list of strings")
        if isinstance(prompt, list) and isinstance(negative_prompt, list) and len(prompt) != len(negative_prompt):
            raise ValueError(f"negative_prompt has {len(negative_prompt)} entries but prompt has {len(prompt)}; "
                             "pass one negative prompt per prompt, or a single string for all")
        if not isinstance(num_inference_steps, int) or num_inference_steps < 1:
            least = fewest_steps(self.scheduler)
            raise ValueError(f"num_inference_steps={num_inference_steps!r}; allowed: an integer >= {least}"
                             + (" (this scheduler's shift_terminal refuses 1 step too)" if least == 2 else ""))
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
        check_not_one_step(self.scheduler, num_inference_steps, sigmas)
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
        if config.max_memory_gib is not None and self._turns is not None:
            steps = len(sigmas) if sigmas is not None else num_inference_steps
            check_within_plan(config.max_memory_gib, batch_size * num_images_per_prompt, height, width, steps)
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
        prompt_embeds_mask = drop_all_ones(prompt_embeds_mask)
        if do_true_cfg:
            negative_prompt_embeds, negative_prompt_embeds_mask = self.encode_prompt(
                prompt=negative_prompt, prompt_embeds=negative_prompt_embeds,
                prompt_embeds_mask=negative_prompt_embeds_mask, device=device,
                num_images_per_prompt=num_images_per_prompt, max_sequence_length=max_sequence_length,
            )
            negative_prompt_embeds_mask = drop_all_ones(negative_prompt_embeds_mask)

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

        if self._turns is not None:  # the block linears' turn on the GPU (the text encoder's ends)
            self._turns.use("transformer")
        facts = self.facts()
        will_run = self.will_run(facts)
        batched = do_true_cfg and will_run["batched_cfg"]
        cfg_steps = math.ceil(config.cfg_fraction * len(timesteps)) if do_true_cfg else 0
        scale = self._attention_kwargs.get("scale", 1.0)
        tables = (self._modulation_tables(timesteps, latents, guidance, scale, batched and cfg_steps > 0,
                                          not batched or cfg_steps < len(timesteps))
                  if will_run["modulation_table"] else {})
        context = dict(lora_scale=float(scale), ulysses=mesh.ulysses() if mesh is not None else None,
                       weights_take_turns=self._turns is not None)

        # 6. Denoising loop (and 7. the decode: the runner's call records what both ran)
        sampler.set_begin_index(0)
        with self._fast_call(self._attention_kwargs, will_run, facts, **context) as run:
            with self.progress_bar(total=num_inference_steps) as progress_bar:
                for i, t in enumerate(timesteps):
                    if self.interrupt:
                        continue
                    self._current_timestep = t
                    timestep = t.expand(latents.shape[0]).to(latents.dtype)
                    cond = dict(hidden_states=latents, encoder_hidden_states=prompt_embeds,
                                encoder_hidden_states_mask=prompt_embeds_mask, timestep=timestep / 1000,
                                img_shapes=img_shapes, guidance=guidance, controlnet_block_samples=None,
                                additional_t_cond=None, modulation=tables["single"][i] if "single" in tables else None)
                    cfg_now = i < cfg_steps
                    uncond = dict(cond, encoder_hidden_states=negative_prompt_embeds,
                                  encoder_hidden_states_mask=negative_prompt_embeds_mask) if cfg_now else None
                    if cfg_now and cfg_parallel:  # this rank's half, then both halves on both ranks
                        half = "cond" if mesh.cfg_rank == 0 else "uncond"
                        noise_pred, neg_noise_pred = mesh.gather_cfg(
                            run.forward(half, **(cond if half == "cond" else uncond)))
                    elif cfg_now and batched:
                        pair_row = tables["both"][i] if "both" in tables else None
                        noise_pred, neg_noise_pred = run.pair(cond, negative_prompt_embeds,
                                                              negative_prompt_embeds_mask, pair_row)
                    else:
                        noise_pred = run.forward("cond", **cond)
                        if cfg_now:
                            neg_noise_pred = run.forward("uncond", **uncond)
                    if cfg_now:
                        comb_pred = neg_noise_pred + true_cfg_scale * (noise_pred - neg_noise_pred)
                        cond_norm = torch.norm(noise_pred, dim=-1, keepdim=True)
                        noise_norm = torch.norm(comb_pred, dim=-1, keepdim=True)
                        noise_pred = comb_pred * (cond_norm / noise_norm)

                    # compute the previous noisy sample x_t -> x_t-1
                    latents = sampler.step(noise_pred, t, latents, return_dict=False)[0]

                    if callback_on_step_end is not None:  # as stock: latents and prompt_embeds are taken back
                        values = dict(latents=latents, prompt_embeds=prompt_embeds)
                        callback_kwargs = {k: values[k] for k in callback_on_step_end_tensor_inputs}
                        callback_outputs = callback_on_step_end(self, i, t, callback_kwargs)
                        latents = callback_outputs.pop("latents", latents)
                        prompt_embeds = callback_outputs.pop("prompt_embeds", prompt_embeds)

                    if i == len(timesteps) - 1 or ((i + 1) > num_warmup_steps and (i + 1) % sampler.order == 0):
                        progress_bar.update()
            self._record_loop(run.record, tables, cfg_steps, do_true_cfg)
            self._current_timestep = None

            # 7. Decode
            image = latents if output_type == "latent" else self.decode_latents(latents, height, width, output_type)
        self.maybe_free_model_hooks()
        if not return_dict:
            return (image,)
        return QwenImagePipelineOutput(images=image)

    def _record_loop(self, record, tables: dict, cfg_steps: int, do_true_cfg: bool):
        """What the loop itself ran (the runner and the transformer record theirs)."""
        config = self.fast_config
        if tables:
            record.add("modulation_table")
        if self._turns is not None:
            record.add("memory", memory_label(config))
        for label in self._parallel_labels():
            if label != "cfg2" or cfg_steps:
                record.add("parallel", label)
        if config.scheduler != "euler":
            record.add("scheduler", config.scheduler)
        if do_true_cfg and config.cfg_fraction < 1:
            record.add("cfg_fraction", f"{config.cfg_fraction:g}")
        if self.last_enhanced_prompts is not None:
            record.add("enhance_prompt")

    def decode_latents(self, latents, height, width, output_type):
        """Packed latents -> images, as the stock pipeline decodes them."""
        return decode_latents(self, latents, height, width, output_type)


@torch.no_grad()
def decode_latents(pipe, latents, height, width, output_type):
    """The stock QwenImagePipeline's decode steps (unpack, denormalize, VAE, postprocess) with `pipe`'s VAE: a
    FastAutoencoderKLQwenImage decodes an image as 2D convolutions, a stock VAE as diffusers does."""
    latents = pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor).to(pipe.vae.dtype)
    z_dim = pipe.vae.config.z_dim
    mean = torch.tensor(pipe.vae.config.latents_mean).view(1, z_dim, 1, 1, 1).to(latents.device, latents.dtype)
    inv_std = 1.0 / torch.tensor(pipe.vae.config.latents_std).view(1, z_dim, 1, 1, 1).to(latents.device,
                                                                                         latents.dtype)
    latents = latents / inv_std + mean
    image = pipe.vae.decode(latents, return_dict=False)[0][:, :, 0]
    return pipe.image_processor.postprocess(image, output_type=output_type)
