"""The command line's `render` and `compare` (`qwen-image-fast render|compare ...`, also `python -m
qwen_image_fast`; command.py parses the arguments and runs them here, or `serve` in server/, which reuses the pieces
below).

Bad input exits with status 2, argparse's usage line and one line saying what is wrong, before any model is loaded
and before the output folder is created; a model that then fails to load exits the same way and leaves no folder
behind. Ctrl-C exits with 130 and SIGTERM with 143, with one line; finished images are kept. Several processes
(accelerate launch / torchrun) split the prompts by RANK and WORLD_SIZE; LOCAL_RANK picks the GPU.

Here: the two commands, run_render (every check first, in order, then the rendering) and run_compare, and
run_command around them (the signals). compare.py: compare's pairing, measures and report. Each step of `render` in
its own file:
    parser.py    the options, their types and help; the command's FastConfig (--preset and the optimization
                 options, made from the registry)
    jobs.py      prompts (arguments or --prompts FILE) -> jobs: defaults, seeds, sharding
    inputs.py    --image, --mask, --strength: input images read and hashed; what each pipeline class takes
    models.py    --model, --enhance: checked, resolved, loaded; Labels (what produces the images)
    sizes.py     what the checkpoint can render: test-size models' defaults, sizes refused, CPU time estimate
    plan.py      --dry-run: what would run
    loras.py     --lora: parsed, found, hashed
    devices.py   processes (RANK, WORLD_SIZE), --device, --max-memory, --parallel
    output.py    what an image records, atomic writes, the output folder
    manifest.py  manifest.jsonl and resume
    run.py       rendering the jobs: batches, progress, the summary
    render_plan.py  every check of `render` before a model loads (check_render -> RenderPlan)
    ray_stage.py    --engine ray's actor (Renderer: a Ray Data stage) and render_spec
    ray_engine.py   --engine ray's driver: the cluster, the stage, the manifest

torch, diffusers and the model code are imported inside functions in all of them, so that `--help` answers at once.
"""

import functools
import signal
import sys
import threading
import time
from pathlib import Path

from .devices import cap_memory, start_mesh
from .inputs import sizes_from_image
from .jobs import TINY_SIZE, TINY_STEPS, command_line_entries, read_prompt_file, shard
from .manifest import find_conflict
from .models import LoadError, check_enhancer, load_pipeline
from .plan import dry_run_report
from .output import missing_folders, prepare_out_dir, remove_empty_folders
from .render_plan import RenderPlan, check_ray_engine, check_render, shrunk_inputs
from .run import Terminated, format_summary, render_jobs

INTERRUPTED = 130  # 128 + SIGINT, as shells report it
COMPARE_UNCACHED = "compare-uncached"  # --compare-uncached's report, a folder in --out
TERMINATED = 143  # 128 + SIGTERM


