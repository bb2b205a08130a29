"""One image on several GPUs (GPU, NCCL): the fast pipeline on 1 GPU vs CFG-parallel, Ulysses and both, each with
BF16 attention (FlashAttention-4 where installed) and with FP8 attention (cuDNN) where it combines.

    torchrun --nproc_per_node 2 benchmarks/bench_parallel.py [--tokenizer DIR] [--sizes 1024,1328]
        [--fp8-attention off,cudnn] [--out DIR]
    torchrun --nproc_per_node 2 benchmarks/bench_parallel.py --tiny     # CPU, gloo, tiny components: logic only

Every rank builds the same full-size random transformer and VAE (bench_transformer.make_stock, seeded) and
bench_pipeline's 1-layer text encoder, converts once per attention setting, then builds one QwenImageFastPipeline
per mode around the converted transformer (FastConfig(parallel=...)), each with its own CUDA graphs. Modes for
world size 2: cfg, ulysses; 4: ulysses (4 ranks), cfg,ulysses (2 x 2). FP8 attention with Ulysses is refused by
FastConfig (BF16 heads move between ranks): the refusal is printed in place of the row. The 1-GPU rows run the same
pipeline without a mesh on every rank at once (each GPU alone), timed on rank 0; a 1-GPU row without batched CFG
calibrates how far two correct runs drift apart over 50 steps.

Per row (50 Euler steps, true_cfg_scale=4, negative prompt): seconds per image (text encoding + denoising + VAE
decode), ms per step, speed-up and scaling efficiency (speed-up / GPUs) vs 1 GPU with the same attention, and where
the GPU time of 3 graphed steps goes on each rank (torch.profiler, the graphs' kernels included): NCCL kernels and
the rest, per rank. A collective's kernel also counts the time it waits for the slower rank, so a rank that computes
less shows more NCCL time: `rank_compute_ms` / `rank_nccl_ms` tell waiting (unequal compute) from transfer. Then
two distances from the 1-GPU run that computes the same batches on each GPU (`reference`: CFG-parallel's branches
run at batch 1, as the unbatched 1-GPU row; Ulysses batches them, as the 1-GPU row): the first step's update (one
Euler step from the same starting latents) and the latents after 50 steps. A row beyond STEP_GATE or FINAL_GATE is
printed and not recorded; the unbatched 1-GPU row with FP8 attention is held to FP8 attention's declared bound
instead (its per-tensor v scale is taken over the rows of its batch, so batching changes its rounding). Ulysses' all-to-all is also timed alone at a
block's shapes against an all-gather of the same bytes (`alltoall_probe`: achieved GB/s of each). Rank 0 appends
to results/parallel.jsonl.
"""

import argparse
import gc
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pipeline import NEGATIVE, PROMPT, full_size_stock_pipeline  # noqa: E402
from common import append_results, environment, sync  # noqa: E402

from qwen_image_fast import FastConfig, QwenImageFastPipeline  # noqa: E402
from qwen_image_fast.kernels._utils import rel_rms_error  # noqa: E402
from qwen_image_fast.pipelines.core.optimizations import FP8_ATTENTION_BOUND  # noqa: E402

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


def first_update(pipe, size: int, start: torch.Tensor, steps: int = STEPS) -> torch.Tensor:
    """The first of `steps` Euler steps from `start` (packed latents; the loop is interrupted after it): latents minus
    start, the first guided velocity times the step's sigma change."""
    seen = {}

    def first_step_only(pipe, step, t, tensors):
        seen["latents"] = tensors["latents"].float().clone()
        pipe._interrupt = True
        return {}

    pipe(prompt=PROMPT, negative_prompt=NEGATIVE, true_cfg_scale=4.0, width=size, height=size,
         num_inference_steps=steps, latents=start.clone(), output_type="latent", callback_on_step_end=first_step_only)
    return seen["latents"] - start.float()


def same_on_every_rank(pipe):
    """Rank 0's weights in every rank's components (random initialisation need not agree across processes: the
    transformer is seeded, but the text encoder and VAE use each process's own RNG state)."""
    for name in ("transformer", "vae", "text_encoder"):
        for tensor in getattr(pipe, name).state_dict().values():
            dist.broadcast(tensor, src=0)


