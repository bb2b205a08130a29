"""The VAE decode of one image alone (GPU): diffusers' decode against ours (FastConfig.vae_2d_decode), both VAEs.

    python3 benchmarks/bench_vae.py [--models 2512,2.1] [--sizes 1024] [--out DIR]
    python3 benchmarks/bench_vae.py --tiny                      # CPU logic check (tiny configs, fp32), no rows

Per model, diffusers' VAE at its default (full-size) config with random weights (He-scaled convolutions, the
decoder norms' gammas 1 + 0.5 N(0, 1) so that a dropped or misplaced norm shows), bf16, one image of random latents:
"stock" is the VAE's own decode, "ours" the same weights as the fast class (FastAutoencoderKLQwenImage for 2512,
FastAutoencoderKLQwenImage21 for 2.1; core/model/vae_2d.py) through the same `decode` call, checked to take the 2D
path. Per row: ms (median after a warm-up, CUDA events), the convolutions' TFLOP and the rate they imply (and its
fraction of a bf16 8192^3 GEMM's rate, measured in the same run), the peak allocated above what the call starts
with, and the max |difference| from an fp32 decode of the same weights and latents (values in [-1, 1]). The check
before a speed is reported: ours within 1.25x stock's own bf16 error from that fp32 decode, plus one bf16 rounding
at 1.0 (2^-8). Appends to results/vae.jsonl.
"""

import argparse
import copy
import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import append_results, bench_ms, environment, matmul_tflops, sync  # noqa: E402

from qwen_image_fast.pipelines.core.model.vae_2d import as_vae_class, decodes_2d  # noqa: E402

MARGIN = (1.25, 2.0**-8)  # ours' max error from fp32 <= MARGIN[0] x stock's + MARGIN[1]


def vae_classes(model: str):
    """(stock class, fast class, the decoder's RMS norm class, tiny config) of a model family."""
    if model == "2512":
        from diffusers import AutoencoderKLQwenImage
        from diffusers.models.autoencoders.autoencoder_kl_qwenimage import QwenImageRMS_norm

        from qwen_image_fast.pipelines.qwen_image.model.vae import FastAutoencoderKLQwenImage
        from qwen_image_fast.pipelines.tiny import TINY_VAE

        return AutoencoderKLQwenImage, FastAutoencoderKLQwenImage, QwenImageRMS_norm, TINY_VAE
    if model == "2.1":
        from diffusers import AutoencoderKLQwenImage21
        from diffusers.models.autoencoders.autoencoder_kl_qwenimage21 import QwenImage21RMS_norm

        from qwen_image_fast.pipelines.qwen_image21.vae import FastAutoencoderKLQwenImage21
        from qwen_image_fast.pipelines.tiny import TINY_QWEN21_VAE

        return AutoencoderKLQwenImage21, FastAutoencoderKLQwenImage21, QwenImage21RMS_norm, TINY_QWEN21_VAE
    raise SystemExit(f"--models: {model!r} is not a model; allowed: 2512, 2.1")


def random_vae(model: str, tiny: bool, device: torch.device, dtype: torch.dtype):
    stock_class, _, norm_class, tiny_config = vae_classes(model)
    torch.manual_seed(0)
    vae = stock_class(**(tiny_config if tiny else {})).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in vae.decoder.modules():
            if isinstance(module, (nn.Conv2d, nn.Conv3d)):
                module.weight.normal_(0, (2.0 / module.weight[0].numel()) ** 0.5, generator=g)
            elif isinstance(module, norm_class):
                module.gamma.copy_(1 + 0.5 * torch.randn(module.gamma.shape, generator=g))
    return vae.to(device, dtype)


