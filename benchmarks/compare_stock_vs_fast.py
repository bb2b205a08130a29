"""Stock vs fast, end to end: the same prompts and seeds rendered by diffusers' own QwenImagePipeline (preset
baseline) and by the fast preset, then `compare` (PSNR, SSIM, max |A-B|, grids, index.html).

    python3 benchmarks/compare_stock_vs_fast.py --model Qwen/Qwen-Image-2512 --prompts samples/prompts.txt \
        --width 1328 --height 1328 --steps 50 --out samples/stock_vs_fast        # on a GPU
    python3 benchmarks/compare_stock_vs_fast.py --model random-full-size --width 1024 --height 1024 \
        --out /tmp/stock_vs_fast                   # on a GPU, without real weights
    python3 benchmarks/compare_stock_vs_fast.py --model tiny-random --out /tmp/stock_vs_fast   # CPU logic check
    python3 benchmarks/compare_stock_vs_fast.py --model Qwen/Qwen-Image-Edit-2511 --image in.png \
        --prompts edits.txt --steps 40 --out /tmp/edit_stock_vs_fast            # edits: the same input images

--model random-full-size first saves bench_pipeline.py's components (full-size transformer and VAE with random
weights, tiny 3584-wide text encoder, byte-level tokenizer) to --checkpoint-dir in the upstream layout, so that
both presets load them through the real from_pretrained path; every image and row is labeled as random weights.

Writes OUT/baseline/, OUT/fast/ (images + manifest.jsonl) and OUT/report/index.html; everything is rendered again
on each run (no resume: the code may have changed, the settings not). Seconds per image: the median over the
images (the first one includes warm-up and graph capture). On a GPU with real weights, one row is appended to
results/compare_stock_vs_fast.jsonl.
"""

import argparse
import dataclasses
import functools
import gc
import os
import shutil
import statistics
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before qwen_image_fast imports triton: its kernels on the CPU

from qwen_image_fast import FastConfig  # noqa: E402
from qwen_image_fast.cli import compare  # noqa: E402
from qwen_image_fast.cli.inputs import check_pipeline_inputs, read_input_image, sizes_from_image  # noqa: E402
from qwen_image_fast.cli.jobs import (  # noqa: E402
    ASPECTS, MIN_STEPS, NEGATIVE_PROMPT, TINY_SIZE, TINY_STEPS, Defaults, Job, make_jobs, read_prompt_file)
from qwen_image_fast.cli.manifest import read_records  # noqa: E402
from qwen_image_fast.cli.models import REAL_MODEL_ID, labels_for, load_pipeline, pipeline_class_name  # noqa: E402
from qwen_image_fast.cli.output import prepare_out_dir  # noqa: E402
from qwen_image_fast.cli.parser import int_at_least, multiple_of_16  # noqa: E402
from qwen_image_fast.cli.run import format_summary, render_jobs  # noqa: E402
from qwen_image_fast.pipelines.tiny import TINY_MODEL_ID  # noqa: E402

PRESETS = ("baseline", "fast")  # A = stock, B = fast
RANDOM_MODEL = "random-full-size"
RANDOM_NOTE = ("noise from random weights at the real size (no real checkpoint here), not a rendering of the prompt; "
               "compare stock and fast only with each other")


def save_random_checkpoint(folder: Path) -> Path:
    """Saves the random full-size pipeline of bench_pipeline.py to `folder` (kept and reused when complete)."""
    if (folder / "model_index.json").exists():
        return folder
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_pipeline import full_size_stock_pipeline

    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # an interrupted earlier save
    full_size_stock_pipeline().save_pretrained(partial, safe_serialization=True)
    partial.rename(folder)
    gc.collect()
    torch.cuda.empty_cache()
    return folder


