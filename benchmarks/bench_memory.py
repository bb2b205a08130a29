"""The whole pipeline in 24 GiB (GPU): FastConfig(memory="low") under a memory cap against the unconstrained fast
pipeline, with and without the modulation table.

    python3 benchmarks/bench_memory.py --tokenizer DIR --size 1024 [--cap-gib 24] [--out DIR]
    python3 benchmarks/bench_memory.py --tiny [--vae-only]  # CPU smoke run of this script's logic

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
--tiny: the tiny random pipeline (pipelines/tiny.py, fp32, FP8 on) on the CPU at 16x16, 2 steps, no warm-up call, 1
prompt for the 8 (--vae-only: the tiny VAE, 16x16 for 1:1); what only CUDA has is skipped (the cap, peak counters:
None, pinned host memory); the table held to fp32's last bits (TINY_TABLE_TOL); rows printed, not recorded.
With --budgets 16,12 (issue: 2512 under 16 GiB) the rows are instead "uncapped" (the fast pipeline) and one
"cap<N>" per budget: FastConfig(memory="low", max_memory_gib=N) after set_per_process_memory_fraction(N GiB less
the CUDA context), so that reserved memory plus the context stays within N; per image of the 8 prompts
(s_per_image), peak reserved, the blocks and text layers streamed, the bytes a step streams and the host-to-device
bandwidth of those copies (timed alone, copy_gb_per_s), the step time against uncapped, and the overlap this implies
(1 - the step's extra time / its copy time). Latents equal to the fast pipeline's, or nothing is recorded.
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
from qwen_image_fast.kernels._utils import rel_rms_error  # noqa: E402
from qwen_image_fast.pipelines.tiny import TINY_VAE, tiny_pipeline  # noqa: E402

PROMPTS = [f"{PROMPT}, view {k}" for k in range(8)]
STEPS = 50
GIB = 2**30
# A table runs each block's modulation GEMM once over every step's rows, a forward over its own rows: the same sums,
# in an order a GEMM may pick by row count (model/modulation.py). BF16 on the GPU comes out bit-equal
# (results/memory.jsonl); fp32 on the CPU does not, so --tiny holds the table's latents to fp32's last bits (rel-RMS,
# as tests/pipelines/test_modulation.py's TABLE_TOL).
TINY_TABLE_TOL = 1e-6


def call(pipe, size, steps, device, prompt=PROMPT, **kwargs):
    """(latents, images) of one call; prompt embeddings in kwargs replace the prompt."""
    text = {} if "prompt_embeds" in kwargs else dict(prompt=prompt, negative_prompt=NEGATIVE)
    latents = pipe(**text, true_cfg_scale=4.0, width=size, height=size, num_inference_steps=steps,
                   generator=torch.Generator(device).manual_seed(0), output_type="latent", **kwargs).images
    return latents, pipe.decode_latents(latents, size, size, output_type="pt")


def timed(fn, device):
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


def one_and_eight(pipe, size, steps, device, prompts, pre_encode: bool, eight: bool = True):
    """(latents of one image, s for 1 image, s per image over the prompts (None when not eight))."""
    if device.type == "cuda":  # warm-up: graphs for this size, kernels (neither on --tiny's CPU)
        call(pipe, size, 2, device)
    (latents, _), one = timed(lambda: call(pipe, size, steps, device), device)

    def run_eight():
        if not pre_encode:
            for p in prompts:
                call(pipe, size, steps, device, prompt=p)
            return
        negative = pipe.encode_prompt(NEGATIVE, device=device)
        encoded = [pipe.encode_prompt(p, device=device) for p in prompts]  # the text encoder's one turn
        for embeds, mask in encoded:
            call(pipe, size, steps, device, prompt_embeds=embeds, prompt_embeds_mask=mask,
                 negative_prompt_embeds=negative[0], negative_prompt_embeds_mask=negative[1])

    if not eight:
        return latents, one, None
    _, total = timed(run_eight, device)
    return latents, one, total / len(prompts)


def table_cost(pipe, steps, device) -> float:
    """Seconds to build the modulation tables of a new schedule of `steps` steps (the batched-CFG one)."""
    transformer = pipe.transformer
    transformer.modulation_tables.clear()
    schedule = torch.linspace(1.0, 0.02, steps, device=device, dtype=transformer.dtype)[:, None].expand(-1, 2)
    _, seconds = timed(lambda: transformer.modulation_table(schedule), device)
    transformer.modulation_tables.clear()
    return seconds


def vae_decode_rows(env, device, tiny: bool) -> list[dict]:
    """The VAE decode of one image at every official size (cli.jobs.ASPECTS) as the pipeline runs it (the 2D decode):
    seconds and the peak it adds over what was allocated before (max_memory_allocated and reserved rise; None on the
    CPU). tiny: the tiny VAE (fp32) at each aspect, tiny sizes."""
    from diffusers import AutoencoderKLQwenImage

    from qwen_image_fast.pipelines.qwen_image.model.vae import decode_image
    from qwen_image_fast.cli.jobs import ASPECTS, tiny_aspect

    vae = (AutoencoderKLQwenImage(**TINY_VAE) if tiny else AutoencoderKLQwenImage().to(device, torch.bfloat16)).eval()
    scale = 2 ** len(vae.config.temperal_downsample)  # 8 (the tiny VAE's: 4)
    cuda = device.type == "cuda"
    rows = []
    for aspect, size in ASPECTS.items():
        # tiny: a quarter of a test model's size (tiny_aspect's 64x64 takes ~2 s a decode in Triton's interpreter),
        # multiples of the tiny VAE's 4x: 16x16 for 1:1
        width, height = [side // 4 for side in tiny_aspect(*size)] if tiny else size
        latents = torch.randn(1, vae.config.z_dim, 1, height // scale, width // scale, device=device, dtype=vae.dtype)
        with torch.no_grad():
            decode_image(vae, latents)  # warm-up
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
            image, seconds = timed(lambda: decode_image(vae, latents), device)
        allocated_rise = (torch.cuda.max_memory_allocated() - allocated) / GIB if cuda else None
        reserved_rise = (torch.cuda.max_memory_reserved() - reserved) / GIB if cuda else None
        rows.append(dict(env, bench="memory", variant="vae decode", resolution=f"{width}x{height}", aspect=aspect,
                         vae_s=seconds, vae_peak_allocated_rise_gib=allocated_rise,
                         vae_peak_reserved_rise_gib=reserved_rise, ok=bool(torch.isfinite(image).all())))
        print({k: v for k, v in rows[-1].items() if k not in env}, flush=True)
        del image
    return rows


def peak_gib(device, reserved: bool = False) -> float | None:
    """CUDA's peak allocated (or reserved) GiB since its last reset; None on the CPU (--tiny), which keeps none."""
    if device.type != "cuda":
        return None
    return (torch.cuda.max_memory_reserved() if reserved else torch.cuda.max_memory_allocated()) / GIB


