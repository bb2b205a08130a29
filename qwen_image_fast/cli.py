"""The command line: `qwen-image-fast render ...` and `qwen-image-fast compare ...` (also `python -m qwen_image_fast`).

Bad input exits with status 2 and a message, as argparse does, before any model is loaded. Several processes
(accelerate launch / torchrun) split the prompts by RANK and WORLD_SIZE; LOCAL_RANK picks the GPU.
"""

import argparse
import os
import re
from pathlib import Path

import torch

from . import compare, render
from .config import SCHEDULERS
from .optimize import resolve_enhancer
from .render import ASPECTS, REAL_MODEL_ID, TINY_MODEL_ID
from .tiny import TINY_ENHANCER_ID

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

REAL_STEPS, REAL_CFG = 50, 4.0


def multiple_of_16(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 16 or value % 16:
        raise argparse.ArgumentTypeError(f"must be a positive multiple of 16, got {value}")
    return value


def int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    from .pipelines.qwen35.enhance import DEFAULT_ENHANCER_ID  # not at the top: `import cli` skips the Qwen3.5 model

    parser = argparse.ArgumentParser(prog="qwen-image-fast", description="Fast Qwen-Image-2512 inference.")
    commands = parser.add_subparsers(dest="command", required=True)

    render_parser = commands.add_parser(
        "render", help="render prompts to image files",
        description="Render prompts to image files with their settings embedded, a manifest.jsonl, and resume "
                    "(finished images are skipped on a re-run).")
    add = render_parser.add_argument
    add("prompt", nargs="*", help="prompts (or use --prompts)")
    add("--prompts", metavar="FILE", help=".txt: one prompt a line (# comments); .jsonl: objects with prompt and "
        "optional negative_prompt, seed, width, height, steps, cfg, id")
    add("--model", default=REAL_MODEL_ID,
        help=f"hub id or local folder (default {REAL_MODEL_ID}); {TINY_MODEL_ID}: a tiny random model built in "
             f"memory (its images are noise); auto: the real model if cached locally and a GPU is there, else "
             f"{TINY_MODEL_ID}")
    add("--preset", choices=("fast", "baseline"), default="fast",
        help="fast: every optimization; baseline: the stock diffusers pipeline")
    add("--aspect", choices=tuple(ASPECTS),
        help="official size: " + ", ".join(f"{k} {w}x{h}" for k, (w, h) in ASPECTS.items()))
    add("--width", type=multiple_of_16, help="multiple of 16 (with --height)")
    add("--height", type=multiple_of_16, help="multiple of 16 (with --width)")
    add("--steps", type=int_at_least(render.MIN_STEPS),
        help=f"denoising steps (default {REAL_STEPS}; {render.TINY_STEPS} with {TINY_MODEL_ID})")
    add("--cfg", type=float, default=REAL_CFG, help="true_cfg_scale (default 4.0; <= 1: no CFG)")
    add("--negative-prompt", default=render.NEGATIVE_PROMPT, help="default: Qwen-Image-2512's recommended one")
    add("--scheduler", choices=SCHEDULERS, default="euler")
    add("--seed", type=int, default=0,
        help="base seed: prompt i gets seed+i (seed+crc32(id) with a JSONL id) unless its line gives one")
    add("--batch-size", type=int_at_least(1), default=1, help="prompts per pipeline call")
    add("--enhance", nargs="?", const=DEFAULT_ENHANCER_ID, metavar="PATH_OR_ID",
        help=f"rewrite each prompt into a detailed one with a local Qwen3.5 before rendering it, stored as "
             f"enhanced_prompt (no value: {DEFAULT_ENHANCER_ID}; or a hub id or local folder; {TINY_ENHANCER_ID}: a "
             f"tiny random model, its rewrites are gibberish). Put it after the prompts, or write --enhance=ID")
    add("--out", default="out", help="output folder (default ./out)")
    add("--format", choices=tuple(render.FORMATS), default="png")
    add("--device", help="default: cuda (cuda:LOCAL_RANK with several processes) if available, else cpu")
    add("--no-resume", dest="resume", action="store_false",
        help="render everything again (default: skip images already in the manifest and on disk)")
    render_parser.set_defaults(run=run_render, parser=render_parser)

    compare_parser = commands.add_parser(
        "compare", help="compare two folders of images",
        description="Pair images by file name; PSNR, SSIM, max |A-B|; side-by-side grids and an index.html report.")
    add = compare_parser.add_argument
    add("a_dir", help="folder A (e.g. the baseline's images)")
    add("b_dir", help="folder B")
    add("--out", required=True, help="report folder")
    add("--min-psnr", type=float, help="exit 1 if a pair is below this PSNR (dB), or if nothing was paired")
    compare_parser.set_defaults(run=run_compare, parser=compare_parser)
    return parser


def distributed_env() -> tuple[int, int, int]:
    """(RANK, WORLD_SIZE, LOCAL_RANK) as set by torchrun / accelerate launch; (0, 1, 0) otherwise."""
    try:
        rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        local_rank = int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
    except ValueError as e:
        raise ValueError(f"RANK / WORLD_SIZE / LOCAL_RANK must be integers ({e})") from e
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} with WORLD_SIZE={world_size}: need 0 <= RANK < WORLD_SIZE")
    return rank, world_size, local_rank


