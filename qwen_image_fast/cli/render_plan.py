"""`render`'s checks, everything settled before a model loads or a folder is made (check_render -> RenderPlan),
shared by the local render (cli/__init__.py) and the Ray stage (ray_stage.py: render_spec)."""

import contextlib
import dataclasses
from pathlib import Path

from ..pipelines.core.config import check_cache_blocks
from .devices import check_cfg_parallel, check_kernels_on, check_triton_on_cpu, distributed_env, image_group_shape, \
    check_gpu_fits, resolve_device, with_memory_options
from .inputs import QWEN21_PIPELINE, check_pipeline_inputs, check_pipeline_options
from .jobs import make_jobs, render_defaults
from .loras import resolve_lora
from .models import check_model, labels_for, pipeline_class, resolve_model, single_files
from .parser import command_config
from .sizes import SHRINKS_INPUTS, ModelShape, check_sizes, cpu_time_warning


def condition_area_divisor() -> int:
    from ..pipelines.tiny import CONDITION_AREA_DIVISOR

    return CONDITION_AREA_DIVISOR


def shrunk_inputs(divisor: int | None):
    """The edit pipelines' input images shrunk by `divisor` (a test-size model), or nothing changed."""
    if divisor is None:
        return contextlib.nullcontext()
    from ..pipelines.tiny import small_condition_images

    return small_condition_images(divisor)


@dataclasses.dataclass
class RenderPlan:
    """What `render`'s checks settled, before any output folder exists: the jobs, how they render, where."""

    jobs: list
    defaults: object  # jobs.Defaults: the command line's, under each prompt's own settings
    labels: object  # models.Labels
    model: str
    why: str  # how --model was resolved
    files: object  # models.SingleFiles of --model FILE, or None
    pipeline: str
    device: object  # torch.device
    rank: int
    world_size: int
    shape: object  # devices.ImageGroupShape with --parallel, else None
    test_size: bool
    shrunk: int | None
    uncached: object  # the labels of --compare-uncached's render, or None
    warning: str | None  # the CPU time warning


def check_render(args, entries: list[dict]) -> RenderPlan:
    """Everything that can be checked without loading a model (ValueError naming the value), for these prompt
    entries."""
    check_model(args.model)
    files = single_files(args)  # --model FILE: its configs and other components from --base
    rank, world_size, local_rank = distributed_env()
    device = resolve_device(args.device, rank, local_rank)
    model, why = resolve_model(args.model, device)  # auto: tiny-random, or the real model when cached
    source = files.base if files else model  # where the configs are read
    config = command_config(args)
    check_kernels_on(device, config)
    pipeline = pipeline_class(source)
    shape = image_group_shape(args, source, pipeline, rank, world_size)
    if shape is not None:
        config = config.replace(parallel=args.parallel, ulysses_degree=args.ulysses)
    config = with_memory_options(config, args.max_memory, args.preset, pipeline, args.parallel, args.batch_size,
                                 "--batch-size")
    if pipeline == QWEN21_PIPELINE and config.memory == "low" and args.batch_size > 1:
        raise ValueError(f"--batch-size {args.batch_size} with --max-memory {args.max_memory:g}: Qwen-Image-2.1's "
                         "memory='low' runs one image a call (measured at 1024x1024: 19.9 GiB; a batch of 4 took "
                         "51.6 GiB); give --batch-size 1, or a --max-memory of 38 or more")
    loras = tuple(resolve_lora(source, scale) for source, scale in args.lora)
    check_pipeline_options(pipeline, source, config, lightning=args.lightning, fmt=args.format)
    if args.sigmas is not None and config.fused_transformer and config.scheduler == "dpm++2m":
        raise ValueError("--sigmas with --scheduler dpm++2m: DPMSolverMultistepScheduler takes no sigmas; use "
                         "--scheduler euler or unipc")
    if files is not None:  # each file's header read: a wrong or broken file is refused before anything is written
        files.check(config, pipeline)
    model_shape = ModelShape.of(source, pipeline)
    if config.cache is not None and model_shape is not None:
        check_cache_blocks(config.cache.Fn, config.cache.Bn, model_shape.layers, f"{model}'s transformer",
                           f"--cache {config.cache.label()}")
    test_size = model_shape is not None and model_shape.test_size
    defaults = render_defaults(args, tiny=test_size, pipeline=pipeline)
    jobs = make_jobs(entries, defaults)
    if config.max_memory_gib is not None:  # what the budget is planned for, checked before loading
        from ..pipelines.core.runtime.memory import check_within_plan
        from ..pipelines.loading import memory_plan

        for job in jobs:
            check_within_plan(config.max_memory_gib, 1, job.height, job.width,
                              len(job.sigmas) if job.sigmas else job.steps, memory_plan(pipeline), len(job.images))
        if pipeline == QWEN21_PIPELINE:  # its plan's prefix (qwen_image21/memory.py), each prompt counted as encoded
            from ..pipelines.qwen_image21.memory import PLANNED_TEXT_TOKENS
            from ..pipelines.qwen_image21.pipeline import prefix_token_counter

            count = prefix_token_counter(source)
            for job in jobs:
                for what, text in (("prompt", job.prompt), ("negative prompt", job.negative_prompt)):
                    tokens = count(text) if text is not None else 0
                    if tokens > PLANNED_TEXT_TOKENS:
                        raise ValueError(f"prompt {job.index + 1}: its {what} has {tokens} tokens; --max-memory "
                                         f"{args.max_memory:g} is planned for prompts of at most "
                                         f"{PLANNED_TEXT_TOKENS}: shorten it, or give --max-memory 21 or more")
    shrunk = (condition_area_divisor() if test_size and pipeline in SHRINKS_INPUTS and any(j.images for j in jobs)
              else None)
    labels = labels_for(files.label if files else model, args.preset, config, enhancer=args.enhance, loras=loras,
                        lightning=args.lightning, test_width=model_shape.width if test_size else None,
                        shrunk_inputs=shrunk)
    check_triton_on_cpu(device, labels, args.enhance)
    check_pipeline_inputs(jobs, pipeline, source, size_given=bool(args.aspect or args.width))
    check_gpu_fits(device, args.max_memory, args.preset, pipeline, model_shape)
    check_sizes(jobs, model_shape, source, device, args.max_memory)
    warning = cpu_time_warning(jobs, model_shape, args.preset) if device.type == "cpu" else None
    if args.enhance is not None and pipeline != "QwenImagePipeline":
        raise ValueError(f"--enhance rewrites text-to-image prompts; {pipeline} ({model}) takes instructions "
                         "about an input image: leave --enhance out")
    if shape is not None:
        check_cfg_parallel(args.parallel, jobs)
    uncached = uncached_labels(args, config, labels, world_size)
    return RenderPlan(jobs=jobs, defaults=defaults, labels=labels, model=model, why=why, files=files,
                      pipeline=pipeline, device=device, rank=rank, world_size=world_size, shape=shape,
                      test_size=bool(test_size), shrunk=shrunk, uncached=uncached, warning=warning)


