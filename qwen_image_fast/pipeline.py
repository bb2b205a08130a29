"""QwenImageFastPipeline: diffusers' QwenImagePipeline with the fast path inside, same call and output.

Differences from the stock denoising loop, each switched by a FastConfig field (pipe.applied says which ran):
- batched CFG: prompt and negative prompt go through one transformer forward of batch 2N; both texts are padded
  to one length and the padding is masked (never attended); Qwen's norm-rescaled combination is unchanged;
- the sampler: the checkpoint's FlowMatchEuler (default), DPM-Solver++ 2M or UniPC, driven with the same
  dynamic shift mu as the stock pipeline (DPM-Solver++ gets no `sigmas`: its set_timesteps has no such argument);
- CUDA graphs: the transformer forward replays from a graph per (resolution, batch, text-length bucket);
- selective CFG (lossy, off by default): guidance only on the first `cfg_fraction` of the steps.
Text encoding, latent preparation and VAE decoding are diffusers' own.

Prompt enhancement (off by default; `enhance_prompt=` of from_pretrained / from_pipe / optimize): a local Qwen3.5
(PromptEnhancer) rewrites `prompt` into a detailed one before it is encoded; the negative prompt and prompt_embeds
are left alone. `pipe.last_enhanced_prompts` holds the rewrites of the last call (None when there were none).

Sizes: like diffusers, height and width that are not multiples of 16 are rounded down to one (with a warning).
"""

import contextlib
import logging
import math

import numpy as np
import torch
from diffusers import QwenImagePipeline
from diffusers.pipelines.qwenimage.pipeline_output import QwenImagePipelineOutput
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps

from .config import FastConfig
from .optimize import optimize
from .pipelines.qwen_image.cuda_graph import GraphCaptureError

logger = logging.getLogger(__name__)