def resolve_device(name: str | None, local_rank: int) -> torch.device:
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    return torch.device("cuda", local_rank) if device.type == "cuda" and device.index is None else device


def check_triton_on_cpu(device: torch.device, preset: str, enhance: str | None = None):
    """The fast preset's and the prompt enhancer's Triton kernels run on the CPU only under Triton's interpreter,
    which must be on before triton is first imported (importing qwen_image_fast imports it)."""
    if device.type != "cpu" or os.environ.get("TRITON_INTERPRET") == "1":
        return
    if preset == "fast":
        raise ValueError("--preset fast on the CPU runs its Triton kernels in Triton's interpreter: start the "
                         "command with TRITON_INTERPRET=1 (it must be set before Python starts), or use "
                         "--preset baseline")
    if enhance is not None:
        raise ValueError("--enhance on the CPU runs the Qwen3.5 model's Triton kernels in Triton's interpreter: start "
                         "the command with TRITON_INTERPRET=1 (it must be set before Python starts)")


def check_enhancer(enhance: str | None):
    """--enhance's value must name a model: `render --enhance "a red fox"` would otherwise take the prompt for one."""
    if enhance is None or enhance == TINY_ENHANCER_ID or Path(enhance).is_dir() or HUB_ID.match(enhance):
        return
    from .pipelines.qwen35.enhance import DEFAULT_ENHANCER_ID

    raise ValueError(f"--enhance {enhance!r}: neither a local folder nor a hub id (owner/name); to rewrite with the "
                     f"default model, put the prompts before --enhance or write --enhance={DEFAULT_ENHANCER_ID}")


def render_defaults(args, tiny: bool) -> render.Defaults:
    if args.aspect and (args.width or args.height):
        raise ValueError("give --aspect or --width/--height, not both")
    if (args.width is None) != (args.height is None):
        raise ValueError("give --width and --height together")
    if args.aspect:
        width, height = ASPECTS[args.aspect]
    elif args.width:
        width, height = args.width, args.height
    else:
        width, height = (render.TINY_SIZE, render.TINY_SIZE) if tiny else ASPECTS["1:1"]
    steps = args.steps or (render.TINY_STEPS if tiny else REAL_STEPS)
    return render.Defaults(negative_prompt=args.negative_prompt, seed=args.seed, width=width, height=height,
                           steps=steps, cfg=args.cfg)


def run_render(args) -> int:
    try:
        check_enhancer(args.enhance)
        if args.prompt and args.prompts:
            raise ValueError("give prompts as arguments or with --prompts, not both")
        if not args.prompt and not args.prompts:
            raise ValueError("no prompts: give them as arguments or with --prompts FILE")
        rank, world_size, local_rank = distributed_env()
        device = resolve_device(args.device, local_rank)
        check_triton_on_cpu(device, args.preset, args.enhance)
        entries = render.read_prompt_file(args.prompts) if args.prompts else [{"prompt": p} for p in args.prompt]
        model, why = render.resolve_model(args.model, device)
        jobs = render.make_jobs(entries, render_defaults(args, tiny=model == TINY_MODEL_ID))
        out_dir = render.prepare_out_dir(args.out)
        labels = render.labels_for(model, args.preset, args.scheduler, enhancer=args.enhance)
    except ValueError as e:
        args.parser.error(str(e))

    prefix = f"rank {rank}/{world_size}: " if world_size > 1 else ""
    mine = render.shard(jobs, rank, world_size)
    enhancer = f", prompts rewritten by {args.enhance}" if args.enhance else ""
    print(f"{prefix}model {model} ({why}), preset {args.preset}, device {device}{enhancer}; {len(mine)} of "
          f"{len(jobs)} prompts -> {out_dir}", flush=True)

    def load_pipe():
        try:
            return render.load_pipeline(model, args.preset, args.scheduler, device)
        except OSError as e:  # e.g. not on the hub and not a local folder, or not cached while offline
            args.parser.error(f"--model {model}: cannot load it ({e})")

    def load_enhancer():
        try:
            return resolve_enhancer(args.enhance, device)
        except OSError as e:
            args.parser.error(f"--enhance {args.enhance}: cannot load it ({e})")

    summary = render.render_jobs(load_pipe, mine, out_dir, labels, fmt=args.format, resume=args.resume,
                                 batch_size=args.batch_size, rank=rank, world_size=world_size,
                                 load_enhancer=load_enhancer if args.enhance else None)
    print(render.format_summary(summary, labels, out_dir, rank, world_size), flush=True)
    return 1 if summary.failed else 0


def run_compare(args) -> int:
    for folder in (args.a_dir, args.b_dir):
        if not Path(folder).is_dir():
            args.parser.error(f"{folder}: not a folder")
    try:
        compare.structural_similarity_function()
        report_dir = compare.prepare_report_dir(args.out)
    except ValueError as e:
        args.parser.error(str(e))
    report = compare.compare_folders(args.a_dir, args.b_dir, report_dir, min_psnr=args.min_psnr)
    print(compare.format_table(report))
    return 0 if report.passed else 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)

