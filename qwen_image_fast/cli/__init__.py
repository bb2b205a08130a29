"""The command line: `qwen-image-fast render ...` and `qwen-image-fast compare ...` (also `python -m qwen_image_fast`).

Bad input exits with status 2, argparse's usage line and one line saying what is wrong, before any model is loaded
and before the output folder is created; a model that then fails to load exits the same way and leaves no folder
behind. Ctrl-C exits with 130 and one line; finished images are kept. Several processes (accelerate launch /
torchrun) split the prompts by RANK and WORLD_SIZE; LOCAL_RANK picks the GPU.

Here: main and the two commands, run_render (every check first, in order, then the rendering) and run_compare. Each
step of `render` in its own file:
    parser.py    the options, their types and help; the command's FastConfig (--preset and the optimization
                 options, made from the registry)
    jobs.py      prompts (arguments or --prompts FILE) -> jobs: defaults, seeds, sharding
    inputs.py    --image, --mask, --strength: input images read and hashed; what each pipeline class takes
    models.py    --model, --enhance: checked, resolved, loaded; Labels (what produces the images)
    plan.py      --dry-run: what would run
    loras.py     --lora: parsed, found, hashed
    devices.py   processes (RANK, WORLD_SIZE), --device, --max-memory, --parallel
    output.py    what an image records, atomic writes, the output folder
    manifest.py  manifest.jsonl and resume
    run.py       rendering the jobs: batches, progress, the summary

torch, diffusers and the model code are imported inside functions in all of them, so that `--help` answers at once.
"""

import sys
from pathlib import Path

from .devices import (cap_memory, check_cfg_parallel, check_triton_on_cpu, distributed_env, image_group_shape,
                      memory_setting, resolve_device, start_mesh)
from .inputs import check_pipeline_inputs
from .jobs import command_line_entries, make_jobs, read_prompt_file, render_defaults, shard
from .loras import resolve_lora
from .manifest import find_conflict
from .models import (TINY_MODEL_ID, LoadError, check_enhancer, check_model, labels_for, load_pipeline, pipeline_class,
                     resolve_model)
from .plan import dry_run_report
from .output import missing_folders, prepare_out_dir, remove_empty_folders
from .parser import build_parser, command_config
from .run import format_summary, render_jobs

INTERRUPTED = 130  # 128 + SIGINT, as shells report it


