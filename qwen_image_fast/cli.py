"""The command line: `qwen-image-fast render ...` and `qwen-image-fast compare ...` (also `python -m qwen_image_fast`).

Bad input exits with status 2, argparse's usage line and one line saying what is wrong, before any model is loaded
and before the output folder is created; a model that then fails to load exits the same way and leaves no folder
behind. Ctrl-C exits with 130 and one line; finished images are kept. Several processes (accelerate launch /
torchrun) split the prompts by RANK and WORLD_SIZE; LOCAL_RANK picks the GPU.

torch, diffusers and the model code are imported inside the commands, so that `--help` answers at once.
"""

import argparse
import math
import os
import re
import sys
from pathlib import Path

from . import render
from .config import PARALLEL_MODES, PRESETS, SCHEDULERS, FastConfig
from .render import ASPECTS, DEFAULT_ENHANCER_ID, MAX_SEED, REAL_MODEL_ID, TINY_ENHANCER_ID, TINY_MODEL_ID

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

REAL_STEPS, REAL_CFG = 50, 4.0
LIGHTNING_STEPS, LIGHTNING_CFG = 8, 1.0
INTERRUPTED = 130  # 128 + SIGINT, as shells report it


def multiple_of_16(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 16 or value % 16:
        raise argparse.ArgumentTypeError(f"must be a positive multiple of 16, got {value}")
    return value


# GiB, measured on an H200 (benchmarks/RESULTS.md, "Running in 24 GiB"): the fast pipeline's peak at 1328^2 is
# 42.5 GiB; memory="low" peaks at 21.7 GiB reserved at 1024^2 and 23.0 at 1328^2.
FAST_PIPELINE_GIB = 48.0
LOW_MEMORY_GIB = 22.0


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def memory_setting(max_memory: float | None, preset: str, pipeline: str, parallel: str | None) -> str:
    """FastConfig.memory for --max-memory GIB (None: "fast"); ValueError when nothing fits or low cannot run."""
    if max_memory is None or max_memory >= FAST_PIPELINE_GIB:
        return "fast"
    if max_memory < LOW_MEMORY_GIB:
        raise ValueError(f"--max-memory {max_memory:g}: the pipeline needs at least {LOW_MEMORY_GIB:g} GiB (with "
                         "memory='low': 21.7 GiB at 1024x1024, 23.0 at 1328x1328, measured)")
    why = (f"--preset {preset} runs the stock pipeline" if preset == render.STOCK_PRESET else
           f"{pipeline} is not the text-to-image pipeline" if pipeline != "QwenImagePipeline" else
           f"--parallel {parallel} is set" if parallel else None)
    if why:
        raise ValueError(f"--max-memory {max_memory:g} below {FAST_PIPELINE_GIB:g} needs memory='low', which runs in "
                         f"the fast text-to-image pipeline alone; {why}: leave --max-memory out")
    return "low"


def cap_memory(max_memory: float | None, device) -> None:
    if max_memory is None or device.type != "cuda":
        return
    import torch

    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, max_memory * 2**30 / total), device)


def int_at_least(minimum: int, maximum: int | None = None):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(
                f"must be >= {minimum}, got {value}" if maximum is None else
                f"must be in {minimum}..{maximum}, got {value}")
        return value

    return parse


def finite_float(minimum: float | None = None):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        if minimum is not None and value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum:g}, got {text!r}")
        return value

    return parse


def strength_argument(text: str) -> float:
    value = finite_float()(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text!r}")
    return value


