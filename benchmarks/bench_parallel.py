"""One image on several GPUs (GPU, NCCL): the fast pipeline on 1 GPU vs CFG-parallel, Ulysses and both.

    torchrun --nproc_per_node 2 benchmarks/bench_parallel.py [--tokenizer DIR] [--sizes 1024,1328] [--out DIR]

Every rank builds the same full-size random transformer and VAE (bench_transformer.make_stock, seeded) and
bench_pipeline's 1-layer text encoder, converts once, then builds one QwenImageFastPipeline per mode around the
converted transformer (FastConfig(parallel=...)), each with its own CUDA graphs. Modes for world size 2: cfg,
ulysses; 4: ulysses (4 ranks), cfg,ulysses (2 x 2). The 1-GPU rows run the same pipeline without a mesh on every
rank at once (each GPU alone), timed on rank 0; a 1-GPU row without batched CFG calibrates how far two correct
runs drift apart over 50 steps.

Per row (1024^2 and 1328^2, 50 Euler steps, true_cfg_scale=4, negative prompt): seconds per image (text encoding +
denoising + VAE decode), ms per step, speed-up and scaling efficiency (speed-up / GPUs) vs 1 GPU, the share of
the GPU time spent in NCCL kernels (torch.profiler over 3 eager steps on rank 0; a collective's kernel also counts
the time it waits for the slower rank), and two distances from the 1-GPU run: the first step's update (one Euler
step from the same starting latents: the guided velocity, where two correct runs differ by bf16 rounding only) and
the latents after 50 steps (random weights amplify any rounding difference over the steps: compare with the
unbatched 1-GPU row). A row beyond STEP_GATE or FINAL_GATE is printed and not recorded. Rank 0 appends to
results/parallel.jsonl.
"""

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pipeline import NEGATIVE, PROMPT, full_size_stock_pipeline  # noqa: E402
from common import append_results, environment, sync  # noqa: E402

from qwen_image_fast import FastConfig, QwenImageFastPipeline, optimize  # noqa: E402
from qwen_image_fast.kernels._utils import rel_rms_error  # noqa: E402

STEPS = 50
STEP_GATE = 2e-2  # first-step update vs 1 GPU: bf16 rounding of other GEMM shapes and batch sizes
FINAL_GATE = 0.1  # latents after 50 steps vs 1 GPU: a sanity bound (the unbatched 1-GPU row shows the drift)
MODES = {2: ("cfg", "ulysses"), 4: ("ulysses", "cfg,ulysses")}


def call(pipe, size: int, steps: int, device) -> tuple[torch.Tensor, float, float]:
    """(latents, seconds of text encoding + denoising, seconds of VAE decode)."""
    sync(device)
    t0 = time.perf_counter()
    latents = pipe(prompt=PROMPT, negative_prompt=NEGATIVE, true_cfg_scale=4.0, width=size, height=size,
                   num_inference_steps=steps, generator=torch.Generator(device).manual_seed(0),
                   output_type="latent").images
    sync(device)
    t1 = time.perf_counter()
    pipe.decode_latents(latents, size, size, output_type="np")
    sync(device)
    return latents, t1 - t0, time.perf_counter() - t1


def first_update(pipe, size: int, start: torch.Tensor) -> torch.Tensor:
    """The first of 50 Euler steps from `start` (packed latents; the loop is interrupted after it): latents minus
    start, the first guided velocity times the step's sigma change."""
    seen = {}

    def first_step_only(pipe, step, t, tensors):
        seen["latents"] = tensors["latents"].float().clone()
        pipe._interrupt = True
        return {}

    pipe(prompt=PROMPT, negative_prompt=NEGATIVE, true_cfg_scale=4.0, width=size, height=size,
         num_inference_steps=STEPS, latents=start.clone(), output_type="latent", callback_on_step_end=first_step_only)
    return seen["latents"] - start.float()


def same_on_every_rank(pipe):
    """Rank 0's weights in every rank's components (random initialisation need not agree across processes: the
    transformer is seeded, but the text encoder and VAE use each process's own RNG state)."""
    for name in ("transformer", "vae", "text_encoder"):
        for tensor in getattr(pipe, name).state_dict().values():
            dist.broadcast(tensor, src=0)