def copy_bandwidth(stream, device) -> float | None:
    """GB/s of the streamed layers' host-to-device copies, timed alone on the stream's side stream (None on the CPU
    or with nothing streamed)."""
    if stream is None or device.type != "cuda":
        return None
    copies = list(stream.copies.values())
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    with torch.cuda.stream(stream.side):
        start.record()
        for slot, host in copies:
            slot.copy_(host, non_blocking=True)
        stop.record()
    torch.cuda.synchronize()
    return sum(host.numel() for _, host in copies) / (start.elapsed_time(stop) / 1e3) / 1e9


def profiled_overlap(pipe, size, device) -> dict:
    """A 2-step call under the profiler (CUDA activities; the transformer's turn already in and the 2-step table
    built by a call before it): the host-to-device copies of 1 ms or more (the streamed blocks', 217 MiB each at the
    real size), their bandwidth, and the fraction of their time during which a kernel ran (the overlap). Empty on
    the CPU (no CUDA activity)."""
    if device.type != "cuda":
        return {}
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    negative, prompt = pipe.encode_prompt(NEGATIVE, device=device), pipe.encode_prompt(PROMPT, device=device)
    text = dict(prompt_embeds=prompt[0], prompt_embeds_mask=prompt[1], negative_prompt_embeds=negative[0],
                negative_prompt_embeds_mask=negative[1])
    call(pipe, size, 2, device, **text)  # the blocks' turn, the 2-step table, the graphs
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call(pipe, size, 2, device, **text)
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    copies = [(e.time_range.start, e.time_range.end) for e in events
              if "HtoD" in e.name and e.time_range.end - e.time_range.start >= 1000]  # microseconds
    busy = []  # the union of the kernels' intervals
    for start, end in sorted((e.time_range.start, e.time_range.end) for e in events if "Mem" not in e.name):
        if busy and start <= busy[-1][1]:
            busy[-1][1] = max(busy[-1][1], end)
        else:
            busy.append([start, end])
    copy_us = sum(end - start for start, end in copies)
    hidden_us = sum(max(0, min(end, b_end) - max(start, b_start)) for start, end in copies for b_start, b_end in busy)
    streamed = pipe._turns.arenas["transformer"]
    return dict(profile_copies=len(copies), profile_copy_ms=copy_us / 1e3,
                profile_copy_gb_per_s=len(copies) * streamed.layer_stride / copy_us / 1e3 if copy_us else None,
                profile_overlap=hidden_us / copy_us if copy_us else None)


