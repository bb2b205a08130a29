"""Loading a full-size transformer from each checkpoint format (GPU, random weights): load time and peak host and GPU
memory, and whether each renders what the same weights from a diffusers folder render.

    python3 benchmarks/bench_checkpoint.py [--dir /tmp/qif-ckpt] [--out DIR]
    python3 benchmarks/bench_checkpoint.py --tiny  # CPU smoke run of this script's logic

The weights: a random full-size QwenImageTransformer2DModel (bf16) whose block linears are made exact e4m3 codes
times a power-of-two scale per tensor, with one code at 448: then the diffusers folder (bf16) and ComfyUI's scaled-FP8
file (core/single_file/writers.py: scale = amax / 448) mean the same weights exactly, and a BF16 load of either is
the same model. Formats (`format`), one on disk at a time:
- diffusers_folder: QwenImageTransformer2DModel.from_pretrained on the CPU, then from_diffusers onto the GPU (what
  QwenImageFastPipeline.from_pretrained does with a hub checkpoint), FP8 block linears quantized there;
- fast_folder: the folder FastQwenImageTransformer.save_pretrained writes, from_pretrained onto the GPU;
- comfy_scaled_fp8: ComfyUI's scaled-FP8 single file, from_single_file onto the GPU (codes and scales kept);
- gguf_q8_0: a GGUF file, block linears Q8_0 (ComfyUI-GGUF's rules), from_single_file (requantized to FP8).
Each load runs in a fresh process (`--load`): load_s (file to a usable model on the GPU), peak_host_gib (the
process's peak resident memory, VmHWM: the file's mapped pages included), peak_gpu_gib (peak allocated).
--formats picks some (the diffusers folder, the checks' reference, always runs): one 10-minute GPU call holds the
first three, not all four. The page cache is
dropped before each load where the machine allows it (root); the row says whether it was. Each loaded model then
denoises 4 Euler steps at 512x512 (32 x 32 tokens) from fixed noise and text.
Checks, before any row is recorded: the BF16 loads (FastTransformerConfig(fp8=False)) of the diffusers folder and of
the scaled-FP8 file give bit-equal latents (the GPU comparison of issue 45); the FP8 loads' latents sit within the
fp8 bound of the diffusers folder's BF16 latents.
--tiny: the same on the CPU with a test-size transformer in a temporary folder, each load in this process, rows
printed, not recorded.
Appends to results/checkpoint.jsonl (bench "checkpoint_formats").
"""

import argparse
import gc
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_transformer import FULL, TINY, make_stock  # noqa: E402
from common import append_results, environment, sync  # noqa: E402

from qwen_image_fast.kernels._utils import FP8_MAX, rel_rms_error  # noqa: E402
from qwen_image_fast.pipelines.core.config import FastTransformerConfig  # noqa: E402
from qwen_image_fast.pipelines.core.optimizations import BY_NAME  # noqa: E402
from qwen_image_fast.pipelines.core.single_file import writers  # noqa: E402
from qwen_image_fast.pipelines.qwen_image.model.transformer import FastQwenImageTransformer  # noqa: E402

FORMATS = ("diffusers_folder", "fast_folder", "comfy_scaled_fp8", "gguf_q8_0")
GIB = 2**30
STEPS = 4
# the test-size transformer with widths of whole Q8_0 blocks (2 heads x 16), so GGUF quantizes its block linears
TINY_SIZES = TINY.__class__(**{**TINY.__dict__, "heads": 2, "config": {**TINY.config, "num_attention_heads": 2}})


