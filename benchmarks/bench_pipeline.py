"""End-to-end pipeline benchmark (GPU): stock QwenImagePipeline vs QwenImageFastPipeline at the same seed.

    python3 benchmarks/bench_pipeline.py [--out DIR]        # full size, on a GPU
    python3 benchmarks/bench_pipeline.py --tiny             # CPU smoke run of this script's logic

Components: the full-size transformer and VAE with random weights (normal(0, 0.02), biases 0, norm weights 1;
the VAE keeps diffusers' init) and a TINY text encoder: a 1-layer Qwen2.5-VL-shaped model with the real 3584-wide
hidden states and the byte-level test tokenizer (the real 7B encoder takes ~0.02-0.2 s per prompt and is the same
code in both pipelines). 50 Euler steps with true_cfg_scale=4 and a negative prompt; ours also with DPM-Solver++
and UniPC at 20 steps, without CUDA graphs, without fast accumulation, and with FP8 attention
(FastConfig(fp8_attention="auto"), gated by its declared bound). Per row: seconds per image (denoise + VAE decode), ms per step,
VAE ms, peak GiB, latent rel-RMS and image PSNR vs the stock 50-step Euler run at that resolution (for the 20-step
solvers this measures how far they land from 50 Euler steps, not an error of our kernels). Both pipelines sit on
the GPU at once (ours is converted from the stock one), so peak GiB is reported as if the pipeline ran alone: the
bytes of its own modules plus the rise of max-allocated over what was allocated before the run (CUDA-graph pools,
captured during warm-up, are not in it). Every row of ours must first pass a check against its reference (the
gates below); a failed row is printed and not recorded.
Appends to results/pipeline.jsonl.
"""

import argparse
import gc
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import append_results, environment, sync  # noqa: E402

from qwen_image_fast import FastConfig, QwenImageFastPipeline  # noqa: E402
from qwen_image_fast.pipelines.qwen_image.text_to_image import decode_latents  # noqa: E402
from qwen_image_fast.cli.compare import psnr  # noqa: E402
from qwen_image_fast.kernels._utils import rel_rms_error  # noqa: E402
from qwen_image_fast.pipelines.core.optimizations import BY_NAME  # noqa: E402

PROMPT = "A red fox sitting in fresh snow at dawn, soft light, detailed fur, shallow depth of field"
NEGATIVE = "低分辨率，低画质，肢体畸形，手指畸形，画面过饱和，蜡像感，人脸无细节，过度光滑，画面具有AI感。构图混乱。文字模糊，扭曲。"


def full_size_stock_pipeline(tokenizer_dir: Path | None = None, full_text_encoder: bool = False):
    """tokenizer_dir: a Qwen2.5 BPE tokenizer saved by qwen_bpe_tokenizer.py (real prompt lengths); None: the
    byte-level test tokenizer (one token per UTF-8 byte, 3-5x longer text than the real tokenizer gives).
    full_text_encoder: the text encoder at Qwen2.5-VL-7B's text shapes (28 layers, MLP 18944, vocab 152064; random
    weights), else 1 layer with a 512-wide MLP (the same 3584-wide hidden states)."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

    from bench_transformer import make_stock
    from qwen_image_fast.pipelines.tiny import QWEN_IMAGE_SCHEDULER_CONFIG, tiny_tokenizer

    torch.manual_seed(0)  # the text encoder's and VAE's random weights: the same in every process (bench_serve's
    # engines build their own and are checked against this process's)
    tokenizer = tiny_tokenizer() if tokenizer_dir is None else Qwen2Tokenizer.from_pretrained(tokenizer_dir)
    n = len(tokenizer)
    vocab = max(n, 152064) if full_text_encoder else n
    config = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=3584, intermediate_size=18944 if full_text_encoder else 512,
                         num_hidden_layers=28 if full_text_encoder else 1, num_attention_heads=28,
                         num_key_value_heads=4, rope_scaling=dict(mrope_section=[16, 24, 24], rope_type="default",
                                                                  type="default"),
                         vocab_size=vocab, bos_token_id=n - 3, eos_token_id=n - 3),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=3584),
        vocab_size=vocab, vision_start_token_id=n - 3, vision_end_token_id=n - 2, vision_token_id=n - 1,
        image_token_id=n - 1, video_token_id=n - 1,
    )
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in place on the GPU: 8B random parameters in seconds
    try:
        with torch.device("cuda"):
            text_encoder = Qwen2_5_VLForConditionalGeneration(config).eval()
    finally:
        torch.set_default_dtype(default_dtype)
    vae = AutoencoderKLQwenImage().to("cuda", torch.bfloat16).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER_CONFIG)
    return QwenImagePipeline(transformer=make_stock(), vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                             scheduler=scheduler)


def tiny_stock_pipeline():
    from qwen_image_fast.pipelines.tiny import tiny_pipeline

    return tiny_pipeline()


VARIANTS = ("fast", "no-graphs", "no-fastacc", "fp8-attention", "dpm++2m", "unipc")

# What a timed row must pass against its reference (latent rel-RMS, image PSNR). FP8 with the same sampler sits at
# ~4.4e-2 / 45 dB on random weights (H200); a 20-step solver against 50 Euler steps at ~0.15-0.28 / 31-36 dB (a
# sampler difference, so only a sanity bound); graph replay against our own eager loop is bf16 noise.
SAME_SAMPLER_GATE = (0.1, 38.0)
OTHER_SAMPLER_GATE = (0.5, 25.0)
GRAPH_GATE = (1e-2, 45.0)
FP8_ATTENTION_GATE = (BY_NAME["fp8_attention"].bound.full, BY_NAME["fp8_attention"].bound.full_psnr_db)


def module_bytes(pipe) -> int:
    """Bytes of the parameters and buffers of the pipeline's modules (shared storages counted once)."""
    seen, total = set(), 0
    for name in ("transformer", "vae", "text_encoder"):
        module = getattr(pipe, name)
        for t in [*module.parameters(), *module.buffers()]:
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
    return total