def lora_argument(text: str) -> tuple[str, float]:
    """PATH_OR_ID[:SCALE] -> (PATH_OR_ID, SCALE); SCALE defaults to 1. The file is checked later (resolve_lora)."""
    source, sep, tail = text.rpartition(":")
    if not sep:
        return text, 1.0
    try:
        scale = float(tail)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: the part after the last ':' must be a scale (a number), got "
                                         f"{tail!r}") from None
    if not math.isfinite(scale):
        raise argparse.ArgumentTypeError(f"{text!r}: the scale must be a finite number, got {tail!r}")
    if not source:
        raise argparse.ArgumentTypeError(f"{text!r}: no LoRA before the scale")
    return source, scale


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qwen-image-fast", description="Fast Qwen-Image-2512 inference.")
    commands = parser.add_subparsers(dest="command", required=True)

    render_parser = commands.add_parser(
        "render", help="render prompts to image files", usage="%(prog)s [options] [prompt ...]",
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
    add("--preset", choices=PRESETS, default=PRESETS[0],
        help=f"{PRESETS[0]}: every optimization; {render.STOCK_PRESET}: the stock diffusers pipeline")
    add("--aspect", choices=tuple(ASPECTS),
        help="official size: " + ", ".join(f"{k} {w}x{h}" for k, (w, h) in ASPECTS.items()))
    add("--width", type=multiple_of_16, help="multiple of 16 (with --height)")
    add("--height", type=multiple_of_16, help="multiple of 16 (with --width)")
    add("--steps", type=int_at_least(render.MIN_STEPS),
        help=f"denoising steps (default {REAL_STEPS}, {LIGHTNING_STEPS} with --lightning; {render.TINY_STEPS} with "
             f"{TINY_MODEL_ID})")
    add("--cfg", type=finite_float(), help=f"true_cfg_scale (default {REAL_CFG}, {LIGHTNING_CFG} with --lightning; "
        "<= 1: no CFG)")
    add("--lora", type=lora_argument, action="append", default=[], metavar="PATH_OR_ID[:SCALE]",
        help="a LoRA .safetensors file, local or in a hub repo as OWNER/NAME/FILE.safetensors, at strength SCALE "
             "(default 1); repeatable. Recorded with each image (path, scale, sha256); fused with the fast preset")
    add("--lightning", action="store_true",
        help=f"few-step sampling for a Lightning (step-distilled) LoRA: its Euler schedule (shift 3), "
             f"{LIGHTNING_STEPS} steps and cfg {LIGHTNING_CFG:g} unless --steps / --cfg say otherwise")
    add("--image", action="append", default=[], metavar="PATH",
        help="an input image, for an edit, img2img or inpainting checkpoint (its model_index.json picks the "
             "pipeline, e.g. --model Qwen/Qwen-Image-Edit-2511); repeatable (Edit-2509/2511 take several); JSONL "
             "key images. Recorded with each image (path, sha256)")
    add("--mask", metavar="PATH", help="the inpainting mask (white: repaint), the input image's size; JSONL key mask")
    add("--strength", type=strength_argument, metavar="S",
        help="img2img / inpainting: how much of the input image is re-noised, in (0, 1] (default: the pipeline's); "
             "JSONL key strength")
    add("--negative-prompt", default=render.NEGATIVE_PROMPT, help="default: Qwen-Image-2512's recommended one")
    add("--scheduler", choices=SCHEDULERS, default="euler")
    add("--seed", type=int_at_least(0, maximum=MAX_SEED), default=0,
        help="base seed, 0..2**64-1: prompt i gets seed+i (seed+crc32(id) with a JSONL id) unless its line gives one")
    add("--batch-size", type=int_at_least(1), default=1, help="prompts per pipeline call")
    add("--enhance", nargs="?", const=DEFAULT_ENHANCER_ID, metavar="PATH_OR_ID",
        help=f"rewrite each prompt into a detailed one with a local Qwen3.5 before rendering it, stored as "
             f"enhanced_prompt (no value: {DEFAULT_ENHANCER_ID}; or a hub id or local folder; {TINY_ENHANCER_ID}: a "
             f"tiny random model, its rewrites are gibberish). Put it after the prompts, or write --enhance=ID")
    add("--out", default="out", help="output folder (default ./out)")
    add("--format", choices=tuple(render.FORMATS), default="png")
    add("--device", help="cpu, cuda or cuda:N; default: cuda (cuda:LOCAL_RANK with several processes) if "
        "available, else cpu")
    add("--parallel", choices=PARALLEL_MODES[1:],
        help="one image on several processes (torchrun --nproc_per_node N -m qwen_image_fast render ...): cfg "
             "(2 ranks: prompt and negative prompt), ulysses (sequence parallel), cfg,ulysses; ranks beyond one "
             "image group render other prompts (data parallel). Default: each process renders its own prompts")
    add("--ulysses", type=int_at_least(0), default=0, metavar="N",
        help="ranks per Ulysses group with --parallel ulysses or cfg,ulysses (default 0: every rank CFG leaves)")
    add("--max-memory", type=positive_float, metavar="GIB",
        help=f"GPU memory this process may use, in GiB: below {FAST_PIPELINE_GIB:g} the text-to-image pipeline runs "
             "with memory='low' (the text encoder and the transformer take turns on the GPU, the modulation weights "
             f"stay on the host; the same images), at least {LOW_MEMORY_GIB:g}; on CUDA the process is capped there "
             "(torch.cuda.set_per_process_memory_fraction) and fails with out-of-memory rather than use more")
    add("--no-resume", dest="resume", action="store_false",
        help="render everything again, overwriting images of the same name (default: skip images already in the "
             "manifest and on disk, and refuse to overwrite one made with other settings)")
    render_parser.set_defaults(run=run_render, parser=render_parser)

    compare_parser = commands.add_parser(
        "compare", help="compare two folders of images", usage="%(prog)s [options] A_DIR B_DIR --out REPORT",
        description="Pair images by file name; PSNR, SSIM, max |A-B|; side-by-side grids and an index.html report. "
                    "Exits 1 when nothing pairs, a pair cannot be measured (unreadable, sizes differ) or is below "
                    "--min-psnr.")
    add = compare_parser.add_argument
    add("a_dir", help="folder A (e.g. the baseline's images)")
    add("b_dir", help="folder B")
    add("--out", required=True, help="report folder")
    add("--min-psnr", type=finite_float(minimum=0.0), metavar="DB",
        help="exit 1 if a pair is below this PSNR (dB, finite, >= 0)")
    compare_parser.set_defaults(run=run_compare, parser=compare_parser)
    return parser


def one_line(text: str, limit: int = 400) -> str:
    """An error message from a library as one line (they can span many)."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def distributed_env() -> tuple[int, int, int | None]:
    """(RANK, WORLD_SIZE, LOCAL_RANK) as set by torchrun / accelerate launch; (0, 1, None) otherwise."""
    try:
        rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        local_rank = int(os.environ["LOCAL_RANK"]) if "LOCAL_RANK" in os.environ else None
    except ValueError as e:
        raise ValueError(f"RANK / WORLD_SIZE / LOCAL_RANK must be integers ({e})") from e
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} with WORLD_SIZE={world_size}: need 0 <= RANK < WORLD_SIZE")
    return rank, world_size, local_rank


def resolve_device(name: str | None, rank: int, local_rank: int | None):
    """--device (None: cuda if available, else cpu) -> a torch.device; plain "cuda" -> GPU LOCAL_RANK (else RANK
    modulo the GPU count). ValueError for a device that is not here."""
    import torch

    try:
        device = torch.device(name if name is not None else "cuda" if torch.cuda.is_available() else "cpu")
    except RuntimeError:
        raise ValueError(f"--device {name}: not a device; use cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"--device {name}: only cpu and cuda are supported")
    if not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available here (torch {torch.__version__}, "
                         f"{'a CPU-only build' if torch.version.cuda is None else 'no GPU found'}); use --device cpu")
    count = torch.cuda.device_count()
    index = device.index if device.index is not None else (local_rank if local_rank is not None else rank % count)
    if index >= count:
        raise ValueError(f"--device {name}: GPU {index} asked for, {count} here")
    return torch.device("cuda", index)


def check_triton_on_cpu(device, labels: render.Labels, enhance: str | None = None):
    """The fused transformer's and the prompt enhancer's Triton kernels run on the CPU only under Triton's
    interpreter, which must be on before triton is first imported."""
    if device.type != "cpu" or os.environ.get("TRITON_INTERPRET") == "1":
        return
    if labels.preset != render.STOCK_PRESET and labels.config.fused_transformer:
        raise ValueError(f"--preset {labels.preset} on the CPU runs its Triton kernels in Triton's interpreter: start "
                         "the command with TRITON_INTERPRET=1 (it must be set before Python starts), or use "
                         f"--preset {render.STOCK_PRESET}")
    if enhance is not None:
        raise ValueError("--enhance on the CPU runs the Qwen3.5 model's Triton kernels in Triton's interpreter: start "
                         "the command with TRITON_INTERPRET=1 (it must be set before Python starts)")


def hub_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def check_checkpoint(option: str, name: str, marker: str):
    """A local folder must hold `marker` (model_index.json for a diffusers pipeline, config.json for a transformers
    model); anything else must look like a hub id, and be cached when the hub is offline (HF_HUB_OFFLINE=1)."""
    path = Path(name).expanduser()
    if path.exists():
        if not (path / marker).is_file():
            raise ValueError(f"{option} {name}: a local {'folder' if path.is_dir() else 'file'} without "
                             f"{marker}, not a checkpoint")
        return
    if not HUB_ID.match(name):
        raise ValueError(f"{option} {name}: no such local folder, and not a hub id (owner/name)")
    if hub_offline() and not render.cached_locally(name, marker):
        raise ValueError(f"{option} {name}: not in the local Hugging Face cache, and HF_HUB_OFFLINE=1 forbids "
                         "downloading it")


def check_model(model: str):
    if model not in (TINY_MODEL_ID, "auto"):
        check_checkpoint("--model", model, "model_index.json")


def check_enhancer(enhance: str | None):
    """--enhance's value must name a model: `render --enhance "a red fox"` would otherwise take the prompt for one."""
    if enhance is None or enhance == TINY_ENHANCER_ID:
        return
    if not Path(enhance).expanduser().exists() and not HUB_ID.match(enhance):
        raise ValueError(f"--enhance {enhance!r}: neither a local folder nor a hub id (owner/name); to rewrite with "
                         f"the default model, put the prompts before --enhance or write --enhance={DEFAULT_ENHANCER_ID}")
    check_checkpoint("--enhance", enhance, "config.json")


def pipeline_class(model: str) -> str:
    """The pipeline class the checkpoint's model_index.json names; ValueError when it cannot be read."""
    try:
        return render.pipeline_class_name(model)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"--model {model}: cannot read its model_index.json ({e})") from e


