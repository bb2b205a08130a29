"""The whole pipeline in 24 GiB (GPU): FastConfig(memory="low") under a memory cap against the unconstrained fast
pipeline, with and without the modulation table.

    python3 benchmarks/bench_memory.py --tokenizer DIR --size 1024 [--cap-gib 24] [--out DIR]

Components: the full-size transformer and VAE with random weights and a full-size Qwen2.5-VL-7B-shaped text encoder
(28 layers, MLP 18944, vocab 152064, random weights; its vision tower is 1 small layer: text-to-image never runs it
and memory="low" keeps it on the host), the Qwen2.5 BPE tokenizer. 50 Euler steps, true_cfg_scale=4, the recommended
negative prompt; images decoded (VAE included in every time).

Rows, per resolution (one per process: the stock BF16 transformer, from which ours is converted, is freed before
the capped part):
- "fast, no table": today's fast preset (FastConfig(modulation_table=False)), unconstrained;
- "fast": the default (with the table), unconstrained;
- "low": FastConfig(memory="low") after torch.cuda.set_per_process_memory_fraction(cap), peak allocated and
  reserved over its runs.
Each: seconds for 1 image (a call after a 2-step warm-up, which captures the graphs), and per image for 8 prompts:
8 calls for the fast rows; for "low" the 8 prompts and the negative encoded first (one text-encoder turn), then 8
calls with the embeddings (one transformer turn). Also the one-off cost of a modulation table for a new schedule,
from GPU weights (fast) and from the host (low).
Checks before any time is reported: the table's latents equal the no-table latents bit for bit, and low's equal
fast's (the same GEMMs on the same weights; the weights only moved).
Appends to results/memory.jsonl.
"""

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pipeline import NEGATIVE, PROMPT, full_size_stock_pipeline  # noqa: E402
from common import append_results, environment, sync  # noqa: E402

from qwen_image_fast import FastConfig, QwenImageFastPipeline  # noqa: E402

PROMPTS = [f"{PROMPT}, view {k}" for k in range(8)]
STEPS = 50
GIB = 2**30


def call(pipe, size, prompt=PROMPT, steps=STEPS, **kwargs):
    """(latents, images) of one call; prompt embeddings in kwargs replace the prompt."""
    text = {} if "prompt_embeds" in kwargs else dict(prompt=prompt, negative_prompt=NEGATIVE)
    latents = pipe(**text, true_cfg_scale=4.0, width=size, height=size, num_inference_steps=steps,
                   generator=torch.Generator("cuda").manual_seed(0), output_type="latent", **kwargs).images
    return latents, pipe.decode_latents(latents, size, size, output_type="pt")


def timed(fn):
    sync(torch.device("cuda"))
    t0 = time.perf_counter()
    out = fn()
    sync(torch.device("cuda"))
    return out, time.perf_counter() - t0


def one_and_eight(pipe, size, pre_encode: bool, eight: bool = True):
    """(latents of one image, s for 1 image, s per image over 8 prompts (None when not eight))."""
    call(pipe, size, steps=2)  # warm-up: graphs for this size, kernels
    (latents, _), one = timed(lambda: call(pipe, size))

    def run_eight():
        if not pre_encode:
            for p in PROMPTS:
                call(pipe, size, prompt=p)
            return
        device = torch.device("cuda")
        negative = pipe.encode_prompt(NEGATIVE, device=device)
        encoded = [pipe.encode_prompt(p, device=device) for p in PROMPTS]  # the text encoder's one turn
        for embeds, mask in encoded:
            call(pipe, size, prompt_embeds=embeds, prompt_embeds_mask=mask, negative_prompt_embeds=negative[0],
                 negative_prompt_embeds_mask=negative[1])

    if not eight:
        return latents, one, None
    _, total = timed(run_eight)
    return latents, one, total / len(PROMPTS)


def table_cost(pipe, size) -> float:
    """Seconds to build the modulation tables of a new 50-step schedule at this size (the batched-CFG one)."""
    transformer = pipe.transformer
    transformer.modulation_tables.clear()
    steps = torch.linspace(1.0, 0.02, STEPS, device="cuda", dtype=transformer.dtype)[:, None].expand(-1, 2)
    _, seconds = timed(lambda: transformer.modulation_table(steps))
    transformer.modulation_tables.clear()
    return seconds