def conv_flops(vae, latents) -> int:
    """The decoder's convolutions' multiply-adds x 2 for these latents, from a stock decode's inputs (a 3D
    convolution counted at its one frame's last temporal tap: what a first frame needs)."""
    flops = []

    def count(module, args):
        weight = module.weight if module.weight.ndim == 4 else module.weight[:, :, -1]
        height, width = args[0].shape[-2:]
        stride = module.stride[-2] * module.stride[-1]
        flops.append(2 * weight.numel() * height * width // stride)

    hooks = [m.register_forward_pre_hook(count) for m in vae.decoder.modules()
             if isinstance(m, (nn.Conv2d, nn.Conv3d))]
    with torch.no_grad():
        vae.decode(latents)
    for hook in hooks:
        hook.remove()
    return sum(flops) * latents.shape[0]


def peak_gib(fn, device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    sync(device)
    return (torch.cuda.max_memory_allocated() - before) / 2**30


def model_rows(model: str, size: int, tiny: bool, env: dict, ceiling: float | None) -> list[dict]:
    """ceiling: the bf16 GEMM rate in TF/s (None on the CPU)."""
    device = torch.device("cpu" if tiny else "cuda")
    dtype = torch.float32 if tiny else torch.bfloat16
    stock = random_vae(model, tiny, device, dtype)
    fast = as_vae_class(stock, vae_classes(model)[1])
    side = size // stock.spatial_compression_ratio
    g = torch.Generator().manual_seed(2)
    latents = torch.randn(1, stock.config.z_dim, 1, side, side, generator=g).to(device, dtype)
    if not decodes_2d(fast, latents):
        raise SystemExit(f"{model}: the fast VAE would not take the 2D path for these latents")
    with torch.no_grad():
        exact = copy.deepcopy(stock).float().decode(latents.float()).sample
        outputs = {"stock": stock.decode(latents).sample.float(), "ours": fast.decode(latents).sample.float()}
    errors = {impl: (out - exact).abs().max().item() for impl, out in outputs.items()}
    del exact
    flops = conv_flops(stock, latents)
    bound = MARGIN[0] * errors["stock"] + MARGIN[1]
    print(f"{model} {size}^2: max |d| from an fp32 decode: stock {errors['stock']:.3e}, ours {errors['ours']:.3e} "
          f"(allowed {bound:.3e}); ours vs stock {(outputs['ours'] - outputs['stock']).abs().max().item():.3e}; "
          f"convolutions {flops / 1e12:.2f} TFLOP", flush=True)
    if errors["ours"] > bound:
        print(f"  {model}: ours is outside the check: no speed reported", flush=True)
        return []
    rows, ms = [], {}
    for impl, vae in (("stock", stock), ("ours", fast)):
        def decode(vae=vae):
            with torch.no_grad():
                return vae.decode(latents).sample

        ms[impl] = bench_ms(decode)
        peak = peak_gib(decode, device)
        rate = flops / ms[impl] / 1e9
        fraction = rate / ceiling if ceiling else None
        print(f"  {impl:5s} {ms[impl]:7.1f} ms  convolutions at {rate:6.1f} TF/s"
              f"{f' ({fraction:.0%} of the bf16 GEMM rate)' if fraction else ''}  peak above the call "
              f"{peak if peak is None else round(peak, 2)} GiB", flush=True)
        rows.append({**env, "bench": "vae_decode", "model": model, "size": size, "impl": impl, "ms": ms[impl],
                     "conv_tflop": flops / 1e12, "conv_tflops_per_s": rate, "bf16_gemm_tflops": ceiling,
                     "conv_fraction_of_bf16_gemm": fraction, "peak_gib": peak,
                     "max_abs_vs_fp32": errors[impl], "check_bound": bound,
                     "applied": ["vae_2d_decode"] if impl == "ours" else []})
    print(f"  ours x{ms['stock'] / ms['ours']:.2f} stock", flush=True)
    rows[-1]["speedup_vs_stock"] = ms["stock"] / ms["ours"]
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny configs on the CPU (logic check), no rows")
    parser.add_argument("--models", default="2512,2.1")
    parser.add_argument("--sizes", default="1024")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    env = {} if args.tiny else environment()
    ceiling = None if args.tiny else matmul_tflops(8192, 8192, 8192, fp8=False)
    if ceiling:
        print(f"bf16 GEMM 8192^3: {ceiling:.0f} TF/s", flush=True)
    sizes = [32] if args.tiny else [int(size) for size in args.sizes.split(",")]
    rows = [row for model in args.models.split(",") for size in sizes
            for row in model_rows(model, size, args.tiny, env, ceiling)]
    if not args.tiny:
        append_results("vae", rows, args.out)


if __name__ == "__main__":
    main()