def streaming_rows(make_stock, args, size, steps, device, prompts, env) -> list[dict]:
    """--budgets: the fast pipeline uncapped, then memory="low" with each budget under its cap (module docstring).
    make_stock() builds the stock pipeline, dropped here once converted (its BF16 blocks are not the fast ones)."""
    cuda = device.type == "cuda"
    fast = QwenImageFastPipeline.from_pipe(make_stock(), fast_config=FastConfig(), device=device)
    fast.set_progress_bar_config(disable=True)
    gc.collect()
    torch.cuda.empty_cache()
    expected, one, per_image = one_and_eight(fast, size, steps, device, prompts, pre_encode=False)
    rows = [dict(variant="uncapped", one_image_s=one, s_per_image=per_image, peak_reserved_gib=peak_gib(device, True),
                 applied=fast.applied)]
    components = {name: getattr(fast, name) for name in ("scheduler", "vae", "text_encoder", "tokenizer", "transformer")}
    del fast
    for budget in args.budgets:
        gc.collect()
        torch.cuda.empty_cache()
        if cuda:
            torch.cuda.set_per_process_memory_fraction(1.0)
        low = QwenImageFastPipeline(**components, fast_config=FastConfig(memory="low", max_memory_gib=budget))
        low.set_progress_bar_config(disable=True)
        context = None
        if cuda:
            free, total = torch.cuda.mem_get_info()
            context = (total - free - torch.cuda.memory_reserved()) / GIB
            torch.cuda.set_per_process_memory_fraction((budget - context) * GIB / total)
            torch.cuda.reset_peak_memory_stats()
        latents, one, per_image = one_and_eight(low, size, steps, device, prompts, pre_encode=True)
        blocks, text = low._turns.arenas["transformer"], low._turns.arenas["text_encoder"]
        streamed_bytes = len(blocks.streamed) * blocks.layer_stride
        bandwidth = copy_bandwidth(blocks.stream, device)
        copy_s = streamed_bytes / (bandwidth * 1e9) if bandwidth else None
        extra = (per_image - rows[0]["s_per_image"]) / steps  # per step (one batched-CFG forward), over uncapped
        rows.append(dict(
            variant=f"cap{budget:g}", max_memory_gib=budget, one_image_s=one, s_per_image=per_image,
            peak_reserved_gib=peak_gib(device, True), peak_allocated_gib=peak_gib(device), context_gib=context,
            buffer_gib=low._turns.buffer_bytes / GIB, streamed_blocks=len(blocks.streamed),
            blocks=len(blocks.layer_ranges),
            streamed_text_layers=len(text.layer_ranges) - text.resident_layers(low._turns.buffer_bytes),
            text_layers=len(text.layer_ranges), copy_gb_per_step=streamed_bytes / 1e9, copy_gb_per_s=bandwidth,
            copy_ms_per_step=copy_s * 1e3 if copy_s else None, step_extra_ms=extra * 1e3,
            overlap=1 - max(0.0, extra) / copy_s if copy_s else None,
            per_image_vs_uncapped=per_image / rows[0]["s_per_image"], equal_to_fast=torch.equal(latents, expected),
            applied=low.applied))
        try:  # after the measured rows: a profiler that cannot trace here costs the profile only
            rows[-1].update(profiled_overlap(low, size, device))
        except Exception as e:
            rows[-1]["profile_error"] = f"{type(e).__name__}: {e}"
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in rows[-1].items()}, flush=True)
        components = {name: getattr(low, name) for name in components}
        del low, blocks, text  # the arena holds its turn's slots: the next budget's buffer would come on top
    for row in rows:
        row.update(env, size=size, ok=all(r.get("equal_to_fast", True) for r in rows))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny random components on the CPU (logic check)")
    parser.add_argument("--tokenizer", type=Path)
    parser.add_argument("--vae-only", action="store_true",
                        help="only the VAE decode's time and peak at every official size (no pipeline)")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--cap-gib", type=float, default=24.0)
    parser.add_argument("--table-one-image", action="store_true",
                        help="the unconstrained table row for 1 image only (a shorter run)")
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), choices=range(1, len(PROMPTS) + 1),
                        metavar="N", help="how many of the 8 prompts the per-image time runs over (default 8)")
    parser.add_argument("--budgets", type=lambda text: [float(v) for v in text.split(",")], default=None,
                        help="comma-separated GiB, e.g. 16,12: the uncapped and cap<N> streaming rows instead")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device("cpu" if args.tiny else "cuda")
    cuda = device.type == "cuda"
    if args.tiny:
        print("--tiny skips what only CUDA has: the memory cap (torch.cuda.set_per_process_memory_fraction), the "
              "peak memory counters (peaks reported as None) and pinned host buffers (low's weights take turns from "
              "plain host memory)", flush=True)
    if args.vae_only:
        rows = vae_decode_rows(environment(), device, args.tiny)
        if not args.tiny:
            append_results("memory", rows, args.out)
        return
    if args.tokenizer is None and not args.tiny:
        parser.error("--tokenizer DIR is needed (all but --vae-only and --tiny)")
    if args.tiny:  # 16x16: 2x2 tokens (the tiny VAE's 4x, then 2x2 patches); 1 prompt stands for the 8
        size, steps, prompts, text_encoder = 16, 2, PROMPTS[:1], "tiny Qwen2.5-VL (pipelines/tiny.py), random"
    else:
        size, steps, prompts, text_encoder = (args.size, STEPS, PROMPTS[:args.prompts],
                                              "Qwen2.5-VL-7B text shapes (28 layers), random")
    env = dict(environment(), bench="memory", resolution=f"{size}x{size}", steps=steps, true_cfg_scale=4.0,
               text_encoder=text_encoder, prompts=len(prompts))
    def make_stock():
        return tiny_pipeline() if args.tiny else full_size_stock_pipeline(args.tokenizer, full_text_encoder=True)

    if args.budgets:
        rows = streaming_rows(make_stock, args, size, steps, device, prompts, env)
        if not rows[0]["ok"]:
            print("FAILED: a budget's latents differ from the fast pipeline's (no speed recorded)", flush=True)
            sys.exit(1)
        if not args.tiny:
            append_results("memory", rows, args.out)
        return
    stock = make_stock()
    fast = QwenImageFastPipeline.from_pipe(stock, fast_config=FastConfig(modulation_table=False), device=device)
    del stock
    gc.collect()
    torch.cuda.empty_cache()  # the stock BF16 blocks (only the shared modules stay)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    fast.set_progress_bar_config(disable=True)
    rows = []

    plain_latents, plain_one, plain_eight = one_and_eight(fast, size, steps, device, prompts, pre_encode=False)
    rows.append(dict(variant="fast, no table", one_image_s=plain_one, per_image_of_8_s=plain_eight))
    fast.fast_config = FastConfig()  # the same pipeline with the table (a loop setting)
    table_latents, table_one, table_eight = one_and_eight(fast, size, steps, device, prompts, pre_encode=False,
                                                          eight=not args.table_one_image)
    table_equal = (torch.equal(table_latents, plain_latents) if cuda else
                   rel_rms_error(table_latents, plain_latents) <= TINY_TABLE_TOL)
    rows.append(dict(variant="fast", one_image_s=table_one, per_image_of_8_s=table_eight,
                     table_s=table_cost(fast, steps, device), equal_to_no_table=table_equal))
    peak_unconstrained = peak_gib(device)

    components = {name: getattr(fast, name) for name in ("scheduler", "vae", "text_encoder", "tokenizer", "transformer")}
    del fast
    gc.collect()
    torch.cuda.empty_cache()
    low = QwenImageFastPipeline(**components, fast_config=FastConfig(memory="low"))
    low.set_progress_bar_config(disable=True)
    del components
    gc.collect()
    torch.cuda.empty_cache()
    if cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(args.cap_gib * GIB / total)
        torch.cuda.reset_peak_memory_stats()
    low_latents, low_one, low_eight = one_and_eight(low, size, steps, device, prompts, pre_encode=True)
    low_equal = torch.equal(low_latents, table_latents)
    rows.append(dict(variant="low", one_image_s=low_one, per_image_of_8_s=low_eight,
                     table_s=table_cost(low, steps, device), equal_to_fast=low_equal,
                     cap_gib=args.cap_gib if cuda else None, peak_allocated_gib=peak_gib(device),
                     peak_reserved_gib=peak_gib(device, reserved=True), turns=low._turns.loads, applied=low.applied))
    rows[0]["peak_allocated_gib"] = peak_unconstrained
    ok = table_equal and low_equal
    for row in rows:
        row.update(env, ok=ok)
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items() if k not in env}, flush=True)
    if not ok:
        print(f"FAILED: table latents equal to no-table: {table_equal}; low equal to fast: {low_equal} "
              "(no speed recorded)", flush=True)
        sys.exit(1)
    if not args.tiny:
        append_results("memory", rows, args.out)


if __name__ == "__main__":
    main()