def vae_decode_rows(env) -> list[dict]:
    """The VAE decode of one image at every official size (cli.jobs.ASPECTS) as the pipeline runs it (the 2D decode):
    seconds and the peak it adds over what was allocated before (max_memory_allocated and reserved rise)."""
    from diffusers import AutoencoderKLQwenImage

    from qwen_image_fast.pipelines.qwen_image.model.vae import decode_image
    from qwen_image_fast.cli.jobs import ASPECTS

    vae = AutoencoderKLQwenImage().to("cuda", torch.bfloat16).eval()
    rows = []
    for aspect, (width, height) in ASPECTS.items():
        latents = torch.randn(1, vae.config.z_dim, 1, height // 8, width // 8, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            decode_image(vae, latents)  # warm-up
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
            image, seconds = timed(lambda: decode_image(vae, latents))
        rows.append(dict(env, bench="memory", variant="vae decode", resolution=f"{width}x{height}", aspect=aspect,
                         vae_s=seconds, vae_peak_allocated_rise_gib=(torch.cuda.max_memory_allocated() - allocated) / GIB,
                         vae_peak_reserved_rise_gib=(torch.cuda.max_memory_reserved() - reserved) / GIB,
                         ok=bool(torch.isfinite(image).all())))
        print({k: v for k, v in rows[-1].items() if k not in env}, flush=True)
        del image
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", type=Path)
    parser.add_argument("--vae-only", action="store_true",
                        help="only the VAE decode's time and peak at every official size (no pipeline)")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--cap-gib", type=float, default=24.0)
    parser.add_argument("--table-one-image", action="store_true",
                        help="the unconstrained table row for 1 image only (a shorter run)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.vae_only:
        append_results("memory", vae_decode_rows(environment()), args.out)
        return
    if args.tokenizer is None:
        parser.error("--tokenizer DIR is needed (all but --vae-only)")
    size = args.size
    env = dict(environment(), bench="memory", resolution=f"{size}x{size}", steps=STEPS, true_cfg_scale=4.0,
               text_encoder="Qwen2.5-VL-7B text shapes (28 layers), random")
    stock = full_size_stock_pipeline(args.tokenizer, full_text_encoder=True)
    fast = QwenImageFastPipeline.from_pipe(stock, fast_config=FastConfig(modulation_table=False), device="cuda")
    del stock
    gc.collect()
    torch.cuda.empty_cache()  # the stock BF16 blocks (only the shared modules stay)
    torch.cuda.reset_peak_memory_stats()
    fast.set_progress_bar_config(disable=True)
    rows = []

    plain_latents, plain_one, plain_eight = one_and_eight(fast, size, pre_encode=False)
    rows.append(dict(variant="fast, no table", one_image_s=plain_one, per_image_of_8_s=plain_eight))
    fast.fast_config = FastConfig()  # the same pipeline with the table (a loop setting)
    table_latents, table_one, table_eight = one_and_eight(fast, size, pre_encode=False,
                                                          eight=not args.table_one_image)
    table_equal = torch.equal(table_latents, plain_latents)
    rows.append(dict(variant="fast", one_image_s=table_one, per_image_of_8_s=table_eight,
                     table_s=table_cost(fast, size), equal_to_no_table=table_equal))
    peak_unconstrained = torch.cuda.max_memory_allocated() / GIB

    components = {name: getattr(fast, name) for name in ("scheduler", "vae", "text_encoder", "tokenizer", "transformer")}
    del fast
    gc.collect()
    torch.cuda.empty_cache()
    low = QwenImageFastPipeline(**components, fast_config=FastConfig(memory="low"))
    low.set_progress_bar_config(disable=True)
    del components
    gc.collect()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(args.cap_gib * GIB / total)
    torch.cuda.reset_peak_memory_stats()
    low_latents, low_one, low_eight = one_and_eight(low, size, pre_encode=True)
    low_equal = torch.equal(low_latents, table_latents)
    rows.append(dict(variant="low", one_image_s=low_one, per_image_of_8_s=low_eight, table_s=table_cost(low, size),
                     equal_to_fast=low_equal, cap_gib=args.cap_gib,
                     peak_allocated_gib=torch.cuda.max_memory_allocated() / GIB,
                     peak_reserved_gib=torch.cuda.max_memory_reserved() / GIB, turns=low._turns.loads,
                     applied=low.applied))
    rows[0]["peak_allocated_gib"] = peak_unconstrained
    ok = table_equal and low_equal
    for row in rows:
        row.update(env, ok=ok)
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items() if k not in env}, flush=True)
    if not ok:
        print(f"FAILED: table latents equal to no-table: {table_equal}; low equal to fast: {low_equal} "
              "(no speed recorded)", flush=True)
        sys.exit(1)
    append_results("memory", rows, args.out)


if __name__ == "__main__":
    main()
