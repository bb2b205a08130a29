"""Step caches end to end (GPU): diffusers' cache configs on stock diffusers and on ours, and our DBCache.

    python3 benchmarks/bench_cache.py [--sizes 1024,1328] [--tokenizer DIR] [--out DIR]   # full size, a GPU
    python3 benchmarks/bench_cache.py --tiny                                              # CPU logic check

Components as bench_pipeline.py (full-size transformer and VAE with random weights, a 1-layer text encoder with the
real 3584-wide output). 50 Euler steps, true_cfg_scale=4 with a negative prompt. Rows:
- uncached: stock diffusers, ours (FP8, graphs, batched CFG);
- at the first size, each diffusers config at its documented default (MagCache is left out: it has no default, its
  ratios must be calibrated per checkpoint), enabled by transformer.enable_cache on both pipelines in turn; and
  FirstBlockCache at the median of the differences ours saw at its default, a threshold at which random weights skip
  (our FirstBlockCache runs as the step cache's rule: its decisions and differences are printed);
- ours with FastConfig(cache=...): cache-dit's Qwen defaults (dbcache: F8B0, 0.08, 8 warm-up steps) and fixed
  schedules every:2,8 / every:2,1 / every:3,1 (the middle blocks of 1 step in 2, or in 3, with Fn = 8 or 1), and
  every:2,8 with cache-dit's TaylorSeer calibrator of order 1 (ts=1); --dbcache RULE (repeatable) picks others.
Per row: seconds per image (text encoding, 50 steps, VAE decode; after a warm-up call, of all the steps for ours with a
step cache: its variants' graphs captured), the fraction of block forwards that ran, latent
rel-RMS and image PSNR against the same pipeline uncached, and for ours with a diffusers config the same against
stock with that config. Random weights do not give real residual dynamics: a threshold row says how much it
skipped, and one that skipped nothing is reported as such, not as a speed-up. Checks before a speed is reported:
ours uncached against stock (FP8 gate), ours with a diffusers config against stock with it (the FP8 gate, when both
ran the same number of blocks; else the row says the decisions differ), a graphed DBCache row against the same
config run eagerly (bf16 noise). Appends to results/cache.jsonl.
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pipeline import (  # noqa: E402
    GRAPH_GATE,
    NEGATIVE,
    PROMPT,
    SAME_SAMPLER_GATE,
    decode,
    full_size_stock_pipeline,
)
from common import append_results, environment, sync  # noqa: E402

from qwen_image_fast import FastConfig, QwenImageFastPipeline  # noqa: E402
from qwen_image_fast.cli.compare import psnr  # noqa: E402
from qwen_image_fast.kernels._utils import rel_rms_error  # noqa: E402
from qwen_image_fast.pipelines.tiny import tiny_pipeline  # noqa: E402

DBCACHE_ROWS = ("dbcache", "every:2,8,0", "every:2,1,0", "every:3,1,0", "every:2,8,0,ts=1")
# PyramidAttentionBroadcast and FasterCache keep one state for cond and uncond in diffusers: the two texts must have
# one length (else stock fails). Their rows (and their uncached references) use the prompt as the negative prompt
# too: two forwards a step as with any negative prompt, of one length under any tokenizer.
ONE_STATE = ("PyramidAttentionBroadcast", "FasterCache(distilled)")
SAME_LENGTH_NEGATIVE = PROMPT


def timed_latents(pipe, resolution, steps, seed, device, negative=NEGATIVE):
    """(latents, seconds) of one denoising run (text encoding included, VAE decode not)."""
    width, height = resolution
    sync(device)
    start = time.perf_counter()
    latents = pipe(prompt=PROMPT, negative_prompt=negative, true_cfg_scale=4.0, width=width, height=height,
                   num_inference_steps=steps, generator=torch.Generator(device).manual_seed(seed),
                   output_type="latent").images
    sync(device)
    return latents, time.perf_counter() - start


def diffusers_configs(pipe) -> dict:
    from diffusers import (
        FasterCacheConfig,
        FirstBlockCacheConfig,
        PyramidAttentionBroadcastConfig,
        SeaCacheConfig,
        TaylorSeerCacheConfig,
    )

    now = lambda: pipe.current_timestep  # noqa: E731
    return {"FirstBlockCache": FirstBlockCacheConfig(), "TaylorSeer": TaylorSeerCacheConfig(),
            "PyramidAttentionBroadcast": PyramidAttentionBroadcastConfig(current_timestep_callback=now),
            "FasterCache(distilled)": FasterCacheConfig(current_timestep_callback=now, is_guidance_distilled=True),
            "SeaCache": SeaCacheConfig()}


class BlockCount:
    """Block forwards of the stock transformer that ran (patched before a cache hooks them)."""

    def __init__(self):
        from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformerBlock

        self.n, forward = 0, QwenImageTransformerBlock.forward

        def counted(block, *args, **kwargs):
            self.n += 1
            return forward(block, *args, **kwargs)

        QwenImageTransformerBlock.forward = counted


def main():
    from diffusers import FirstBlockCacheConfig

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny random components on the CPU (logic check)")
    parser.add_argument("--sizes", default="1024,1328", help="square sizes; diffusers' configs at the first only")
    parser.add_argument("--tokenizer", type=Path, default=None, help="a Qwen2.5 BPE tokenizer folder")
    parser.add_argument("--no-diffusers", action="store_true", help="skip diffusers' configs (rows of ours only)")
    parser.add_argument("--configs", default=None,
                        help="comma-separated names of diffusers' configs to run (default: all), e.g. FirstBlockCache")
    parser.add_argument("--no-dbcache", action="store_true", help="skip the FastConfig(cache=...) rows")
    parser.add_argument("--dbcache", action="append", default=None, metavar="RULE",
                        help=f"a FastConfig(cache=...) row to run (repeatable; default {', '.join(DBCACHE_ROWS)})")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device("cpu" if args.tiny else "cuda")
    count = BlockCount()
    if args.tiny:
        # 9 blocks: the rules' Fn = 8 first blocks leave a middle one to cache. The script's paths once each where
        # the interpreter allows (it is slow): diffusers' FirstBlockCache and its median rerun, and the graphed
        # DBCache row checked against its eager run (the one-state configs' same-length negative is not run)
        stock, sizes, steps = tiny_pipeline(transformer_config={"num_layers": 9}), [(32, 32)], 2
        args.configs = args.configs or "FirstBlockCache"
        args.dbcache = args.dbcache or [DBCACHE_ROWS[1]]
    else:
        stock, sizes, steps = full_size_stock_pipeline(args.tokenizer), [(int(n),) * 2 for n in args.sizes.split(",")], 50
    fast = QwenImageFastPipeline.from_pipe(stock, fast_config=FastConfig(fp8=not args.tiny), device=device)
    base = fast.fast_config
    for pipe in (stock, fast):
        pipe.set_progress_bar_config(disable=True)
    n_blocks = len(stock.transformer.transformer_blocks)
    env = {} if args.tiny else environment()
    rows = []

    def run(pipe, resolution, negative=NEGATIVE):
        """(latents, images, seconds, fraction of block forwards run) of a timed call after a warm-up call: 2 steps,
        or for ours with a step cache all of them (each variant of a cached forward is captured at its second use in
        a call: the timed call is then what every image after the first gets, as the uncached one is)."""
        cached = pipe is fast and (pipe.fast_config.cache is not None or pipe.transformer.is_cache_enabled)
        if device.type == "cuda":  # the CPU (tiny) has no graph to capture: its warm-up would only cost time
            timed_latents(pipe, resolution, steps if cached else 2, seed=1, device=device, negative=negative)
        count.n = 0
        latents, seconds = timed_latents(pipe, resolution, steps, seed=0, device=device, negative=negative)
        images, vae_s = decode(pipe, latents, resolution, device)
        if pipe is stock:
            fraction = count.n / (n_blocks * 2 * steps)
        else:
            fraction = pipe.blocks_computed
        return latents, images, seconds + vae_s, fraction

    def report(impl, name, resolution, result, uncached, check=None, extra=None):
        latents, images, seconds, fraction = result
        row = dict(env, bench="cache", impl=impl, cache=name, resolution=f"{resolution[0]}x{resolution[1]}",
                   steps=steps, seconds=seconds, blocks_run=fraction,
                   rel_rms_vs_uncached=rel_rms_error(latents, uncached[0]), psnr_vs_uncached=psnr(images, uncached[1]),
                   speedup_vs_uncached=uncached[2] / seconds, applied=fast.applied if impl == "ours" else None,
                   **(extra or {}))
        if check is not None:
            (ref_latents, ref_images), gate, what = check
            row[f"rel_rms_vs_{what}"], row[f"psnr_vs_{what}"] = rel_rms_error(latents, ref_latents), psnr(images,
                                                                                                           ref_images)
            row["gate"] = gate
            if gate is not None and not (row[f"rel_rms_vs_{what}"] <= gate[0] and row[f"psnr_vs_{what}"] >= gate[1]):
                print(f"{impl:9} {name:26} {row['resolution']} FAILED the check against {what} {gate}: "
                      f"{row[f'rel_rms_vs_{what}']:.3e}, {row[f'psnr_vs_{what}']:.1f} dB (no speed reported)",
                      flush=True)
                return row
        skipped = "skipped nothing" if name != "none" and fraction is not None and fraction >= 1 else ""
        rows.append(row)
        if not args.tiny:  # as it comes: a run cut short keeps its rows
            append_results("cache", [row], args.out)
        print(f"{impl:9} {name:26} {row['resolution']} {seconds:7.2f} s  blocks run {fraction or 0:.3f}  "
              f"x{row['speedup_vs_uncached']:.2f} vs uncached  rel-RMS {row['rel_rms_vs_uncached']:.3e}  "
              f"PSNR {row['psnr_vs_uncached']:.1f} dB {skipped} "
              + " ".join(f"{k} {v:.3g}" for k, v in row.items() if k.endswith(("_vs_stock-cached", "_vs_eager"))),
              flush=True)
        return row

    for resolution in sizes:
        fast.fast_config = base
        stock_uncached = run(stock, resolution)
        report("diffusers", "none", resolution, stock_uncached, stock_uncached)
        ours_uncached = run(fast, resolution)
        if report("ours", "none", resolution, ours_uncached, ours_uncached,
                  check=(stock_uncached[:2], SAME_SAMPLER_GATE, "stock")) not in rows:
            continue
        if resolution == sizes[0] and not args.no_diffusers:
            same_length, configs, median_difference = None, diffusers_configs(stock), None
            names = list(configs) if args.configs is None else args.configs.split(",")
            unknown = set(names) - set(configs)
            if unknown:
                raise SystemExit(f"--configs {sorted(unknown)}: allowed {sorted(configs)}")
            for name in names + (["FirstBlockCache(median)"] if "FirstBlockCache" in names else []):
                negative, uncached = NEGATIVE, (stock_uncached, ours_uncached)
                if name in ONE_STATE:
                    negative = SAME_LENGTH_NEGATIVE
                    same_length = same_length or (run(stock, resolution, negative), run(fast, resolution, negative))
                    uncached = same_length
                results = {}
                for impl, pipe in (("ours", fast), ("diffusers", stock)):
                    pipe.transformer.enable_cache(diffusers_configs(pipe)[name] if name in configs else
                                                  FirstBlockCacheConfig(threshold=median_difference))
                    results[impl] = run(pipe, resolution, negative)
                    pipe.transformer.disable_cache()
                    if impl == "ours" and name.startswith("FirstBlockCache"):  # the step cache ran its rule
                        branches = fast._last_step_cache.branches.values()
                        print(f"  {name}: " + "; ".join("".join("C" if c else "-" for c, _ in b.decisions) + " "
                              + " ".join(f"{d:.3f}" for _, d in b.decisions if d is not None) for b in branches),
                              flush=True)
                        if name == "FirstBlockCache":  # a threshold random weights skip at: their median
                            # difference, halfway between two (at one, rounding would decide)
                            differences = sorted(d for b in branches for _, d in b.decisions if d is not None)
                            half = len(differences) // 2
                            median_difference = (differences[half - 1] + differences[half]) / 2
                same = results["ours"][3] == results["diffusers"][3]
                stock_row = report("diffusers", name, resolution, results["diffusers"], uncached[0])
                extra = dict(decisions_as_stock=same, stock_speedup_vs_uncached=stock_row["speedup_vs_uncached"])
                if name == "FirstBlockCache(median)":
                    extra["threshold"] = median_difference
                report("ours", name, resolution, results["ours"], uncached[1],
                       check=(results["diffusers"][:2], SAME_SAMPLER_GATE if same else None, "stock-cached"),
                       extra=extra)
        for name in () if args.no_dbcache else args.dbcache or DBCACHE_ROWS:
            config = base.replace(cache=name)
            check = None
            if name == DBCACHE_ROWS[1]:  # the graphed pieces against the same rule run eagerly
                fast.fast_config = config.replace(cuda_graphs=False)
                check = (run(fast, resolution)[:2], GRAPH_GATE, "eager")
            fast.fast_config = config
            result = run(fast, resolution)
            decisions = {b: "".join("C" if c else "-" for c, _ in branch.decisions)
                         for b, branch in fast._last_step_cache.branches.items()}
            print(f"  {name}: middle blocks run (C) or reused (-) per step: {decisions}", flush=True)
            report("ours", name, resolution, result, ours_uncached, check=check, extra=dict(decisions=decisions))
        fast.fast_config = base


if __name__ == "__main__":
    main()