def one_line(text: str, limit: int = 400) -> str:
    """An error message from a library as one line (they can span many)."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def run_render(args) -> int:
    started = time.time()  # --engine ray reports its startup from here
    connection = None  # --engine ray: the cluster, connecting while the checks run (ray_engine.Connecting)
    # Everything that can be checked without loading a model, before the output folder exists.
    try:
        check_enhancer(args.enhance)  # first: `--enhance "a cat"` took the prompt for a model
        if args.prompt and args.prompts:
            raise ValueError("give prompts as arguments or with --prompts, not both")
        if not args.prompt and not args.prompts:
            raise ValueError("no prompts: give them as arguments or with --prompts FILE")
        entries = read_prompt_file(args.prompts) if args.prompts else command_line_entries(args.prompt)
        check_ray_engine(args)
        if args.engine == "ray" and not args.dry_run:  # the stage starts beside the checks (ray_engine.py)
            from .ray_engine import Connecting, launch_stage

            connection = Connecting(args.ray_address, launch=functools.partial(
                launch_stage, options=args.options, rows=len(entries), device=args.device, workers=args.workers,
                batch_size=args.batch_size))
        plan = check_render(args, entries)
        jobs, labels, model, why, files, pipeline = plan.jobs, plan.labels, plan.model, plan.why, plan.files, \
            plan.pipeline
        device, rank, world_size, shape, shrunk, uncached = plan.device, plan.rank, plan.world_size, plan.shape, \
            plan.shrunk, plan.uncached
        test_size, warning = plan.test_size, plan.warning
        if warning and rank == 0:
            print(warning, file=sys.stderr, flush=True)
        if args.dry_run:
            print(dry_run_report(labels.config, labels, pipeline, device, shape, jobs, files))
            if args.engine == "ray":
                workers = args.workers or ("one per GPU of the cluster" if device.type == "cuda" else 1)
                print(f"engine ray: {args.ray_address or 'a local cluster'}, {workers} actor(s) on {device.type}, "
                      "each running the plan above")
            return 0
        # with --parallel an image group renders what one process renders without it
        group_index, groups = (rank // shape.group_size, shape.dp) if shape is not None else (rank, world_size)
        mine = shard(jobs, group_index, groups)
        conflict = find_conflict(mine, Path(args.out), args.format, labels) if args.resume else None
        if conflict:
            raise ValueError(f"{conflict}; rendering would overwrite it: use another --out, or --no-resume to "
                             "overwrite")
        if uncached is not None:
            conflict = find_conflict(mine, Path(args.compare_uncached), args.format, uncached) if args.resume else None
            if conflict:
                raise ValueError(f"--compare-uncached: {conflict}; rendering would overwrite it")
        created = missing_folders(args.out)
        try:
            out_dir = prepare_out_dir(args.out)
            if uncached is not None:
                created += missing_folders(args.compare_uncached)
                uncached_dir = prepare_out_dir(args.compare_uncached, "--compare-uncached")
        except ValueError:
            remove_empty_folders(created)
            raise
    except ValueError as e:
        if connection is not None:
            connection.close()
        args.parser.error(one_line(e))
    if args.engine == "ray":
        return run_on_ray(args, plan, out_dir, created, connection, started)
    loaded = []  # the pipeline, loaded once: --compare-uncached renders with it again, its step cache off

    def load_pipe():
        if loaded:
            return loaded[0]
        cap_memory(args.max_memory, device)
        try:
            loaded.append(load_pipeline(model, labels.preset, labels.config, device, labels.loras, labels.lightning,
                                        files=files))
        except LoadError:  # a LoRA that cannot be loaded: the error names it
            raise
        except Exception as e:  # e.g. not a complete checkpoint: a one-line error, not a traceback
            raise LoadError(f"--model {model}: cannot load it ({type(e).__name__}: {e})") from e
        return loaded[0]

    def load_uncached():
        pipe = load_pipe()
        pipe.fast_config = pipe.fast_config.replace(cache=None)
        return pipe

    def load_enhancer():
        from ..pipelines.core.prompt_enhancer import resolve_enhancer

        try:
            return resolve_enhancer(args.enhance, device)
        except Exception as e:
            raise LoadError(f"--enhance {args.enhance}: cannot load it ({type(e).__name__}: {e})") from e

    mesh = start_mesh(device, shape) if shape is not None else None
    prefix = f"rank {rank}/{world_size}: " if world_size > 1 else ""
    try:  # from here on a signal removes the folders this run created, if they are still empty
        enhancer = f", prompts rewritten by {args.enhance}" if args.enhance else ""
        lora_list = "".join(f", LoRA {lora.source} x{lora.scale:g}" for lora in labels.loras)
        lightning = ", Lightning sampler" if args.lightning else ""
        tiny_size = "" if sizes_from_image(pipeline) else f"{TINY_SIZE}x{TINY_SIZE} and "
        tiny = (f", a test-size model: {tiny_size}{TINY_STEPS} steps unless given"
                + (f", input images at 1/{shrunk} of diffusers' area" if shrunk else "")) if test_size else ""
        print(f"{prefix}model {model} ({why}, {pipeline}{tiny}), preset {args.preset}, device {device}{lora_list}"
              f"{lightning}{enhancer}; {len(mine)} of {len(jobs)} prompts -> {out_dir}", flush=True)
        with shrunk_inputs(shrunk):
            summary = render_jobs(load_pipe, mine, out_dir, labels, fmt=args.format, resume=args.resume,
                                  batch_size=args.batch_size, rank=group_index, world_size=groups,
                                  load_enhancer=load_enhancer if args.enhance else None, group=mesh)
            if uncached is not None:
                print(format_summary(summary, labels, out_dir), flush=True)
                print(f"the same without the step cache -> {uncached_dir}", flush=True)
                summary_uncached = render_jobs(load_uncached, mine, uncached_dir, uncached, fmt=args.format,
                                               resume=args.resume, batch_size=args.batch_size)
    except LoadError as e:
        remove_empty_folders(created)
        args.parser.error(one_line(e))
    except OSError as e:  # a write failed (disk full, a file size limit, permissions): what was finished stays
        remove_empty_folders(created)
        args.parser.error(one_line(f"cannot write {e.filename or 'an output file'}: {e.strerror or e}; the images "
                                   "finished before it are kept (the same command resumes)"))
    except KeyboardInterrupt as e:
        remove_empty_folders(created)
        written, terminated = getattr(e, "written", 0), isinstance(e, Terminated) or getattr(e, "terminated", False)
        what = "terminated (SIGTERM)" if terminated else "interrupted"
        if not out_dir.exists():
            kept = f"nothing was written (the empty folder {out_dir} is removed)"
        elif args.resume:
            kept = f"{written} image(s) finished by this run are kept in {out_dir} (the same command resumes)"
        else:  # the same command renders every prompt again; without --no-resume, others' settings may refuse it
            kept = (f"{written} image(s) finished by this run are kept in {out_dir} (with --no-resume a rerun "
                    "renders every prompt again)")
        print(f"{prefix}{what}; {kept}", file=sys.stderr, flush=True)
        return TERMINATED if terminated else INTERRUPTED
    if uncached is not None:
        print(format_summary(summary_uncached, uncached, uncached_dir), flush=True)
        return compare_with_uncached(uncached_dir, out_dir) or int(bool(summary.failed or summary_uncached.failed))
    if mesh is None or mesh.is_image_leader:
        print(format_summary(summary, labels, out_dir, group_index, groups), flush=True)
    return 1 if summary.failed else 0


def run_on_ray(args, plan: RenderPlan, out_dir: Path, created: list[Path], connection, started: float) -> int:
    """`render --engine ray` once the checks passed and the folder exists (ray_engine.py), on the cluster
    `connection` (ray_engine.Connecting) connects to."""
    from .ray_engine import render_on_ray
    from .ray_stage import RenderSpec

    spec = RenderSpec.of(plan, args, out_dir)
    print(f"model {plan.model} ({plan.why}, {plan.pipeline}), preset {args.preset}, on Ray "
          f"({args.ray_address or 'a local cluster'}), device {spec.device}; {len(plan.jobs)} prompts -> {out_dir}",
          flush=True)
    try:
        with shrunk_inputs(plan.shrunk):
            summary = render_on_ray(spec, plan.jobs, out_dir, plan.labels, resume=args.resume,
                                    connection=connection, started=started)
    except ValueError as e:  # the cluster: unreachable, or without what the render needs
        remove_empty_folders(created)
        args.parser.error(one_line(e))
    except Exception as e:  # the stage failed (e.g. a write on a full disk, a model its actors cannot load)
        remove_empty_folders(created)
        args.parser.error(one_line(f"--engine ray: the render stage failed ({type(e).__name__}: {e}); the images "
                                   f"recorded so far are kept in {out_dir} (the same command resumes)"))
    except KeyboardInterrupt as e:
        remove_empty_folders(created)
        terminated = isinstance(e, Terminated)
        print(f"{'terminated (SIGTERM)' if terminated else 'interrupted'}; the images recorded so far are kept in "
              f"{out_dir} (the same command resumes)", file=sys.stderr, flush=True)
        return TERMINATED if terminated else INTERRUPTED
    print(format_summary(summary, plan.labels, out_dir), flush=True)
    return 1 if summary.failed else 0


def report_comparison(a_dir: Path, b_dir: Path, report_dir, by_name: bool = False,
                      min_psnr: float | None = None) -> int:
    """compare's pairing, table and report of a_dir (A) against b_dir (B); its exit status. When nothing pairs: one
    line and no report that could be read as a pass (report_dir() makes the report's folder only when there is
    something to report)."""
    from . import compare

    pairing = compare.pair_images(compare.images_in(a_dir), compare.images_in(b_dir), by_name=by_name)
    if pairing.no_pairs_reason():
        print(f"FAIL: {pairing.no_pairs_reason()}", flush=True)
        return 1
    report = compare.compare_pairs(pairing, a_dir, b_dir, report_dir(), min_psnr=min_psnr)
    print(compare.format_table(report), flush=True)
    return 0 if report.passed else 1


def compare_with_uncached(uncached_dir: Path, out_dir: Path) -> int:
    """--compare-uncached: uncached (A) against cached (B), the report in out_dir/COMPARE_UNCACHED."""
    from . import compare

    return report_comparison(uncached_dir, out_dir, lambda: compare.prepare_report_dir(out_dir / COMPARE_UNCACHED))


def run_compare(args) -> int:
    from . import compare

    for folder in (args.a_dir, args.b_dir):
        if not Path(folder).is_dir():
            args.parser.error(f"{folder}: not a folder")
    try:
        compare.structural_similarity_function()
    except ValueError as e:
        args.parser.error(one_line(e))

    def report_dir() -> Path:
        try:
            return compare.prepare_report_dir(args.out)
        except ValueError as e:
            args.parser.error(one_line(e))

    return report_comparison(Path(args.a_dir), Path(args.b_dir), report_dir, by_name=args.by_name,
                           min_psnr=args.min_psnr)


def raise_terminated(signum, frame):
    raise Terminated()


def run_command(args) -> int:
    """`render` or `compare` with parsed `args` (command.py parses them and starts `serve` itself): the exit status;
    Ctrl-C and SIGTERM end it with one line and 130 / 143."""
    # SIGTERM handled as Ctrl-C (its handler can only be set in the main thread; restored when done)
    previous = (signal.signal(signal.SIGTERM, raise_terminated)
                if threading.current_thread() is threading.main_thread() else None)
    try:
        return {"render": run_render, "compare": run_compare}[args.command](args)
    except KeyboardInterrupt as e:
        terminated = isinstance(e, Terminated)
        print(f"qwen-image-fast {args.command}: {'terminated (SIGTERM)' if terminated else 'interrupted'}",
              file=sys.stderr, flush=True)
        return TERMINATED if terminated else INTERRUPTED
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
