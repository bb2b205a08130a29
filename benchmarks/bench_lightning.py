"""Few-step (Lightning) generation with a LoRA (GPU): stock QwenImagePipeline with the LoRA fused vs ours, each of
our LoRA paths, 4 and 8 steps, true_cfg_scale=1, plus the LoRA's load / strength switch / fuse / unload times.

    python3 benchmarks/bench_lightning.py [--tokenizer DIR] [--out DIR]     # full size, on a GPU
    python3 benchmarks/bench_lightning.py --tiny                            # CPU smoke run of this script's logic

Components: the full-size transformer and VAE with random weights and the text encoder at Qwen2.5-VL-7B's text
shapes (28 layers, random weights; bench_pipeline.full_size_stock_pipeline), the Lightning scheduler
(qwen_image_fast.lightning_scheduler) in both pipelines. The LoRA: bench_lora.lightning_lora (the release's shapes:
the 12 block linears of the 60 blocks, rank 64, alpha 8, lightx2v keys), written to a bf16 safetensors file and
loaded from it by both pipelines.

Paths (rows): diffusers without / with the LoRA fused (peft merge in bf16); ours without a LoRA; ours with it
unfused (low-rank terms beside the FP8 GEMMs); fused after loading (folded into the FP8 weights, requantized from
the dequantized FP8 weight); fused on the stock model before conversion (quantized once from the merged BF16
weights); with --fp8-attention KERNEL, that last path with FastConfig(fp8_attention=KERNEL) too, gated by that
option's bound. Seconds per image = the pipeline call to latents (text encoding included) + VAE decode, median of 3
after a warm-up call (graph capture); text encoding is also timed alone. Each row of ours is checked first
against the stock run with the same LoRA state (latent rel-RMS <= 0.1 and image PSNR >= 38 dB); a failed row is
printed and not recorded. First, the VAE alone: stock decode vs the 2D one (FastConfig.vae_2d_decode) on the same
latents, time and max |difference|; stock rows decode the stock way. Appends to results/lightning.jsonl.
"""

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_lora import lightning_lora  # noqa: E402
from bench_pipeline import PROMPT, decode, full_size_stock_pipeline, module_bytes  # noqa: E402
from common import append_results, environment, sync  # noqa: E402

from qwen_image_fast import FastConfig, QwenImageFastPipeline, lightning_scheduler  # noqa: E402
from qwen_image_fast.cli.compare import psnr  # noqa: E402
from qwen_image_fast.kernels._utils import rel_rms_error  # noqa: E402
from qwen_image_fast.pipelines.qwen_image.model.vae import decode_image  # noqa: E402
from qwen_image_fast.pipelines.core.optimizations import BY_NAME  # noqa: E402