def pad_text(embeds: torch.Tensor, mask: torch.Tensor | None, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """embeds [N, L, D] and mask [N, L] (None: all valid) -> zero-padded to `length`, with the padding masked."""
    n, seq, _ = embeds.shape
    if mask is None:
        mask = torch.ones(n, seq, dtype=torch.long, device=embeds.device)
    pad = length - seq
    return torch.nn.functional.pad(embeds, (0, 0, 0, pad)), torch.nn.functional.pad(mask, (0, pad))


def drop_all_ones(mask: torch.Tensor | None) -> torch.Tensor | None:
    """An all-valid mask becomes None, as diffusers' encode_prompt does (one host sync per call, before the loop)."""
    return None if mask is None or bool(mask.all()) else mask


class QwenImageFastPipeline(QwenImagePipeline):
    """Drop-in for QwenImagePipeline. Build with `from_pretrained(..., fast_config=...)`, `from_pipe(pipe)` or
    `qwen_image_fast.optimize(pipe)`; `fast_config` and `applied` say what was asked for and what ran."""

    fast_config: FastConfig
    applied: list[str]
    prompt_enhancer = None  # a PromptEnhancer, or None: prompts are encoded as given
    last_enhanced_prompts: list[str] | None = None

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, fast_config=None, device=None, enhance_prompt=None,
                        **kwargs):
        """Loads the upstream checkpoint layout unchanged (hub id or local folder), then optimize().
        device: where the fused transformer is built (e.g. "cuda" from a CPU load: one BF16 copy, on the CPU).
        enhance_prompt: None / False (off), True (PromptEnhancer.from_pretrained()), a Qwen3.5 checkpoint's path or
        hub id, or a PromptEnhancer."""
        kwargs.setdefault("torch_dtype", torch.bfloat16)
        pipe = QwenImagePipeline.from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        return optimize(pipe, fast_config, device=device, enhance_prompt=enhance_prompt)

    @classmethod
    def from_pipe(cls, pipeline, fast_config=None, device=None, enhance_prompt=None, **kwargs):
        """A fast pipeline sharing `pipeline`'s components (its transformer is left as it is and stays usable).
        Unlike diffusers' from_pipe, which casts the shared components to float32 unless told otherwise (and so
        changes the source pipeline too), the dtype stays the source transformer's unless torch_dtype is given.
        enhance_prompt: as in from_pretrained."""
        kwargs.setdefault("torch_dtype", pipeline.transformer.dtype)
        pipe = QwenImagePipeline.from_pipe(pipeline, **kwargs)
        return optimize(pipe, fast_config, device=device, enhance_prompt=enhance_prompt)

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

    def _timesteps(self, num_inference_steps, sigmas, image_seq_len, device):
        """Timesteps from the configured sampler with the stock pipeline's dynamic shift mu."""
        base = self.scheduler.config
        mu = calculate_shift(image_seq_len, base.get("base_image_seq_len", 256), base.get("max_image_seq_len", 4096),
                             base.get("base_shift", 0.5), base.get("max_shift", 1.15))
        name = self.fast_config.scheduler
        if name == "dpm++2m":
            if sigmas is not None:
                raise ValueError("sigmas is not supported with scheduler='dpm++2m' (DPMSolverMultistepScheduler "
                                 "takes no sigmas); use 'euler' or 'unipc' for custom sigmas")
            self._sampler.set_timesteps(num_inference_steps, device=device, mu=mu)
            return self._sampler.timesteps, mu
        sigmas = np.linspace(1.0, 1 / num_inference_steps, num_inference_steps) if sigmas is None else sigmas
        timesteps, _ = retrieve_timesteps(self._sampler, num_inference_steps, device, sigmas=sigmas, mu=mu)
        return timesteps, mu

    def _forward(self, **kwargs) -> torch.Tensor:
        """One transformer forward: from the CUDA graph when enabled, else eager."""
        graphed = getattr(self, "_graphed_transformer", None)
        if graphed is not None and kwargs["hidden_states"].is_cuda:
            try:
                return graphed(return_dict=False, **kwargs)[0]
            except GraphCaptureError as e:
                logger.warning("CUDA graph capture failed, running the transformer eagerly: %s", e.__cause__ or e)
                self._graphed_transformer = None
                self.applied = [a for a in self.applied if a != "cuda_graphs"]
        context = getattr(self.transformer, "cache_context", None)
        with context("cond") if context else contextlib.nullcontext():
            return self.transformer(return_dict=False, **kwargs)[0]

    def _text_inputs(self, embeds: list[torch.Tensor], masks: list[torch.Tensor | None]) -> dict:
        """Text embeddings of one or more prompt sets, concatenated along the batch and padded to one length: the
        longest, rounded up to the graph bucket when graphs replay. The padding is masked."""
        length = max(e.shape[1] for e in embeds)
        if getattr(self, "_graphed_transformer", None) is not None:
            length = math.ceil(length / self.fast_config.text_bucket) * self.fast_config.text_bucket
        padded = [pad_text(e, m, length) for e, m in zip(embeds, masks)]
        return dict(encoder_hidden_states=torch.cat([e for e, _ in padded]),
                    encoder_hidden_states_mask=drop_all_ones(torch.cat([m for _, m in padded])))

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
        self._check_fast_inputs(prompt, negative_prompt, num_inference_steps, num_images_per_prompt)
        height = height or self.default_sample_size * self.vae_scale_factor
        width = width or self.default_sample_size * self.vae_scale_factor
        self.check_inputs(
            prompt, height, width, negative_prompt=negative_prompt, prompt_embeds=prompt_embeds,
            negative_prompt_embeds=negative_prompt_embeds, prompt_embeds_mask=prompt_embeds_mask,
            negative_prompt_embeds_mask=negative_prompt_embeds_mask,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
            max_sequence_length=max_sequence_length,
        )
        self.last_enhanced_prompts = None
        if self.prompt_enhancer is not None and prompt is not None and prompt_embeds is None:
            enhanced = self.prompt_enhancer.enhance(prompt)
            given = 1 if isinstance(prompt, str) else len(prompt)
            if len(enhanced) != given:
                raise ValueError(f"the prompt enhancer returned {len(enhanced)} prompts for the {given} it was given")
            self.last_enhanced_prompts = enhanced
            prompt = self.last_enhanced_prompts[0] if isinstance(prompt, str) else self.last_enhanced_prompts
        self._guidance_scale = guidance_scale
        self._attention_kwargs = attention_kwargs or {}
        self._current_timestep = None
        self._interrupt = False

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

        num_channels_latents = self.transformer.config.in_channels // 4
        latents = self.prepare_latents(batch_size * num_images_per_prompt, num_channels_latents, height, width,
                                       prompt_embeds.dtype, device, generator, latents)
        img_shapes = [[(1, height // self.vae_scale_factor // 2, width // self.vae_scale_factor // 2)]] * batch_size
        timesteps, _ = self._timesteps(num_inference_steps, sigmas, latents.shape[1], device)
        sampler = self._sampler
        num_warmup_steps = max(len(timesteps) - num_inference_steps * sampler.order, 0)
        self._num_timesteps = len(timesteps)

        if self.transformer.config.guidance_embeds and guidance_scale is None:
            raise ValueError("guidance_scale is required for guidance-distilled model.")
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.full([1], guidance_scale, device=device, dtype=torch.float32).expand(latents.shape[0])
        elif guidance_scale is not None:
            logger.warning(f"guidance_scale is passed as {guidance_scale}, but ignored since the model is not "
                           "guidance-distilled.")

        # Text conditioning. Batched CFG: [cond; uncond] padded to one length; else each on its own.
        batched = do_true_cfg and self.fast_config.batched_cfg
        cond = self._text_inputs([prompt_embeds], [prompt_embeds_mask])
        if batched:
            both = self._text_inputs([prompt_embeds, negative_prompt_embeds],
                                     [prompt_embeds_mask, negative_prompt_embeds_mask])
        elif do_true_cfg:
            uncond = self._text_inputs([negative_prompt_embeds], [negative_prompt_embeds_mask])
        cfg_steps = math.ceil(self.fast_config.cfg_fraction * len(timesteps)) if do_true_cfg else 0

        sampler.set_begin_index(0)
        with self.progress_bar(total=num_inference_steps) as progress_bar:
            for i, t in enumerate(timesteps):
                if self.interrupt:
                    continue
                self._current_timestep = t
                timestep = t.expand(latents.shape[0]).to(latents.dtype)
                common = dict(timestep=timestep / 1000, guidance=guidance, img_shapes=img_shapes,
                              attention_kwargs=self._attention_kwargs)
                cfg_now = i < cfg_steps
                if cfg_now and batched:
                    twice = dict(common, timestep=torch.cat([common["timestep"]] * 2), img_shapes=img_shapes * 2,
                                 guidance=None if guidance is None else torch.cat([guidance] * 2))
                    noise_pred, neg_noise_pred = self._forward(
                        hidden_states=torch.cat([latents, latents]), **twice, **both).chunk(2)
                else:
                    noise_pred = self._forward(hidden_states=latents, **common, **cond)
                    if cfg_now:
                        neg_noise_pred = self._forward(hidden_states=latents, **common, **uncond)
                if cfg_now:
                    comb_pred = neg_noise_pred + true_cfg_scale * (noise_pred - neg_noise_pred)
                    cond_norm = torch.norm(noise_pred, dim=-1, keepdim=True)
                    noise_norm = torch.norm(comb_pred, dim=-1, keepdim=True)
                    noise_pred = comb_pred * (cond_norm / noise_norm)

                latents = sampler.step(noise_pred, t, latents, return_dict=False)[0]

                if callback_on_step_end is not None:
                    values = dict(latents=latents, prompt_embeds=prompt_embeds)
                    callback_kwargs = {k: values[k] for k in callback_on_step_end_tensor_inputs}
                    callback_outputs = callback_on_step_end(self, i, t, callback_kwargs)
                    latents = callback_outputs.pop("latents", latents)
                    prompt_embeds = callback_outputs.pop("prompt_embeds", prompt_embeds)
                if i == len(timesteps) - 1 or ((i + 1) > num_warmup_steps and (i + 1) % sampler.order == 0):
                    progress_bar.update()

        self._current_timestep = None
        if output_type == "latent":
            image = latents
        else:
            image = self.decode_latents(latents, height, width, output_type)
        self.maybe_free_model_hooks()
        if not return_dict:
            return (image,)
        return QwenImagePipelineOutput(images=image)

    @torch.no_grad()
    def decode_latents(self, latents, height, width, output_type):
        """Packed latents -> images, as the stock pipeline decodes them."""
        latents = self._unpack_latents(latents, height, width, self.vae_scale_factor).to(self.vae.dtype)
        z_dim = self.vae.config.z_dim
        mean = torch.tensor(self.vae.config.latents_mean).view(1, z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        inv_std = 1.0 / torch.tensor(self.vae.config.latents_std).view(1, z_dim, 1, 1, 1).to(latents.device,
                                                                                               latents.dtype)
        latents = latents / inv_std + mean
        image = self.vae.decode(latents, return_dict=False)[0][:, :, 0]
        return self.image_processor.postprocess(image, output_type=output_type)