def peak_resident_gib() -> float:
    """This process's peak resident memory (VmHWM: anonymous and mapped file pages), counted from its exec. Not
    getrusage's ru_maxrss: Linux carries the forking parent's peak into a child across exec, and this script's
    parent holds the 40 GB stock model (the first H200 run's rows read 58.7 GiB for every load so)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / GIB
    raise RuntimeError("no VmHWM in /proc/self/status")


def drop_page_cache() -> bool:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def e4m3_exact(model):
    """Each block weight w -> e4m3 codes of w / s times s, s a power of two, one code at 448 (so amax / 448 = s): the
    same values in bf16 and in a scaled-FP8 file."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if writers.quantized_weight(name, p):
                s = 2.0 ** torch.ceil(torch.log2(p.float().abs().amax() / FP8_MAX)).item()
                codes = (p.float() / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
                codes.view(-1)[0] = FP8_MAX
                p.copy_(codes.float() * s)


def denoise(model, tiny: bool) -> torch.Tensor:
    """STEPS Euler steps at 32 x 32 tokens (4 x 4 for --tiny) from fixed noise and text: the final latents minus the
    noise (what the model added: compared alone, the noise would hide its differences)."""
    device, dtype, config = model.device, model.dtype, model.config
    side, text = (4, 8) if tiny else (32, 64)
    g = torch.Generator(device).manual_seed(5)
    x = torch.randn(1, side * side, config.in_channels, device=device, dtype=dtype, generator=g)
    e = torch.randn(1, text, config.joint_attention_dim, device=device, dtype=dtype, generator=g)
    noise, sigmas = x.clone(), torch.linspace(1.0, 0.0, STEPS + 1)
    with torch.no_grad():
        for i in range(STEPS):
            t = torch.full((1,), float(sigmas[i]), device=device, dtype=dtype)
            v = model(hidden_states=x, encoder_hidden_states=e, timestep=t, img_shapes=[[(1, side, side)]]).sample
            x = x + (sigmas[i + 1] - sigmas[i]).item() * v
    return (x.float() - noise.float()).cpu()


def load(fmt: str, path: Path, fp8: bool, device: torch.device):
    config = FastTransformerConfig(fp8=fp8)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    if fmt == "diffusers_folder":
        from diffusers import QwenImageTransformer2DModel

        stock = QwenImageTransformer2DModel.from_pretrained(path, torch_dtype=dtype)
        return FastQwenImageTransformer.from_diffusers(stock, config, device=device)
    if fmt == "fast_folder":
        return FastQwenImageTransformer.from_pretrained(path, device=device, fast_config=config, torch_dtype=dtype)
    return FastQwenImageTransformer.from_single_file(path, config=path.parent / "config", fast_config=config,
                                                     torch_dtype=dtype, device=device)


def child(fmt: str, path: Path, fp8: bool, tiny: bool, result: Path):
    """One load in this fresh process, then the denoising; writes its numbers and latents to `result`."""
    device = torch.device("cpu" if tiny else "cuda")
    sync(device)
    t0 = time.perf_counter()
    model = load(fmt, path, fp8, device)
    sync(device)
    load_s = time.perf_counter() - t0
    peak_host = peak_resident_gib()
    peak_gpu = torch.cuda.max_memory_allocated() / GIB if device.type == "cuda" else None
    latents = denoise(model, tiny)
    torch.save(dict(load_s=load_s, peak_host_gib=peak_host, peak_gpu_gib=peak_gpu, latents=latents,
                    applied=[list(a) for a in (model.single_file.applied if model.single_file else ())]), result)


def measure(fmt: str, path: Path, fp8: bool, tiny: bool, folder: Path) -> dict:
    dropped = not tiny and drop_page_cache()
    result = folder / f"result-{fmt}-{fp8}.pt"
    if tiny:  # in this process: seconds instead of a process start per load (the peaks mean nothing at this size)
        child(fmt, path, fp8, tiny, result)
    else:
        subprocess.run([sys.executable, __file__, "--load", fmt, str(path), "--fp8", str(int(fp8)), "--result",
                        str(result)], check=True)
    out = torch.load(result)
    out["page_cache_dropped"] = dropped
    print(f"{fmt:18} fp8={fp8!s:5} load {out['load_s']:7.2f} s  host peak {out['peak_host_gib']:6.2f} GiB  GPU peak "
          f"{out['peak_gpu_gib'] or 0:6.2f} GiB  (page cache dropped: {dropped})", flush=True)
    return out


def write(fmt: str, stock, folder: Path) -> Path:
    """The format's file or folder of `stock`'s weights (the diffusers config beside the single files)."""
    if fmt == "diffusers_folder":
        stock.save_pretrained(folder / fmt)
        return folder / fmt
    if fmt == "fast_folder":
        fast = FastQwenImageTransformer.from_diffusers(stock, FastTransformerConfig(fp8=True),
                                                       device="cpu" if stock.device.type == "cpu" else "cuda")
        fast.save_pretrained(folder / fmt)
        del fast
        gc.collect()
        torch.cuda.empty_cache()
        return folder / fmt
    (folder / "config").mkdir(exist_ok=True)
    stock.save_config(folder / "config")
    suffix = "gguf" if fmt.startswith("gguf") else "safetensors"
    return writers.write(stock.state_dict(), folder / f"{fmt}.{suffix}", {"comfy_scaled_fp8": "comfyui_scaled_fp8"}
                         .get(fmt, fmt))


def run(folder: Path, out: Path | None, tiny: bool, formats=FORMATS):
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    print(f"disk: {shutil.disk_usage(folder).free / GIB:.1f} GiB free at {folder}", flush=True)
    stock = make_stock(sizes=TINY_SIZES if tiny else FULL).to(torch.bfloat16)  # every format holds bf16 floats
    e4m3_exact(stock)
    stock = stock.to("cpu")  # the loads get the GPU to themselves
    gc.collect()
    torch.cuda.empty_cache()
    results, exact = {}, {}
    for fmt in formats:
        t0 = time.perf_counter()
        path = write(fmt, stock, folder)
        print(f"{fmt}: written in {time.perf_counter() - t0:.1f} s", flush=True)
        results[fmt] = measure(fmt, path, True, tiny, folder)
        if fmt in ("diffusers_folder", "comfy_scaled_fp8"):  # the same weights in BF16 from both
            exact[fmt] = measure(fmt, path, False, tiny, folder)["latents"]
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    reference = exact["diffusers_folder"]
    same = torch.equal(exact.get("comfy_scaled_fp8", reference), reference) and bool(torch.isfinite(reference).all())
    bound = BY_NAME["fp8"].bound.tiny if tiny else BY_NAME["fp8"].bound.full
    errors = {fmt: rel_rms_error(r["latents"], reference) for fmt, r in results.items()}
    print(f"check: BF16 loads of the scaled-FP8 file and the diffusers folder bit-equal: {same}; FP8 loads' rel-RMS "
          f"vs that: " + ", ".join(f"{fmt} {err:.2e}" for fmt, err in errors.items()) + f" (bound {bound})", flush=True)
    if not same or any(err > bound for err in errors.values()):
        print("FAILED the check: no row recorded", flush=True)
        sys.exit(1)
    base = results["diffusers_folder"]["load_s"]
    rows = [dict(environment(), bench="checkpoint_formats", format=fmt, load_s=r["load_s"],
                 peak_host_gib=r["peak_host_gib"], peak_gpu_gib=r["peak_gpu_gib"], speedup_vs_diffusers=base / r["load_s"],
                 latents_rel_rms_vs_bf16_folder=errors[fmt], bf16_bit_equal_to_folder=same if fmt in exact else None,
                 page_cache_dropped=r["page_cache_dropped"], applied=r["applied"], steps=STEPS)
            for fmt, r in results.items()]
    for row in rows:
        print(f"{row['format']:18} {row['load_s']:7.2f} s ({row['speedup_vs_diffusers']:.2f}x)  host "
              f"{row['peak_host_gib']:6.2f} GiB  GPU {row['peak_gpu_gib'] or 0:6.2f} GiB", flush=True)
    if not tiny:
        append_results("checkpoint", rows, out)
    shutil.rmtree(folder)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true", help="a test-size transformer on the CPU (logic check)")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/qif-ckpt"))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--formats", default=",".join(FORMATS), help=f"some of {','.join(FORMATS)}")
    parser.add_argument("--load", nargs=2, metavar=("FORMAT", "PATH"), help=argparse.SUPPRESS)
    parser.add_argument("--fp8", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    formats = ("diffusers_folder",) + tuple(f for f in args.formats.split(",") if f != "diffusers_folder")
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown:
        parser.error(f"--formats {args.formats}: {unknown} not among {', '.join(FORMATS)}")
    if args.load:
        child(args.load[0], Path(args.load[1]), bool(args.fp8), args.tiny, args.result)
    elif args.tiny:
        with tempfile.TemporaryDirectory() as tmp:
            run(Path(tmp) / "ckpt", args.out, tiny=True, formats=formats)
    else:
        run(args.dir, args.out, tiny=False, formats=formats)


if __name__ == "__main__":
    main()
