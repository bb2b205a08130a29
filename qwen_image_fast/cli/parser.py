"""The argument parser: the options of `render` and `compare`, their types and their help."""

import argparse
import math

from ..pipelines.core.config import (ATTENTION_BACKENDS, FP8_ATTENTION, PARALLEL_MODES, PRESETS, SCHEDULERS,
                                         DBCache, FastConfig)
from ..pipelines.core.optimizations import REGISTRY
from .devices import FAST_PIPELINE_GIB, LOW_MEMORY_GIB, STREAMING_MIN_GIB
from .jobs import (ASPECTS, LIGHTNING_CFG, LIGHTNING_STEPS, MAX_SEED, MIN_STEPS, QWEN21_CFG,
                   QWEN21_STEPS, REAL_CFG, REAL_STEPS, TINY_STEPS)
from .loras import lora_argument
from .models import DEFAULT_ENHANCER_ID, REAL_MODEL_ID, STOCK_PRESET, TINY_ENHANCER_ID, TINY_MODEL_ID
from .option_names import OWN_OPTIONS, VALUE_FIELDS, option_of
from .output import FORMATS


def multiple_of_16(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 16 or value % 16:
        raise argparse.ArgumentTypeError(f"must be a positive multiple of 16, got {value}")
    return value


def folder_argument(text: str) -> str:
    """A folder path: an empty one would mean the current folder without saying so."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"must name a folder, got {text!r} (for the current folder write .)")
    return text


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value) or not value > 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


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


def sigmas_argument(text: str) -> tuple[float, ...]:
    """--sigmas S1,S2,...: a sampling schedule, numbers in (0, 1] each below the last, at least MIN_STEPS."""
    values = tuple(finite_float()(part) for part in text.split(","))
    if len(values) < MIN_STEPS:
        raise argparse.ArgumentTypeError(f"needs at least {MIN_STEPS} comma-separated values (one per step), got "
                                         f"{text!r}")
    if not all(0 < value <= 1 for value in values):
        raise argparse.ArgumentTypeError(f"each value must be in (0, 1], got {text!r}")
    if any(b >= a for a, b in zip(values, values[1:])):
        raise argparse.ArgumentTypeError(f"must decrease from each value to the next, got {text!r}")
    return values


def fraction(text: str) -> float:
    value = finite_float()(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text!r}")
    return value


def cache_argument(text: str) -> DBCache:
    try:
        return DBCache.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# How the value of a registered optimization that is not on/off is given (one entry per option_names.VALUE_FIELDS).
VALUE_OPTIONS = {"attention": dict(choices=ATTENTION_BACKENDS), "fp8_attention": dict(choices=FP8_ATTENTION),
                 "scheduler": dict(choices=SCHEDULERS),
                 "cfg_fraction": dict(type=fraction, metavar="F"), "cache": dict(type=cache_argument, metavar="RULE")}
# What a value option's help adds about how its value is written.
VALUE_GRAMMAR = {"cache": "dbcache[:Fn,Bn,threshold] (cache-dit's DBCache; default 8,0,0.08 with 8 warm-up steps) or "
                          "every:k[,Fn,Bn] (the middle blocks run on one step in k), then optionally ,w=N ,mc=N ,mcc=N "
                          ",ts=N (warm-up, max cached, max in a row, TaylorSeer order of the cached residual)"}


FILE_MODEL_HELP = ("; or a transformer file (.safetensors in ComfyUI's or diffusers' layout, BF16, FP8 or scaled FP8; "
                   ".gguf), with the configs, tokenizer and other weights from --base")


def add_single_file_options(add):
    """--model FILE's companions (render and serve): where its configs and other components come from."""
    add("--base", metavar="FOLDER|ID",
        help=f"with a --model file: the diffusers checkpoint its configs, tokenizer and scheduler (and the weights "
             f"no file gives) come from (default {REAL_MODEL_ID})")
    add("--text-encoder", metavar="FILE", help="with a --model file: the text encoder from this file (ComfyUI's "
        "Qwen2.5-VL file, FP8-scaled or BF16)")
    add("--vae", metavar="FILE", help="with a --model file: the VAE from this file (ComfyUI's or diffusers' layout)")


def add_optimization_options(add):
    """One option per registered optimization (optimizations.REGISTRY): --no-<field> for one on by default, a value
    for the others. Each stores into args.<field> (None: the preset's value)."""
    default = FastConfig()
    if set(VALUE_OPTIONS) != VALUE_FIELDS:
        raise TypeError(f"VALUE_OPTIONS {sorted(VALUE_OPTIONS)} and option_names.VALUE_FIELDS {sorted(VALUE_FIELDS)} "
                        "must name the same fields")
    for opt in REGISTRY:
        if opt.name in OWN_OPTIONS:
            continue
        about = f"{opt.kind}: {opt.summary}"
        if opt.field in VALUE_OPTIONS:
            grammar = f"; {VALUE_GRAMMAR[opt.field]}" if opt.field in VALUE_GRAMMAR else ""
            add(option_of(opt), dest=opt.field, default=None, help=f"{about} (default: the preset's, "
                f"{getattr(default, opt.field)}){grammar}", **VALUE_OPTIONS[opt.field])
        elif getattr(default, opt.field) is True:
            add(option_of(opt), dest=opt.field, action="store_false", default=None,
                help=f"turn {opt.name} off ({about})")
        else:
            raise TypeError(f"optimization {opt.name!r} (FastConfig.{opt.field}) has no command-line option: add it "
                            "to VALUE_OPTIONS or OWN_OPTIONS")


def command_config(args) -> FastConfig:
    """The command's one FastConfig: --preset's, with the optimization options given (None: not given).
    ValueError for an option given with STOCK_PRESET, which runs diffusers' own pipeline (it would be ignored)."""
    given = [opt for opt in REGISTRY if opt.name not in OWN_OPTIONS and getattr(args, opt.field) is not None]
    if args.preset == STOCK_PRESET and given:
        raise ValueError(f"--preset {STOCK_PRESET} runs the stock diffusers pipeline, which takes none of our options; "
                         f"{', '.join(option_of(opt) for opt in given)} needs another preset")
    return FastConfig.preset(args.preset).replace(**{opt.field: getattr(args, opt.field) for opt in given})


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
        "optional negative_prompt, seed, width, height, steps, cfg, id; .parquet: a prompt column and those fields "
        "as columns. A URI (s3://, gs://, hdfs://, file://) is read through pyarrow (the ray extra)")
    add("--model", default=REAL_MODEL_ID,
        help=f"hub id or local folder (default {REAL_MODEL_ID}); {TINY_MODEL_ID}: a tiny random model built in "
             f"memory (its images are noise); auto: the real model if cached locally and a GPU is there, else "
             f"{TINY_MODEL_ID}" + FILE_MODEL_HELP)
    add_single_file_options(add)
    add("--preset", choices=PRESETS, default=PRESETS[0],
        help=f"{PRESETS[0]}: every optimization; {STOCK_PRESET}: the stock diffusers pipeline")
    add("--aspect", choices=tuple(ASPECTS),
        help="official size: " + ", ".join(f"{k} {w}x{h}" for k, (w, h) in ASPECTS.items())
             + "; Qwen-Image-2.1: the same aspect at about 1024x1024, in multiples of 32")
    add("--width", type=multiple_of_16, help="multiple of 16 (with --height)")
    add("--height", type=multiple_of_16, help="multiple of 16 (with --width)")
    add("--steps", type=int_at_least(MIN_STEPS),
        help=f"denoising steps (default {REAL_STEPS}, {QWEN21_STEPS} for Qwen-Image-2.1, {LIGHTNING_STEPS} with "
             f"--lightning; {TINY_STEPS} with a test-size model such as {TINY_MODEL_ID})")
    add("--cfg", type=finite_float(), help=f"true_cfg_scale (default {REAL_CFG}; {QWEN21_CFG:g} for Qwen-Image-2.1, "
        f"which has guidance distilled in, and {LIGHTNING_CFG:g} with --lightning; <= 1: no CFG)")
    add("--lora", type=lora_argument, action="append", default=[], metavar="PATH_OR_ID[:SCALE]",
        help="a LoRA .safetensors file, local or in a hub repo as OWNER/NAME/FILE.safetensors, at strength SCALE "
             "(default 1); repeatable. Recorded with each image (path, scale, sha256); fused with the fast preset")
    add("--sigmas", type=sigmas_argument, metavar="S1,S2,...",
        help="the sampling schedule, one sigma per step, decreasing in (0, 1] (a few-step LoRA's own, e.g. a "
             "turbo LoRA's), passed to the pipeline as sigmas=; sets --steps to their count. Recorded with each "
             "image (resume compares it); not with --scheduler dpm++2m, which takes none")
    add("--lightning", action="store_true",
        help=f"few-step sampling for a Lightning (step-distilled) LoRA: its Euler schedule (shift 3), "
             f"{LIGHTNING_STEPS} steps and cfg {LIGHTNING_CFG:g} unless --steps / --cfg say otherwise")
    add("--image", action="append", default=[], metavar="PATH",
        help="an input image, for an edit, img2img or inpainting checkpoint (its model_index.json picks the "
             "pipeline, e.g. --model Qwen/Qwen-Image-Edit-2511), or a condition image for Qwen-Image-2.1 (RGBA, "
             "alpha kept); repeatable (Edit-2509/2511 and 2.1 take several); JSONL key images. Recorded with each "
             "image (path, sha256)")
    add("--mask", metavar="PATH", help="the inpainting mask (white: repaint), the input image's size; JSONL key mask")
    add("--strength", type=strength_argument, metavar="S",
        help="img2img / inpainting: how much of the input image is re-noised, in (0, 1] (default: the pipeline's); "
             "JSONL key strength")
    add("--negative-prompt", default=None, help="with cfg > 1 (default: Qwen-Image-2512's recommended one); "
        "refused where no prompt runs with CFG")
    add("--seed", type=int_at_least(0, maximum=MAX_SEED), default=0,
        help="base seed, 0..2**64-1: prompt i gets seed+i (seed+crc32(id) with a JSONL id) unless its line gives one")
    add("--batch-size", type=int_at_least(1), default=1, help="prompts per pipeline call")
    add("--enhance", nargs="?", const=DEFAULT_ENHANCER_ID, metavar="PATH_OR_ID",
        help=f"rewrite each prompt into a detailed one with a local Qwen3.5 before rendering it, stored as "
             f"enhanced_prompt (no value: {DEFAULT_ENHANCER_ID}; or a hub id or local folder; {TINY_ENHANCER_ID}: a "
             f"tiny random model, its rewrites are gibberish). Put it after the prompts, or write --enhance=ID")
    add("--out", type=folder_argument, default="out", help="output folder (default ./out)")
    add("--compare-uncached", type=folder_argument, metavar="DIR",
        help="with --cache: render the same images without the step cache into DIR too (resuming: those already "
             "there are kept), then compare them with the cached ones: PSNR, SSIM, the blocks each computed; the "
             "report in OUT/compare-uncached/")
    add("--format", choices=tuple(FORMATS), default="png")
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
             f"stay on the host; the same images); below {LOW_MEMORY_GIB:g} planned in the budget, the blocks and "
             f"text encoder layers that do not fit streamed from the host, one image a call, at least "
             f"{STREAMING_MIN_GIB:g}; on CUDA the process is capped there "
             "(torch.cuda.set_per_process_memory_fraction) and fails with out-of-memory rather than use more")
    add("--engine", choices=("local", "ray"), default="local",
        help="local: this process (and torchrun's others) renders; ray: a pool of Ray actors, one GPU each, on the "
             "cluster at --ray-address (pip install 'qwen-image-fast[ray]'), into the same files and manifest")
    add("--ray-address", metavar="auto|HOST:PORT|ray://HOST:PORT",
        help="--engine ray: the cluster to join (auto: the one `ray start` began on this node; default: a new local "
             "one for this command)")
    add("--workers", type=int_at_least(1),
        help="--engine ray: actors rendering at once, one GPU each (default: one per GPU of the cluster; 1 on a "
             "cluster without GPUs)")
    add_optimization_options(add)
    add("--dry-run", action="store_true",
        help="print what would run (each optimization: on, off, or why it cannot run here; exact or lossy, with its "
             "bound) and exit, loading no model and writing nothing")
    add("--no-resume", dest="resume", action="store_false",
        help="render everything again, overwriting images of the same name (default: skip images already in the "
             "manifest and on disk, and refuse to overwrite one made with other settings)")
    render_parser.set_defaults(parser=render_parser)

    compare_parser = commands.add_parser(
        "compare", help="compare two folders of images", usage="%(prog)s [options] A_DIR B_DIR --out REPORT",
        description="Pair the same images of two folders (the prompt, seed, size and input images each render "
                    "recorded; file names and formats may differ); PSNR, SSIM, max |A-B|; side-by-side grids and an "
                    "index.html report with both sides' settings. Exits 1, writing no report, when nothing pairs; "
                    "exits 1 when a pair is refused (the same file name, another image), cannot be measured "
                    "(unreadable, sizes differ) or is below --min-psnr.")
    add = compare_parser.add_argument
    add("a_dir", help="folder A (e.g. the baseline's images)")
    add("b_dir", help="folder B")
    add("--out", type=folder_argument, required=True, help="report folder")
    add("--by-name", action="store_true",
        help="pair images that record no settings (not rendered by qwen-image-fast) by file name")
    add("--min-psnr", type=finite_float(minimum=0.0), metavar="DB",
        help="exit 1 if a pair is below this PSNR (dB, finite, >= 0)")
    compare_parser.set_defaults(parser=compare_parser)

    serve_parser = commands.add_parser(
        "serve", help="serve OpenAI's Images API over HTTP", usage="%(prog)s --model M [options]",
        description="Serve /v1/images/generations (a text-to-image model) or /v1/images/edits (an edit model) with "
                    "OpenAI's fields and SGLang's / vLLM-Omni's diffusion fields, batching compatible requests into "
                    "one pipeline call; /v1/models, /health, /metrics, and a page at /.")
    add = serve_parser.add_argument
    add("--model", default=REAL_MODEL_ID, help=f"hub id or local folder (default {REAL_MODEL_ID}); {TINY_MODEL_ID}: "
        "a tiny random model (its images are noise); auto: the real model if cached and a GPU is there"
        + FILE_MODEL_HELP)
    add_single_file_options(add)
    add("--preset", choices=PRESETS, default=PRESETS[0],
        help=f"{PRESETS[0]}: every optimization; {STOCK_PRESET}: the stock diffusers pipeline")
    add("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    add("--port", type=int_at_least(1, maximum=65535), default=8000)
    add("--lora", type=named_lora_argument, action="append", default=[], metavar="NAME=PATH",
        help="a LoRA .safetensors file loaded at start as adapter NAME (unfused: requests pick any subset at any "
             "weights); repeatable")
    add("--lora-dir", metavar="DIR", help="a folder of LoRA files a request may also name (its path inside DIR "
        "without .safetensors; loaded the first time one is named); nothing outside it")
    add("--max-batch", type=int_at_least(1), default=4, help="images per pipeline call at most (default 4)")
    add("--max-wait-ms", type=finite_float(minimum=0.0), default=0.0,
        help="how long the oldest request waits for company before its batch runs on a free engine (default 0: "
        "at once; a batch still takes every compatible request that queued while the engines were busy)")
    add("--max-queue", type=int_at_least(1), default=64, help="requests waiting at most; more get 429 (default 64)")
    add("--api-key", help="require Authorization: Bearer KEY on every route but /health (default: the "
        "QWEN_IMAGE_FAST_API_KEY environment variable, else none)")
    add("--engines", type=int_at_least(1), help="engine processes (default: one per visible GPU; one on the CPU)")
    add("--device", help="cpu, cuda or cuda:N for every engine (default: engine i on GPU i, else the CPU)")
    add("--max-side", type=multiple_of_16, default=2048, help="the longest image side a request may ask for "
        "(default 2048; less where the model's rotary table ends)")
    add("--request-timeout", type=positive_float, default=600.0, metavar="S",
        help="a request not answered within S seconds gets 504 (its queued images dropped; default 600)")
    add("--drain-timeout", type=positive_float, default=600.0, metavar="S",
        help="on SIGTERM, how long requests in flight may take to finish (default 600)")
    add("--max-body-mb", type=positive_float, default=64.0, help="largest request body, uploads included (default 64)")
    add("--lightning", action="store_true", help="few-step sampling for a Lightning LoRA (as render's)")
    add("--max-memory", type=positive_float, metavar="GIB", help="GPU memory each engine may use (as render's)")
    add_optimization_options(add)
    serve_parser.set_defaults(parser=serve_parser)
    return parser


def named_lora_argument(text: str) -> tuple[str, str]:
    """NAME=PATH -> (NAME, PATH); the name is what requests use."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"must be NAME=PATH, got {text!r}")
    if not all(c.isalnum() or c in "-_." for c in name):
        raise argparse.ArgumentTypeError(f"the name {name!r} may hold letters, digits, - _ and . only")
    return name, path