GATE = (0.1, 38.0)  # latent rel-RMS, image PSNR dB: FP8 against bf16 with the same sampler and LoRA state


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny random components on the CPU (logic check)")
    parser.add_argument("--sizes", default="1024,1328")
    parser.add_argument("--steps", default="4,8")
    parser.add_argument("--tokenizer", type=Path, default=None, help="a Qwen2.5 BPE tokenizer folder")
    parser.add_argument("--fp8-attention", default="off", help="also the fused-bf16 path with "
                        "FastConfig(fp8_attention=...): auto, cudnn, fa3")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device("cpu" if args.tiny else "cuda")
    if args.tiny:
        from qwen_image_fast.pipelines.tiny import tiny_pipeline

        stock, sizes, steps_list, rank = tiny_pipeline(), [(48, 32)], [2], 4
    else:
        stock = full_size_stock_pipeline(args.tokenizer, full_text_encoder=True)
        sizes = [(int(n), int(n)) for n in args.sizes.split(",")]
        steps_list, rank = [int(n) for n in args.steps.split(",")], 64
    stock.scheduler = lightning_scheduler()
    stock.set_progress_bar_config(disable=True)
    env = {} if args.tiny else environment()
    env.update(tokenizer="qwen2.5-bpe" if args.tokenizer else "byte-level",
               text_tokens=len(stock.tokenizer(PROMPT).input_ids), lora_rank=rank, lora_alpha=8.0,
               text_encoder_layers=stock.text_encoder.config.text_config.num_hidden_layers)
    rows, refs = [], {}

    def call(pipe, resolution, steps, seed=0):
        """(latents, images, seconds to latents, VAE seconds) of one call."""
        width, height = resolution
        sync(device)
        t0 = time.perf_counter()
        latents = pipe(prompt=PROMPT, true_cfg_scale=1.0, width=width, height=height, num_inference_steps=steps,
                       generator=torch.Generator(device).manual_seed(seed), output_type="latent").images
        sync(device)
        seconds = time.perf_counter() - t0
        images, vae_s = decode(pipe, latents, resolution, device)
        return latents, images, seconds, vae_s

    def text_ms(pipe) -> float:
        sync(device)
        t0 = time.perf_counter()
        pipe.encode_prompt(PROMPT, device=device)
        sync(device)
        return 1000 * (time.perf_counter() - t0)

    def vae_check(vae):
        """The VAE alone at each size, on the same random latents: stock decode vs the 2D one (vae.py), both against
        an fp32 copy of the VAE decoding the stock way; the 2D decode's error must be within 1.5x of stock's own
        (bf16 rounding in another summation order), else no time is recorded for it."""
        vae32 = copy.deepcopy(vae).float()
        for width, height in sizes:
            z = torch.randn(1, vae.config.z_dim, 1, height // 8, width // 8, device=device, dtype=vae.dtype)
            with torch.no_grad():
                ref = vae32.decode(z.float()).sample
                err = {"stock": rel_rms_error(vae.decode(z).sample, ref), "2d": rel_rms_error(decode_image(vae, z), ref)}
                ms = {name: 1000 * statistics.median(timed(fn) for _ in range(1 if args.tiny else 5)) for name, fn in
                      (("stock", lambda: vae.decode(z)), ("2d", lambda: decode_image(vae, z)))}
            ok = err["2d"] <= 1.5 * err["stock"] + 1e-5  # + fp32 noise (an fp32 VAE: stock's error is 0)
            op_row(f"VAE decode {width}x{height} (2D; stock in stock_s)", ms["2d"] / 1000 if ok else None,
                   stock_s=ms["stock"] / 1000, rel_err_2d=err["2d"], rel_err_stock=err["stock"], ok=ok)
            print(f"VAE decode {width}x{height}: rel-RMS vs fp32 stock {err['stock']:.2e}, 2D {err['2d']:.2e} "
                  f"({'ok' if ok else 'FAILED: over 1.5x'}); stock {ms['stock']:.1f} ms"
                  + (f", 2D {ms['2d']:.1f} ms" if ok else ""), flush=True)
        del vae32

    def record(impl, path, pipe, ref_key=None, against=None, repeats=3, gate=GATE):
        """Every size and step count: a warm-up call, then `repeats` timed ones (median). against: ours without a
        LoRA, timed in turn with each call (the GPU's clock drifts by several % over minutes, which a comparison
        of runs made minutes apart would read as a difference)."""
        for resolution in sizes:
            for steps in steps_list:
                for warm in ((pipe, against) if against else (pipe,)) if not args.tiny else ():
                    call(warm, resolution, steps, seed=1)  # warm-up: graph capture, VAE autotuning (none on the CPU)
                runs, plain = [], []
                for _ in range(1 if args.tiny else repeats):  # tiny: the logic once
                    runs.append(call(pipe, resolution, steps))
                    if against:
                        plain.append(sum(call(against, resolution, steps)[2:]))
                latents, images = runs[0][0], runs[0][1]
                seconds = statistics.median(r[2] + r[3] for r in runs)
                vae_ms = 1000 * statistics.median(r[3] for r in runs)
                text = statistics.median(text_ms(pipe) for _ in range(1 if args.tiny else 3))
                key = (resolution, steps)
                if ref_key is None:
                    refs[(path, *key)] = (latents, images)
                ref = refs.get((ref_key, *key)) if ref_key else None
                row = dict(env, bench="lightning", impl=impl, path=path, resolution=f"{resolution[0]}x{resolution[1]}",
                           steps=steps, seconds=seconds, text_ms=text, vae_ms=vae_ms,
                           seconds_no_lora_interleaved=statistics.median(plain) if plain else None,
                           ms_per_step=(1000 * seconds - vae_ms - text) / steps,
                           applied=getattr(pipe, "applied", []), module_gib=module_bytes(pipe) / 2**30,
                           latent_rel_err=None if ref is None else rel_rms_error(latents, ref[0]),
                           psnr=None if ref is None else psnr(images, ref[1]), gate=gate if ref else None)
                row["ok"] = bool(torch.isfinite(latents).all()) and (ref is None or (
                    row["latent_rel_err"] <= gate[0] and row["psnr"] >= gate[1]))
                if not row["ok"]:
                    print(f"{impl:9} {path:14} {row['resolution']} {steps} steps: FAILED the check {gate}: rel_err "
                          f"{row['latent_rel_err']}, PSNR {row['psnr']} (no speed reported)", flush=True)
                    continue
                rows.append(row)
                if not args.tiny:
                    append_results("lightning", [row], args.out)
                print(f"{impl:9} {path:14} {row['resolution']} {steps} steps  {seconds:6.3f} s  "
                      f"({row['ms_per_step']:6.1f} ms/step, text {text:5.1f} ms, VAE {vae_ms:5.1f} ms)  "
                      f"rel_err {row['latent_rel_err'] or 0:.3e}  PSNR {row['psnr'] or 0:.1f} dB", flush=True)

    def timed(fn) -> float:
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        return time.perf_counter() - t0

    def op_row(what, seconds, **extra):
        row = dict(env, bench="lightning", impl="ours" if what.startswith("ours") else "diffusers", op=what,
                   seconds=seconds, **extra)
        rows.append(row)
        if not args.tiny:
            append_results("lightning", [row], args.out)
        if not what.startswith("VAE"):
            print(f"{what:44} {seconds:7.3f} s", flush=True)

    vae_check(stock.vae)
    fast = QwenImageFastPipeline.from_pipe(stock, fast_config=FastConfig(), device=device)
    fast.set_progress_bar_config(disable=True)
    with tempfile.TemporaryDirectory() as tmp:
        lora_file = Path(tmp) / "lightning.safetensors"
        save_file({k: v.to(torch.bfloat16).contiguous() for k, v in
                   lightning_lora(stock.transformer, rank=rank).items()}, lora_file)
        record("diffusers", "no-lora", stock)
        record("ours", "no-lora", fast, ref_key="no-lora")
        plain = QwenImageFastPipeline.from_pipe(stock, fast_config=FastConfig(), device=device)  # stays LoRA-free
        plain.set_progress_bar_config(disable=True)

        op_row("diffusers: load_lora_weights", timed(lambda: stock.load_lora_weights(lora_file, adapter_name="l")))
        op_row("diffusers: fuse_lora", timed(lambda: stock.fuse_lora()))
        record("diffusers", "fused", stock)

        op_row("ours: load_lora_weights", timed(lambda: fast.load_lora_weights(lora_file, adapter_name="l")))
        record("ours", "unfused", fast, ref_key="fused", against=plain)
        # a strength change: set_adapters, plus what the next call costs beyond a steady one (graph recapture)
        steady = statistics.median(call(fast, sizes[0], steps_list[-1])[2] for _ in range(2))
        switch = timed(lambda: fast.set_adapters(["l"], [0.8])) + call(fast, sizes[0], steps_list[-1])[2] - steady
        op_row("ours: strength switch, unfused (+ next call)", switch)
        fast.set_adapters(["l"], [1.0])
        op_row("ours: fuse_lora (fold into FP8)", timed(lambda: fast.fuse_lora()))
        record("ours", "fused-fp8", fast, ref_key="fused", against=plain)
        op_row("ours: strength switch, fused (unfuse, set, fuse)",
               timed(lambda: (fast.unfuse_lora(), fast.set_adapters(["l"], [0.8]), fast.fuse_lora())))
        op_row("ours: unfuse_lora", timed(lambda: fast.unfuse_lora()))
        op_row("ours: unload_lora_weights", timed(lambda: fast.unload_lora_weights()))

        stock.unload_lora_weights()  # the fused weights stay: now a plain model with the LoRA merged in bf16
        del fast
        fast = QwenImageFastPipeline.from_pipe(stock, fast_config=FastConfig(), device=device)
        fast.set_progress_bar_config(disable=True)
        record("ours", "fused-bf16", fast, ref_key="fused", against=plain)
        if args.fp8_attention != "off":  # the same with FP8 attention, gated by that option's bound
            del fast
            config = FastConfig(fp8_attention=args.fp8_attention)
            fast = QwenImageFastPipeline.from_pipe(stock, fast_config=config, device=device)
            fast.set_progress_bar_config(disable=True)
            kernel, why_not = fast.transformer.fp8_attention
            bound = BY_NAME["fp8_attention"].bound
            if kernel is None:
                print(f"ours: no FP8 attention runs here ({why_not}): no fused-bf16-fp8-attention row", flush=True)
            else:
                record("ours", "fused-bf16-fp8-attention", fast, ref_key="fused", against=plain,
                       gate=(bound.full, bound.full_psnr_db))

    for r in rows:
        if r.get("seconds_no_lora_interleaved"):
            print(f"{r['path']:10} {r['resolution']} {r['steps']} steps: {r['seconds']:.3f} s, "
                  f"{100 * (r['seconds'] / r['seconds_no_lora_interleaved'] - 1):+.1f}% against ours without the "
                  "LoRA in the same loop")


if __name__ == "__main__":
    main()