def gpu_time_split(pipe, size: int, steps: int, device) -> dict:
    """Per rank, ms per step of GPU kernel time in NCCL and in everything else over `steps` graphed steps of a warm
    pipeline (its graphs captured), gathered on every rank; on the CPU (gloo) the profiler's CPU ops instead."""
    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        call(pipe, size, steps, device)
    times = [(e.key, e.self_device_time_total if device.type == "cuda" else e.self_cpu_time_total)
             for e in prof.key_averages() if e.device_type.name == activity.name]  # us
    total = sum(t for _, t in times)
    comm = sum(t for key, t in times if "nccl" in key.lower() or "gloo" in key.lower())
    mine = torch.tensor([(total - comm) / 1e3 / steps, comm / 1e3 / steps], dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return dict(rank_compute_ms=[t[0].item() for t in every], rank_nccl_ms=[t[1].item() for t in every],
                nccl_share=(every[0][1] / every[0].sum()).item())


def cfg_step_split(pipe, size: int, steps: int, device) -> dict:
    """CFG-parallel, per rank: ms per step from the end of one all-gather to the start of the next (this rank's
    forward, CFG combine and Euler step) and in the all-gather (its transfer and the wait for the slower rank), from
    CUDA events on the compute stream (no host synchronization in the loop; on the CPU, where gloo is synchronous,
    the host clock), over a timed call; gathered on every rank. What a step costs above half the unbatched 1-GPU
    step is one or the other."""
    mesh, marks = pipe.parallel, []
    gather = mesh.gather_cfg

    def stamp():
        if device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ms(start, end) -> float:
        return start.elapsed_time(end) if device.type == "cuda" else 1000 * (end - start)

    def timed(mine):
        before = stamp()
        out = gather(mine)
        marks.append((before, stamp()))
        return out

    mesh.gather_cfg = timed
    try:
        call(pipe, size, steps, device)
    finally:
        del mesh.gather_cfg
    sync(device)
    between = [ms(marks[i - 1][1], marks[i][0]) for i in range(1, len(marks))]
    waits = [ms(b, a) for b, a in marks[1:]]
    mine = torch.tensor([sum(between) / len(between), sum(waits) / len(waits), max(waits)], dtype=torch.float64,
                        device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return dict(rank_step_compute_ms=[t[0].item() for t in every], rank_gather_ms=[t[1].item() for t in every],
                rank_gather_max_ms=[t[2].item() for t in every])


def alltoall_probe(size: int, device, dtype) -> dict:
    """Ulysses' all-to-all of one block's stacked Q/K/V (batched CFG: B = 2, 24 heads x 128, `size`^2 image tokens
    and 218 text tokens split over the ranks) alone, against an all-gather of the same bytes per rank: ms and GB/s
    (bytes each rank sends and receives)."""
    world = dist.get_world_size()
    rows = ((size // 16) ** 2 + 218) // world
    qkv = torch.randn(world * rows, 3, 2, 24 // world, 128, device=device).to(dtype)
    recv = torch.empty_like(qkv)
    moved = qkv.numel() * qkv.element_size() * (world - 1) / world  # sent (and received) by each rank

    def a2a():
        dist.all_to_all_single(recv, qkv)

    part = qkv.flatten()[:qkv.numel() // world]
    gathered = torch.empty(world * part.numel(), dtype=dtype, device=device)

    def gather():
        dist.all_gather_into_tensor(gathered, part)

    result = {}
    for name, fn in (("all_to_all", a2a), ("all_gather", gather)):
        for _ in range(3):
            fn()
        sync(device)
        t0 = time.perf_counter()
        for _ in range(10):
            fn()
        sync(device)
        ms = (time.perf_counter() - t0) / 10 * 1e3
        result[name] = dict(ms=ms, gb_per_s=moved / ms / 1e6)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny random components on the CPU over gloo (logic check)")
    parser.add_argument("--sizes", default="1024,1328")
    parser.add_argument("--tokenizer", type=Path, default=None, help="a Qwen2.5 BPE tokenizer folder")
    parser.add_argument("--fp8-attention", default="off,cudnn",
                        help="the FP8-attention settings to run, one conversion each (off: BF16 attention)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    attentions = ("off",) if args.tiny else tuple(args.fp8_attention.split(","))
    local_rank = int(os.environ["LOCAL_RANK"])
    if args.tiny:
        device, dtype = torch.device("cpu"), torch.float32
        dist.init_process_group("gloo")
    else:
        torch.cuda.set_device(local_rank)
        device, dtype = torch.device("cuda", local_rank), torch.bfloat16
        dist.init_process_group("nccl", device_id=device)
    world, rank = dist.get_world_size(), dist.get_rank()
    if world not in MODES:
        raise SystemExit(f"world size {world}; this benchmark runs on {sorted(MODES)} GPUs")
    env = environment() if rank == 0 and not args.tiny else {}

    if args.tiny:
        from qwen_image_fast.pipelines.tiny import tiny_pipeline

        stock, sizes, steps = tiny_pipeline(transformer_config={"num_attention_heads": 4}), [32], 3
    else:
        stock, sizes, steps = full_size_stock_pipeline(args.tokenizer), list(map(int, args.sizes.split(","))), STEPS
        same_on_every_rank(stock)
    rows = []
    for attention in attentions:  # one converted transformer at a time (H100 memory)
        converted = QwenImageFastPipeline.from_pipe(
            stock, fast_config=FastConfig(fp8=not args.tiny, fp8_attention=attention), device=device)
        components = {name: getattr(converted, name) for name in ("scheduler", "vae", "text_encoder", "tokenizer",
                                                                  "transformer")}
        for size in sizes:
            # packed starting latents, the same on every rank: 2x2 patches of the VAE's latents (16 channels at 8x;
            # the tiny VAE's 4 channels at 4x)
            tokens, channels = ((size // 8) ** 2, 16) if args.tiny else ((size // 16) ** 2, 64)
            start = torch.randn(1, tokens, channels, device=device, generator=torch.Generator(device).manual_seed(1),
                                dtype=dtype)
            probe = alltoall_probe(32 if args.tiny else size, device, dtype)
            if rank == 0 and attention == "off":
                print(f"{size} Ulysses all-to-all of a block's Q/K/V alone: " + ", ".join(
                    f"{name} {r['ms']:.3f} ms ({r['gb_per_s']:.0f} GB/s)" for name, r in probe.items()), flush=True)
            one_gpu, one_gpu_s = {}, None  # 1-GPU label -> (latents, first update); the 1-GPU row's seconds
            modes = [("1gpu", "none", {}), ("1gpu-unbatched", "none", dict(batched_cfg=False))] + [
                (mode, mode, {}) for mode in MODES[world]]
            for label, mode, changes in modes:
                try:
                    config = converted.fast_config.replace(parallel=mode, **changes)
                except ValueError as e:
                    if rank == 0:
                        print(f"{size} {label:14s} fp8_attention={attention}: refused: {e}", flush=True)
                    continue
                pipe = QwenImageFastPipeline(**components, fast_config=config)
                pipe.set_progress_bar_config(disable=True)
                if not args.tiny:  # warm-up: graphs captured, NCCL communicators set up (no graphs on the CPU)
                    call(pipe, size, 2, device)
                update = first_update(pipe, size, start, steps)
                latents, denoise_s, decode_s = call(pipe, size, steps, device)
                seconds = denoise_s + decode_s
                split = gpu_time_split(pipe, size, 3, device) if mode != "none" else {}
                if mode == "cfg":
                    split |= cfg_step_split(pipe, size, steps, device)
                gpus = 1 if mode == "none" else world
                if mode == "none":
                    one_gpu[label] = latents.float(), update
                if label == "1gpu":
                    one_gpu_s = seconds
                # CFG-parallel runs each branch at batch 1 (the unbatched 1-GPU row), Ulysses both in one batch; the
                # unbatched row against the batched one is exact in BF16, and within FP8 attention's declared bound
                # with it (its per-tensor v scale is taken over the batch's rows)
                reference, reference_update = one_gpu["1gpu-unbatched" if mode == "cfg" else "1gpu"]
                err, step_err = rel_rms_error(latents.float(), reference), rel_rms_error(update, reference_update)
                gates = (STEP_GATE, FINAL_GATE) if attention == "off" or label != "1gpu-unbatched" else (
                    float("inf"), FP8_ATTENTION_BOUND.full)
                row = dict(bench="parallel", size=size, steps=steps, mode=label, gpus=gpus, world=world,
                           fp8_attention=attention, s_per_image=seconds, ms_per_step=1000 * denoise_s / steps,
                           vae_s=decode_s, speedup_vs_1gpu=one_gpu_s / seconds,
                           scaling_efficiency=one_gpu_s / seconds / gpus, nccl_share=split.get("nccl_share", 0.0),
                           rank_compute_ms=split.get("rank_compute_ms"), rank_nccl_ms=split.get("rank_nccl_ms"),
                           alltoall_probe=probe if "ulysses" in mode else None,
                           rank_step_compute_ms=split.get("rank_step_compute_ms"),
                           rank_gather_ms=split.get("rank_gather_ms"), rank_gather_max_ms=split.get("rank_gather_max_ms"),
                           reference="1gpu-unbatched" if mode == "cfg" else "1gpu",
                           first_step_rel_rms_vs_1gpu=step_err, latent_rel_rms_vs_1gpu=err, applied=pipe.applied)
                if rank == 0:
                    ranks = "" if not split else "  per rank compute/NCCL ms per step " + " ".join(
                        f"{c:.1f}/{n:.1f}" for c, n in zip(split["rank_compute_ms"], split["rank_nccl_ms"]))
                    if "rank_gather_ms" in split:
                        ranks += "  per rank step/all-gather ms " + " ".join(
                            f"{c:.2f}/{g:.2f} (max {m:.2f})" for c, g, m in zip(
                                split["rank_step_compute_ms"], split["rank_gather_ms"], split["rank_gather_max_ms"]))
                    print(f"{size} {label:14s} fp8_attention={attention:5s} {seconds:6.2f} s  "
                          f"{row['ms_per_step']:6.1f} ms/step  x{row['speedup_vs_1gpu']:.2f} "
                          f"(eff {row['scaling_efficiency']:.2f})  NCCL {100 * row['nccl_share']:4.1f}%{ranks}  "
                          f"vs 1 GPU: first step {step_err:.2e}, {steps} steps {err:.2e}  {pipe.applied}", flush=True)
                    if step_err > gates[0] or err > gates[1]:
                        print(f"  FAILED the gates {gates[0]} / {gates[1]}: not recorded", flush=True)
                    else:
                        rows.append(env | row)
                del pipe
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        del converted, components
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if rank == 0 and not args.tiny:
        append_results("parallel", rows, args.out)
    elif rank == 0:
        print(f"tiny run: {len(rows)} rows passed their gates (not recorded)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