def nccl_share(components: dict, mode: str, size: int, device) -> float:
    """Fraction of the GPU kernel time of 3 denoising steps spent in NCCL kernels (rank 0's view), run eagerly
    (the profiler sees each kernel; the graphs replay the same ones)."""
    from torch.profiler import ProfilerActivity, profile

    pipe = QwenImageFastPipeline(**components, fast_config=FastConfig(parallel=mode, cuda_graphs=False))
    pipe.set_progress_bar_config(disable=True)
    call(pipe, size, 1, device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call(pipe, size, 3, device)
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.self_device_time_total for e in events)
    nccl = sum(e.self_device_time_total for e in events if "nccl" in e.key.lower())
    return nccl / total if total else float("nan")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1024,1328")
    parser.add_argument("--tokenizer", type=Path, default=None, help="a Qwen2.5 BPE tokenizer folder")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=device)
    world, rank = dist.get_world_size(), dist.get_rank()
    if world not in MODES:
        raise SystemExit(f"world size {world}; this benchmark runs on {sorted(MODES)} GPUs")
    env = environment() if rank == 0 else {}

    stock = full_size_stock_pipeline(args.tokenizer)
    same_on_every_rank(stock)
    base = optimize(stock, FastConfig())
    components = {name: getattr(base, name) for name in ("scheduler", "vae", "text_encoder", "tokenizer",
                                                         "transformer")}
    rows = []
    for size in map(int, args.sizes.split(",")):
        start = torch.randn(1, (size // 16) ** 2, 64, device=device, generator=torch.Generator(device).manual_seed(1),
                            dtype=torch.bfloat16)  # packed starting latents, the same on every rank
        reference, one_gpu_s, one_gpu_update = None, None, None
        for label, mode, config in [("1gpu", "none", FastConfig()),
                                    ("1gpu-unbatched", "none", FastConfig(batched_cfg=False))] + [
                                       (mode, mode, FastConfig(parallel=mode)) for mode in MODES[world]]:
            pipe = QwenImageFastPipeline(**components, fast_config=config)
            pipe.set_progress_bar_config(disable=True)
            call(pipe, size, 2, device)  # warm-up: graphs captured, NCCL communicators set up
            update = first_update(pipe, size, start)
            latents, denoise_s, decode_s = call(pipe, size, STEPS, device)
            seconds = denoise_s + decode_s
            share = nccl_share(components, mode, size, device) if mode != "none" else 0.0
            gpus = 1 if mode == "none" else world
            if label == "1gpu":
                reference, one_gpu_s, one_gpu_update = latents.float(), seconds, update
            err, step_err = rel_rms_error(latents.float(), reference), rel_rms_error(update, one_gpu_update)
            row = dict(bench="parallel", size=size, steps=STEPS, mode=label, gpus=gpus, world=world,
                       s_per_image=seconds, ms_per_step=1000 * denoise_s / STEPS, vae_s=decode_s,
                       speedup_vs_1gpu=one_gpu_s / seconds, scaling_efficiency=one_gpu_s / seconds / gpus,
                       nccl_share=share, first_step_rel_rms_vs_1gpu=step_err, latent_rel_rms_vs_1gpu=err,
                       applied=pipe.applied)
            if rank == 0:
                print(f"{size} {label:14s} {seconds:6.2f} s  {row['ms_per_step']:6.1f} ms/step  "
                      f"x{row['speedup_vs_1gpu']:.2f} (eff {row['scaling_efficiency']:.2f})  NCCL {100 * share:4.1f}%"
                      f"  vs 1 GPU: first step {step_err:.2e}, 50 steps {err:.2e}  {pipe.applied}", flush=True)
                if step_err > STEP_GATE or err > FINAL_GATE:
                    print(f"  FAILED the gates {STEP_GATE} / {FINAL_GATE}: not recorded", flush=True)
                else:
                    rows.append(env | row)
            del pipe
            torch.cuda.empty_cache()
    if rank == 0:
        append_results("parallel", rows, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