def render_defaults(args, tiny: bool, pipeline: str = "QwenImagePipeline") -> render.Defaults:
    """pipeline: the class the checkpoint names; an edit pipeline sizes its output from the input image unless
    --aspect / --width / --height say otherwise."""
    if args.aspect and (args.width or args.height):
        raise ValueError("give --aspect or --width/--height, not both")
    if (args.width is None) != (args.height is None):
        raise ValueError("give --width and --height together")
    if args.aspect:
        width, height = ASPECTS[args.aspect]
    elif args.width:
        width, height = args.width, args.height
    elif render.sizes_from_image(pipeline):
        width, height = None, None
    else:
        width, height = (render.TINY_SIZE, render.TINY_SIZE) if tiny else ASPECTS["1:1"]
    steps = args.steps or (render.TINY_STEPS if tiny else LIGHTNING_STEPS if args.lightning else REAL_STEPS)
    cfg = args.cfg if args.cfg is not None else LIGHTNING_CFG if args.lightning else REAL_CFG
    images = tuple(render.read_input_image(path, "--image") for path in args.image)
    mask = render.read_input_image(args.mask, "--mask") if args.mask is not None else None
    return render.Defaults(negative_prompt=args.negative_prompt, seed=args.seed, width=width, height=height,
                           steps=steps, cfg=cfg, images=images, mask=mask, strength=args.strength)