def one_line(text: str, limit: int = 400) -> str:
    """An error message from a library as one line (they can span many)."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def run_render(args) -> int:
    # Everything that can be checked without loading a model, before the output folder exists.
    try:
        check_enhancer(args.enhance)  # first: `--enhance "a cat"` took the prompt for a model
        if args.prompt and args.prompts:
            raise ValueError("give prompts as arguments or with --prompts, not both")
        if not args.prompt and not args.prompts:
            raise ValueError("no prompts: give them as arguments or with --prompts FILE")
        entries = read_prompt_file(args.prompts) if args.prompts else command_line_entries(args.prompt)
        check_model(args.model)
        rank, world_size, local_rank = distributed_env()
        device = resolve_device(args.device, rank, local_rank)
        model, why = resolve_model(args.model, device)  # auto: tiny-random, or the real model when cached
        config = command_config(args)
        pipeline = pipeline_class(model)
        shape = image_group_shape(args, model, pipeline, rank, world_size)
        if shape is not None:
            config = config.replace(parallel=args.parallel, ulysses_degree=args.ulysses)
        config = config.replace(memory=memory_setting(args.max_memory, args.preset, pipeline, args.parallel))
        loras = tuple(resolve_lora(source, scale) for source, scale in args.lora)
        labels = labels_for(model, args.preset, config, enhancer=args.enhance, loras=loras, lightning=args.lightning)
        check_triton_on_cpu(device, labels, args.enhance)
        jobs = make_jobs(entries, render_defaults(args, tiny=model == TINY_MODEL_ID, pipeline=pipeline))
        check_pipeline_inputs(jobs, pipeline, model, size_given=bool(args.aspect or args.width))
        if args.enhance is not None and pipeline != "QwenImagePipeline":
            raise ValueError(f"--enhance rewrites text-to-image prompts; {pipeline} ({model}) takes instructions "
                             "about an input image: leave --enhance out")
        if shape is not None:
            check_cfg_parallel(args.parallel, jobs)
        if args.dry_run:
            print(dry_run_report(config, labels, pipeline, device, shape, jobs))
            return 0
        # with --parallel an image group renders what one process renders without it
        group_index, groups = (rank // shape.group_size, shape.dp) if shape is not None else (rank, world_size)
        mine = shard(jobs, group_index, groups)
        conflict = find_conflict(mine, Path(args.out), args.format, labels) if args.resume else None
        if conflict:
            raise ValueError(f"{conflict}; rendering would overwrite it: use another --out, or --no-resume to "
                             "overwrite")
        created = missing_folders(args.out)
        out_dir = prepare_out_dir(args.out)
    except ValueError as e:
        args.parser.error(one_line(e))

    prefix = f"rank {rank}/{world_size}: " if world_size > 1 else ""
    enhancer = f", prompts rewritten by {args.enhance}" if args.enhance else ""
    lora_list = "".join(f", LoRA {lora.source} x{lora.scale:g}" for lora in labels.loras)
    lightning = ", Lightning sampler" if args.lightning else ""
    print(f"{prefix}model {model} ({why}, {pipeline}), preset {args.preset}, device {device}{lora_list}{lightning}{enhancer}; "
          f"{len(mine)} of {len(jobs)} prompts -> {out_dir}", flush=True)

    def load_pipe():
        cap_memory(args.max_memory, device)
        try:
            return load_pipeline(model, labels.preset, labels.config, device, labels.loras, labels.lightning)
        except LoadError:  # a LoRA that cannot be loaded: the error names it
            raise
        except Exception as e:  # e.g. not a complete checkpoint: a one-line error, not a traceback
            raise LoadError(f"--model {model}: cannot load it ({type(e).__name__}: {e})") from e

    def load_enhancer():
        from ..pipelines.qwen35.enhance import resolve_enhancer

        try:
            return resolve_enhancer(args.enhance, device)
        except Exception as e:
            raise LoadError(f"--enhance {args.enhance}: cannot load it ({type(e).__name__}: {e})") from e

    mesh = start_mesh(device, shape) if shape is not None else None
    try:
        summary = render_jobs(load_pipe, mine, out_dir, labels, fmt=args.format, resume=args.resume,
                              batch_size=args.batch_size, rank=group_index, world_size=groups,
                              load_enhancer=load_enhancer if args.enhance else None, group=mesh)
    except LoadError as e:
        remove_empty_folders(created)
        args.parser.error(one_line(e))
    except KeyboardInterrupt as e:
        remove_empty_folders(created)
        written = getattr(e, "written", 0)
        print(f"{prefix}interrupted; {written} image(s) finished by this run are kept in {out_dir} (the same command "
              "resumes)", file=sys.stderr, flush=True)
        return INTERRUPTED
    if mesh is None or mesh.is_image_leader:
        print(format_summary(summary, labels, out_dir, group_index, groups), flush=True)
    return 1 if summary.failed else 0


def run_compare(args) -> int:
    from .. import compare

    for folder in (args.a_dir, args.b_dir):
        if not Path(folder).is_dir():
            args.parser.error(f"{folder}: not a folder")
    try:
        compare.structural_similarity_function()
        report_dir = compare.prepare_report_dir(args.out)
    except ValueError as e:
        args.parser.error(one_line(e))
    report = compare.compare_folders(args.a_dir, args.b_dir, report_dir, min_psnr=args.min_psnr)
    print(compare.format_table(report))
    return 0 if report.passed else 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return {"render": run_render, "compare": run_compare}[args.command](args)
    except KeyboardInterrupt:
        print(f"qwen-image-fast {args.command}: interrupted", file=sys.stderr, flush=True)
        return INTERRUPTED