def check_ray_engine(args):
    """--engine ray: what it does not do (yet), refused rather than run otherwise; --ray-address / --workers
    without it."""
    if args.engine != "ray":
        given = [name for name, value in (("--ray-address", args.ray_address), ("--workers", args.workers)) if value]
        if given:
            raise ValueError(f"{' and '.join(given)}: options of --engine ray (this render is local)")
        return
    world_size = distributed_env()[1]
    refused = [(world_size > 1, f"several processes (WORLD_SIZE={world_size}): run it once, Ray places the actors"),
               (args.parallel is not None, "--parallel (one image over several GPUs): run it with the local engine"),
               (args.enhance is not None, "--enhance: rewrite the prompts with the local engine"),
               (args.compare_uncached is not None, "--compare-uncached: render the uncached folder with another "
                                                   "--engine ray run (--cache off), then `compare`"),
               (args.device not in (None, "cpu", "cuda"), f"--device {args.device}: Ray gives each actor its GPU; "
                                                          "give cuda or cpu")]
    for refuse, why in refused:
        if refuse:
            raise ValueError(f"--engine ray does not take {why}")


def uncached_labels(args, config, labels, world_size: int):
    """--compare-uncached: the labels of the same render without the step cache (None without the option)."""
    if args.compare_uncached is None:
        return None
    if config.cache is None:
        raise ValueError("--compare-uncached renders the same images without the step cache and compares: give "
                         "--cache RULE")
    if world_size > 1:
        raise ValueError("--compare-uncached runs in one process; render each folder with several, then compare")
    uncached, out = Path(args.compare_uncached).resolve(), Path(args.out).resolve()
    if uncached == out:
        raise ValueError(f"--compare-uncached {args.compare_uncached} is --out: give the uncached images their own "
                         "folder")
    if uncached.is_relative_to(out) or out.is_relative_to(uncached):  # one set of images inside the other's folder
        raise ValueError(f"--compare-uncached {args.compare_uncached} and --out {args.out}: one folder is inside the "
                         "other; give the uncached images a folder beside --out")
    return dataclasses.replace(labels, config=config.replace(cache=None))