def run_render(args) -> int:
    # Everything that can be checked without loading a model, before the output folder exists.
    try:
        check_enhancer(args.enhance)  # first: `--enhance "a cat"` took the prompt for a model
        if args.prompt and args.prompts:
            raise ValueError("give prompts as arguments or with --prompts, not both")
        if not args.prompt and not args.prompts:
            raise ValueError("no prompts: give them as arguments or with --prompts FILE")
        entries = render.read_prompt_file(args.prompts) if args.prompts else render.command_line_entries(args.prompt)
        check_model(args.model)
        rank, world_size, local_rank = distributed_env()
        device = resolve_device(args.device, rank, local_rank)
        model, why = render.resolve_model(args.model, device)  # auto: tiny-random, or the real model when cached
        config = FastConfig.preset(args.preset).replace(scheduler=args.scheduler)  # the command's one config
        pipeline = pipeline_class(model)
        shape = image_group_shape(args, model, pipeline, rank, world_size)
        if shape is not None:
            config = config.replace(parallel=args.parallel, ulysses_degree=args.ulysses)
        config = config.replace(memory=memory_setting(args.max_memory, args.preset, pipeline, args.parallel))
        loras = tuple(render.resolve_lora(source, scale) for source, scale in args.lora)
        labels = render.labels_for(model, args.preset, config, enhancer=args.enhance, loras=loras,
                                   lightning=args.lightning)
        check_triton_on_cpu(device, labels, args.enhance)
        jobs = render.make_jobs(entries, render_defaults(args, tiny=model == TINY_MODEL_ID, pipeline=pipeline))
        render.check_pipeline_inputs(jobs, pipeline, model, size_given=bool(args.aspect or args.width))
        if args.enhance is not None and pipeline != "QwenImagePipeline":
            raise ValueError(f"--enhance rewrites text-to-image prompts; {pipeline} ({model}) takes instructions "
                             "about an input image: leave --enhance out")
        if shape is not None:
            check_cfg_parallel(args.parallel, jobs)
        # with --parallel an image group renders what one process renders without it
        group_index, groups = (rank // shape.group_size, shape.dp) if shape is not None else (rank, world_size)
        mine = render.shard(jobs, group_index, groups)
        conflict = render.find_conflict(mine, Path(args.out), args.format, labels) if args.resume else None
        if conflict:
            raise ValueError(f"{conflict}; rendering would overwrite it: use another --out, or --no-resume to "
                             "overwrite")
        created = render.missing_folders(args.out)
        out_dir = render.prepare_out_dir(args.out)
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
            return render.load_pipeline(model, labels.preset, labels.config, device, labels.loras, labels.lightning)
        except render.LoadError:  # a LoRA that cannot be loaded: the error names it
            raise
        except Exception as e:  # e.g. not a complete checkpoint: a one-line error, not a traceback
            raise render.LoadError(f"--model {model}: cannot load it ({type(e).__name__}: {e})") from e

    def load_enhancer():
        from .pipeline import resolve_enhancer

        try:
            return resolve_enhancer(args.enhance, device)
        except Exception as e:
            raise render.LoadError(f"--enhance {args.enhance}: cannot load it ({type(e).__name__}: {e})") from e

    mesh = render.start_mesh(device, shape) if shape is not None else None
    try:
        summary = render.render_jobs(load_pipe, mine, out_dir, labels, fmt=args.format, resume=args.resume,
                                     batch_size=args.batch_size, rank=group_index, world_size=groups,
                                     load_enhancer=load_enhancer if args.enhance else None, group=mesh)
    except render.LoadError as e:
        render.remove_empty_folders(created)
        args.parser.error(one_line(e))
    except KeyboardInterrupt as e:
        render.remove_empty_folders(created)
        written = getattr(e, "written", 0)
        print(f"{prefix}interrupted; {written} image(s) finished by this run are kept in {out_dir} (the same command "
              "resumes)", file=sys.stderr, flush=True)
        return INTERRUPTED
    if mesh is None or mesh.is_image_leader:
        print(render.format_summary(summary, labels, out_dir, group_index, groups), flush=True)
    return 1 if summary.failed else 0


def image_group_shape(args, model: str, pipeline: str, rank: int, world_size: int):
    """--parallel's mesh (MeshShape), checked before any model loads; None without --parallel."""
    if args.parallel is None:
        if args.ulysses:
            raise ValueError(f"--ulysses {args.ulysses} needs --parallel ulysses or cfg,ulysses")
        return None
    from .pipelines.qwen_image.parallel import MeshShape

    if world_size < 2:
        raise ValueError(f"--parallel {args.parallel} splits one image over several processes: launch with "
                         "torchrun --nproc_per_node N -m qwen_image_fast render ...")
    if args.preset == render.STOCK_PRESET:
        raise ValueError(f"--parallel runs in the fast pipeline; --preset {render.STOCK_PRESET} runs the stock diffusers "
                         "pipeline as diffusers runs it (one image per process): leave --parallel out, or use "
                         f"--preset {PRESETS[0]}")
    if pipeline != "QwenImagePipeline":
        raise ValueError(f"--parallel is for text-to-image checkpoints; {pipeline} ({model}) renders one image per "
                         "process (leave --parallel out)")
    return MeshShape.resolve(args.parallel, args.ulysses, world_size, render.transformer_heads(model))


def check_cfg_parallel(parallel: str, jobs) -> None:
    """CFG-parallel runs the negative prompt on its own rank: every job needs CFG."""
    if "cfg" not in parallel.split(","):
        return
    for job in jobs:
        if job.cfg <= 1 or job.negative_prompt is None:
            raise ValueError(f"--parallel {parallel} runs the prompt and the negative prompt on two ranks, but "
                             f"prompt {job.index + 1} ({job.stem}) has cfg {job.cfg:g}"
                             f"{' and no negative prompt' if job.negative_prompt is None else ''}: give every "
                             "prompt cfg > 1 and a negative prompt, or use --parallel ulysses")


def run_compare(args) -> int:
    from . import compare

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
        return args.run(args)
    except KeyboardInterrupt:
        print(f"qwen-image-fast {args.command}: interrupted", file=sys.stderr, flush=True)
        return INTERRUPTED
