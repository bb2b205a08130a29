"""Rendering a list of jobs into the output folder: batches, prompts encoded ahead (memory="low"), one pipeline call
per batch, progress bars, each image and its manifest line written, the summary.

Prompt enhancement (--enhance): each batch's prompts are rewritten by a local Qwen3.5 just before the batch renders;
the rewrite is recorded as `enhanced_prompt` next to `prompt` (embedded and in the manifest), and `enhancer` (which
model rewrote it) is one of the settings resume compares. Resume matches the original prompt, never the rewrite.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from PIL import Image
from tqdm import tqdm

from .inputs import image_mode
from .jobs import Job
from .manifest import (MANIFEST, append_line, drop_partial_last_line, manifest_path, merge_manifests, pending_jobs,
                       read_lines)
from .models import Labels
from .output import image_settings, save_image, settings_of


class Terminated(KeyboardInterrupt):
    """SIGTERM (what `timeout` and job schedulers send), raised by the command line's handler: handled as Ctrl-C."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM (terminated) during render_jobs, after `written` images of this run were finished (they
    are kept)."""

    def __init__(self, written: int, terminated: bool = False):
        super().__init__(written)
        self.written, self.terminated = written, terminated


@dataclass
class Summary:
    written: int = 0
    skipped: int = 0
    failed: int = 0
    seconds: float = 0.0  # wall time of the written images, prompt enhancement included
    enhance_seconds: float = 0.0  # the part of it spent rewriting prompts
    applied: tuple[str, ...] = ()  # pipe.applied after the last call: what it ran (empty: stock or nothing rendered)

    @property
    def seconds_per_image(self) -> float | None:
        return self.seconds / self.written if self.written else None


def batch_key(job: Job) -> tuple:
    """Jobs with equal keys can share one pipeline call; one with input images runs alone (Edit-2509/2511's
    pipeline takes one prompt a call)."""
    return (job.width, job.height, job.steps, job.sigmas, job.cfg, job.negative_prompt is None,
            job.index if job.images else None)


def batches_of(jobs: list[Job], batch_size: int) -> list[list[Job]]:
    """Consecutive jobs with the same batch_key, at most batch_size a batch."""
    batches = []
    for job in jobs:
        if batches and len(batches[-1]) < batch_size and batch_key(batches[-1][0]) == batch_key(job):
            batches[-1].append(job)
        else:
            batches.append([job])
    return batches


ENCODE_AHEAD_IMAGES = 16  # memory="low": images whose prompts one text-encoder turn encodes (their embeddings,
# ~2 MB each, wait on the GPU until rendered)


def encoded_with_mask(pipe, batch: list[Job], field: str):
    """encode_prompt of the batch's prompts (field: "prompt" or "negative_prompt") -> (embeds, mask). encode_prompt
    returns no mask when it is all ones; passed back as None, diffusers' check_inputs would warn that the tokens are
    taken as valid (which they are): an all-ones mask says so, and the pipeline drops it again."""
    import torch

    # (Qwen-Image-2.1's encode_prompt returns the image slots' mask third: a text-only batch's, all False, which its
    # call derives again from the embeddings)
    embeds, mask, *_ = pipe.encode_prompt([getattr(job, field) for job in batch], device=pipe._execution_device)
    return embeds, torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device) if mask is None else mask


def encode_ahead(pipe, batches: list[list[Job]], first: int) -> tuple[dict[int, dict], int]:
    """FastConfig.memory="low": the prompts and negative prompts of the text-to-image batches from `first` on,
    ENCODE_AHEAD_IMAGES images' worth, encoded before they are rendered (one text-encoder turn on the GPU for all of
    them, not one per call), as their own calls would encode them (one encode_prompt of the batch's list each).
    Returns (batch index -> run_batch's text arguments, the index of the first batch not covered); a batch whose
    encoding fails is left out (its own call encodes it, and reports the error)."""
    encoded, images, i = {}, 0, first
    while i < len(batches) and images < ENCODE_AHEAD_IMAGES:
        batch = batches[i]
        i, images = i + 1, images + len(batch)
        if batch[0].images:
            continue
        try:
            text = dict(zip(("prompt_embeds", "prompt_embeds_mask"), encoded_with_mask(pipe, batch, "prompt")))
            if batch[0].negative_prompt is not None:
                text |= dict(zip(("negative_prompt_embeds", "negative_prompt_embeds_mask"),
                                 encoded_with_mask(pipe, batch, "negative_prompt")))
        except Exception:
            continue
        encoded[i - 1] = text
    return encoded, i


def run_batch(pipe, batch: list[Job], on_step, prompts: list[str] | None = None,
              encoded: dict | None = None, extra: dict | None = None) -> list[Image.Image]:
    """One pipeline call (prompts: what to render instead of the jobs' own, e.g. their rewrites; encoded: the jobs'
    prompts already encoded, encode_ahead; extra: more arguments of the call, e.g. the server's guidance_scale). One
    CPU generator per image: the same seed gives the same latents at any batch size and on any device."""
    import torch

    first = batch[0]
    inputs = {}
    if encoded is not None:
        text = dict(encoded)
    else:
        text = dict(prompt=prompts or [job.prompt for job in batch],
                    negative_prompt=None if first.negative_prompt is None else [job.negative_prompt for job in batch])
    if first.images:  # a batch of one (batch_key)
        images = [image.load(image_mode(pipe)) for image in first.images]
        inputs["image"] = images if len(images) > 1 else images[0]  # EditPlus and 2.1 take one as [one]
        inputs |= {"mask_image": first.mask.load("L")} if first.mask is not None else {}
        inputs |= {"strength": first.strength} if first.strength is not None else {}
    inputs |= {"width": first.width, "height": first.height} if first.width is not None else {}
    inputs |= {"sigmas": list(first.sigmas)} if first.sigmas is not None else {}
    return pipe(
        **text,
        true_cfg_scale=first.cfg,
        num_inference_steps=first.steps,
        generator=[torch.Generator("cpu").manual_seed(job.seed) for job in batch],
        callback_on_step_end=on_step,
        **inputs,
        **(extra or {}),
    ).images


def call_facts(pipe, labels: Labels) -> tuple[tuple[str, ...], float | None]:
    """What the pipeline call just made ran (pipe.applied; empty for stock) and, with a step cache, the fraction of
    the transformer's blocks it computed."""
    computed = getattr(pipe, "blocks_computed", None) if labels.config.cache is not None else None
    return tuple(getattr(pipe, "applied", ())), computed


def save_rendered(job: Job, image: Image.Image, out_dir: Path, fmt: str, labels: Labels, applied: tuple,
                  computed: float | None, rewrite: str | None = None) -> dict:
    """The job's image written into out_dir, its settings embedded; returns its manifest record without the
    timing: file, id, index and the settings."""
    name = f"{job.stem}.{fmt}"
    settings = image_settings(settings_of(job, labels), rewrite, applied, computed)
    save_image(image, out_dir / name, fmt, settings)
    return dict(file=name, id=job.id, index=job.index, **settings)


def render_jobs(load_pipe: Callable, jobs: list[Job], out_dir: Path, labels: Labels, *, fmt: str = "png",
                resume: bool = True, batch_size: int = 1, rank: int = 0, world_size: int = 1,
                load_enhancer: Callable | None = None, group=None) -> Summary:
    """Render this rank's jobs into out_dir (prepare_out_dir first), skipping finished ones when resuming, then
    merge the manifest. load_pipe() and load_enhancer() (needed when labels.enhancer is set) are called only if
    something is left to render. A failed batch (enhancement or rendering) is reported and counted; the others go
    on. Each image records pipe.applied as it is after the call that made it. Ctrl-C raises Interrupted(written)
    after merging the manifest (when this run wrote something); finished images are kept, no partial file is left.
    group: with --parallel, the ParallelMesh (start_mesh); rank / world_size number the image groups, only each
    group's leader reads the folder, rewrites prompts and writes, and the others follow its decisions."""
    if labels.enhancer is not None and load_enhancer is None:
        raise ValueError(f"labels.enhancer={labels.enhancer!r} needs load_enhancer")
    leader = group is None or group.is_image_leader
    pending = []
    if leader:
        pending = pending_jobs(jobs, out_dir, fmt, labels, resume)
    if group is not None:
        wanted = set(group.share([job.index for job in pending]))
        pending = [job for job in jobs if job.index in wanted]
    summary = Summary(skipped=len(jobs) - len(pending))
    enhancer = load_enhancer() if pending and labels.enhancer is not None and leader else None
    pipe = load_pipe() if pending else None
    shard_path = manifest_path(out_dir, rank, world_size)
    if leader:
        drop_partial_last_line(shard_path)
    batches = batches_of(pending, batch_size)
    prefix = f"rank {rank}: " if world_size > 1 else ""
    ahead = labels.enhancer is None and getattr(pipe, "text_encoder_takes_turns", False)
    encoded, encoded_until = {}, 0
    started = time.time()  # the manifest lines from here on are this run's

    try:
        with tqdm(total=len(pending), desc=f"{prefix}images", unit="img", position=0) as images_bar, \
                tqdm(total=sum(batch[0].steps for batch in batches), desc=f"{prefix}steps", unit="step",
                     position=1, leave=False) as steps_bar:

            def on_step(pipe, step, timestep, callback_kwargs):
                steps_bar.update()
                return {}

            for index, batch in enumerate(batches):
                if ahead and index >= encoded_until:
                    encode_start = time.perf_counter()
                    encoded, encoded_until = encode_ahead(pipe, batches, index)
                    summary.seconds += time.perf_counter() - encode_start  # counted in s/image
                start = time.perf_counter()
                enhanced, enhance_seconds = [None] * len(batch), 0.0
                try:
                    if enhancer is not None:
                        enhanced = enhancer.enhance([job.prompt for job in batch])
                        enhance_seconds = time.perf_counter() - start
                    if group is not None and labels.enhancer is not None:  # the leader's rewrites
                        enhanced = group.share(enhanced)
                    images = run_batch(pipe, batch, on_step, prompts=None if labels.enhancer is None else enhanced,
                                       encoded=encoded.get(index))
                except Exception as e:  # e.g. out of memory at one size: report it and render the rest
                    summary.failed += len(batch)
                    tqdm.write(f"{prefix}failed: {', '.join(job.stem for job in batch)}: {type(e).__name__}: {e}")
                    continue
                summary.applied, computed = call_facts(pipe, labels)
                seconds = (time.perf_counter() - start) / len(batch)
                timing = {"seconds": round(seconds, 3)}
                if enhancer is not None:
                    timing["enhance_seconds"] = round(enhance_seconds / len(batch), 3)
                for job, image, rewrite in zip(batch, images, enhanced):
                    if not leader:
                        continue
                    record = save_rendered(job, image, out_dir, fmt, labels, summary.applied, computed, rewrite)
                    append_line(shard_path, {**record, **timing, "rank": rank, "time": time.time()})
                    summary.written += 1
                    images_bar.update()
                summary.enhance_seconds += enhance_seconds
                summary.seconds += time.perf_counter() - start
    except KeyboardInterrupt as e:
        # a signal between a manifest line's append and the count: the lines this run appended say what it finished
        written = summary.written
        if leader:
            written = max(written, sum(1 for line in read_lines(shard_path) if line.get("time", 0) >= started))
        if written:
            merge_manifests(out_dir)
        raise Interrupted(written, terminated=isinstance(e, Terminated)) from None
    if leader:
        merge_manifests(out_dir)
    return summary


def format_summary(summary: Summary, labels: Labels, out_dir: Path, rank: int = 0, world_size: int = 1) -> str:
    prefix = f"rank {rank}/{world_size}: " if world_size > 1 else ""
    if summary.written:
        per_image = f"{summary.seconds_per_image:.2f} s/image"
    elif summary.skipped and not summary.failed:
        per_image = f"nothing to render: all {summary.skipped} image(s) were already there"
    else:
        per_image = "no image rendered"
    if summary.written and labels.enhancer is not None:
        per_image += f" ({summary.enhance_seconds / summary.written:.2f} s of it rewriting the prompt)"
    lines = [f"{prefix}{summary.written} written, {summary.skipped} skipped (already done), {summary.failed} failed; "
             f"{per_image}; {out_dir / MANIFEST}"]
    if labels.note:
        lines.append(f"{prefix}note: these images are {labels.note}")
    if labels.enhancer_note:
        lines.append(f"{prefix}note: the enhanced prompts are {labels.enhancer_note}")
    return "\n".join(lines)