def timed_latents(pipe, resolution, steps, seed, device):
    """(latents, seconds) of one denoising run (text encoding included, VAE decode not)."""
    width, height = resolution
    generator = torch.Generator(device).manual_seed(seed)
    sync(device)
    t0 = time.perf_counter()
    latents = pipe(prompt=PROMPT, negative_prompt=NEGATIVE, true_cfg_scale=4.0, width=width, height=height,
                   num_inference_steps=steps, generator=generator, output_type="latent").images
    sync(device)
    return latents, time.perf_counter() - t0


def decode(pipe, latents, resolution, device):
    """(uint8 images [N, H, W, 3], seconds): the stock pipeline's decode steps with `pipe`'s VAE (a fast pipeline's
    decodes an image as 2D convolutions, FastConfig.vae_2d_decode; the stock one's as diffusers does)."""
    width, height = resolution
    sync(device)
    t0 = time.perf_counter()
    images = decode_latents(pipe, latents, height, width, output_type="np")
    sync(device)
    return (np.clip(images, 0, 1) * 255).round().astype(np.uint8), time.perf_counter() - t0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny random components on the CPU (logic check)")
    parser.add_argument("--sizes", default="1024,1328",
                        help="square sizes; the first gets every variant, the others stock and fast")
    parser.add_argument("--graph-sizes", default="512",
                        help="square sizes where only fast and no-graphs run (graphs vs eager where launches matter)")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="a Qwen2.5 BPE tokenizer folder (benchmarks/qwen_bpe_tokenizer.py); default byte-level")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"which of ours run at the first size (comma-separated from {', '.join(VARIANTS)})")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    chosen = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(chosen) - set(VARIANTS))
    if unknown or "fast" not in chosen:
        parser.error(f"--variants {args.variants}: needs fast, allowed: {', '.join(VARIANTS)}")
    device = torch.device("cpu" if args.tiny else "cuda")
    if args.tiny:
        stock = tiny_stock_pipeline()
        sizes, graph_sizes, steps, fast_steps = [(48, 32)], [(32, 32)], 3, 2
    else:
        stock = full_size_stock_pipeline(args.tokenizer)
        sizes = [(int(n), int(n)) for n in args.sizes.split(",")]
        graph_sizes = [(int(n), int(n)) for n in args.graph_sizes.split(",") if n]
        steps, fast_steps = 50, 20
    env = {} if args.tiny else environment()
    # text length drives the joint sequence: the template's 34-token prefix is dropped, as in the pipeline
    env.update(tokenizer="qwen2.5-bpe" if args.tokenizer else "byte-level",
               text_tokens=[len(stock.tokenizer(text).input_ids) for text in (PROMPT, NEGATIVE)])
    for pipe in (stock,):
        pipe.set_progress_bar_config(disable=True)

    fast = QwenImageFastPipeline.from_pipe(stock, fast_config=FastConfig(), device=device)
    fast.set_progress_bar_config(disable=True)
    # name -> (pipeline, the call options it runs with: pipe.fast_config is set to them before each of its rows)
    variants = {name: (fast, FastConfig(**options)) for name, options in (
        ("fast", {}), ("no-graphs", dict(cuda_graphs=False)), ("dpm++2m", dict(scheduler="dpm++2m")),
        ("unipc", dict(scheduler="unipc")))}
    for name, options in (("no-fastacc", dict(fp8_fast_accum=False)), ("fp8-attention", dict(fp8_attention="auto"))):
        if name in chosen:  # build options: each its own converted transformer
            config = FastConfig(**options)
            variants[name] = (QwenImageFastPipeline.from_pipe(stock, fast_config=config, device=device), config)
            variants[name][0].set_progress_bar_config(disable=True)

    rows = []

    def record(impl, name, pipe, resolution, n_steps, ref, gate=None, config=None):
        """Times one variant (config: the call options set on pipe first); ref: (latents, images) to compare with;
        gate: (max latent rel-RMS, min PSNR dB) that the comparison must pass, else the row is printed as FAILED
        and not recorded."""
        if config is not None:
            pipe.fast_config = config
        if device.type == "cuda":  # warm-up: compiles, captures graphs (none on the CPU, the tiny run)
            warm, _ = timed_latents(pipe, resolution, 2, seed=1, device=device)
            decode(pipe, warm, resolution, device)  # and the VAE's first-call cost
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        latents, seconds = timed_latents(pipe, resolution, n_steps, seed=0, device=device)
        images, vae_s = decode(pipe, latents, resolution, device)
        if device.type == "cuda":
            peak_gib = (torch.cuda.max_memory_allocated() - before + module_bytes(pipe)) / 2**30
        row = dict(env, bench="pipeline", impl=impl, variant=name, applied=getattr(pipe, "applied", []),
                   scheduler=getattr(getattr(pipe, "fast_config", None), "scheduler", "euler"), steps=n_steps,
                   resolution=f"{resolution[0]}x{resolution[1]}", seconds=seconds + vae_s,
                   ms_per_step=1000 * seconds / n_steps, vae_ms=1000 * vae_s,
                   peak_gib=peak_gib if device.type == "cuda" else None,
                   latent_rel_err=None if ref is None else rel_rms_error(latents, ref[0]),
                   psnr=None if ref is None else psnr(images, ref[1]))
        row["gate"] = gate
        row["ok"] = bool(torch.isfinite(latents).all()) and (gate is None or (
            row["latent_rel_err"] <= gate[0] and row["psnr"] >= gate[1]))
        if name == "fp8-attention" and not any(label.startswith("fp8_attention:") for label in row["applied"]):
            print(f"ours      fp8-attention: no FP8 attention ran ({pipe.facts().fp8_attention_why})", flush=True)
            return latents, images
        if not row["ok"]:
            print(f"{impl:9} {name:10} {row['resolution']:10} FAILED the check {gate}: rel_err {row['latent_rel_err']}, "
                  f"PSNR {row['psnr']} (no speed reported)", flush=True)
            return latents, images
        rows.append(row)
        if not args.tiny:
            append_results("pipeline", [row], args.out)
        print(f"{impl:9} {name:10} {row['resolution']:10} {n_steps:3d} steps  {row['seconds']:7.2f} s  "
              f"{row['ms_per_step']:7.1f} ms/step  VAE {row['vae_ms']:6.1f} ms  "
              f"rel_err {row['latent_rel_err'] if ref is not None else 0:.3e}  PSNR {row['psnr'] or 0:.1f} dB  "
              f"applied {row['applied']}", flush=True)
        return latents, images

    for resolution in sizes:
        ref = record("diffusers", "stock", stock, resolution, steps, None)
        for name in ("fast", "no-graphs", "no-fastacc", "fp8-attention") if resolution == sizes[0] else ("fast",):
            if name in chosen:
                pipe, config = variants[name]
                gate = FP8_ATTENTION_GATE if name == "fp8-attention" else SAME_SAMPLER_GATE
                record("ours", name, pipe, resolution, steps, ref, gate=gate, config=config)
        if resolution == sizes[0]:
            variants.pop("no-fastacc", None)
            variants.pop("fp8-attention", None)
            for name in ("dpm++2m", "unipc"):
                if name not in chosen:
                    continue
                pipe, config = variants[name]
                record("ours", name, pipe, resolution, fast_steps, ref, gate=OTHER_SAMPLER_GATE, config=config)
        del ref
        gc.collect()
    for resolution in graph_sizes:  # no stock run here: the graph replay is checked against our eager loop
        eager = record("ours", "no-graphs", fast, resolution, steps, None, config=variants["no-graphs"][1])
        record("ours", "fast", fast, resolution, steps, eager, gate=GRAPH_GATE, config=variants["fast"][1])


if __name__ == "__main__":
    main()