def median_seconds(out_dir: Path, jobs: list[Job]) -> float:
    records = read_records(out_dir)
    return statistics.median(records[f"{job.stem}.png"]["seconds"] for job in jobs)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=REAL_MODEL_ID,
                        help=f"hub id, local folder, {TINY_MODEL_ID} or {RANDOM_MODEL}")
    parser.add_argument("--checkpoint-dir", type=Path, default=Path("/tmp/qwen-image-random-full-size"),
                        help=f"where --model {RANDOM_MODEL} is saved")
    parser.add_argument("--prompts", default="samples/prompts.txt", help=".txt or .jsonl, as for `render`")
    parser.add_argument("--width", type=multiple_of_16, help="default 1328 (64 with tiny-random)")
    parser.add_argument("--height", type=multiple_of_16, help="default 1328 (64 with tiny-random)")
    parser.add_argument("--steps", type=int_at_least(MIN_STEPS), help="default 50 (2 with tiny-random)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--image", action="append", default=[], help="input image(s), as for `render`")
    parser.add_argument("--mask", help="inpainting mask, as for `render`")
    parser.add_argument("--strength", type=float, help="img2img / inpainting strength, as for `render`")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--min-psnr", type=float, help="exit 1 if a pair is below (as `compare --min-psnr`)")
    args = parser.parse_args()

    tiny = args.model == TINY_MODEL_ID
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    size = TINY_SIZE if tiny else ASPECTS["1:1"][0]
    pipeline = pipeline_class_name(args.model) if args.model != RANDOM_MODEL else "QwenImagePipeline"
    if sizes_from_image(pipeline) and args.width is None:
        size = None  # an edit pipeline sizes its output from the input image
    defaults = Defaults(
        negative_prompt=NEGATIVE_PROMPT, seed=args.seed, width=args.width or size, height=args.height or size,
        steps=args.steps or (TINY_STEPS if tiny else 50), cfg=4.0,
        images=tuple(read_input_image(path, "--image") for path in args.image),
        mask=read_input_image(args.mask, "--mask") if args.mask else None, strength=args.strength)
    jobs = make_jobs(read_prompt_file(args.prompts), defaults)
    check_pipeline_inputs(jobs, pipeline, args.model, size_given=args.width is not None)

    random_weights = args.model == RANDOM_MODEL
    if random_weights and device.type != "cuda":
        sys.exit(f"--model {RANDOM_MODEL} builds a 20B-parameter model and needs a GPU; use --model {TINY_MODEL_ID}")
    model = str(save_random_checkpoint(args.checkpoint_dir)) if random_weights else args.model
    labels = {preset: labels_for(model, preset, FastConfig.preset(preset)) for preset in PRESETS}
    if random_weights:
        labels = {preset: dataclasses.replace(label, note=RANDOM_NOTE) for preset, label in labels.items()}
    applied = {}
    for preset in PRESETS:
        out_dir = prepare_out_dir(args.out / preset)
        load_pipe = functools.partial(load_pipeline, model, preset, labels[preset].config, device)
        summary = render_jobs(load_pipe, jobs, out_dir, labels[preset], resume=False)
        print(f"{preset}: {format_summary(summary, labels[preset], out_dir)}", flush=True)
        applied[preset] = list(summary.applied)
        gc.collect()  # the pipeline lived inside render_jobs: free its GPU memory before the next one
        if device.type == "cuda":
            torch.cuda.empty_cache()

    report = compare.compare_folders(args.out / "baseline", args.out / "fast", compare.prepare_report_dir(
        args.out / "report"), min_psnr=args.min_psnr)
    print(compare.format_table(report))
    seconds = {preset: median_seconds(args.out / preset, jobs) for preset in PRESETS}
    print(f"median s/image: stock {seconds['baseline']:.2f}, fast {seconds['fast']:.2f} "
          f"({seconds['baseline'] / seconds['fast']:.2f}x); fast applied {applied['fast']}")

    if device.type == "cuda" and not tiny:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from common import append_results, environment

        measured = [p for p in report.pairs if p.psnr is not None]
        append_results("compare_stock_vs_fast", [dict(
            environment(), bench="compare_stock_vs_fast", model=args.model, note=labels["fast"].note,
            prompts=args.prompts,
            images=len(jobs), width=defaults.width, height=defaults.height, steps=defaults.steps,
            config=labels["fast"].config.tag(), applied=applied["fast"],
            stock_s_per_image=seconds["baseline"], fast_s_per_image=seconds["fast"],
            worst_psnr=min(p.psnr for p in measured), mean_ssim=statistics.mean(p.ssim for p in measured),
            worst_max_abs_diff=max(p.max_abs_diff for p in measured), report=str(args.out / "report"))])
    sys.exit(0 if report.passed else 1)


if __name__ == "__main__":
    main()
