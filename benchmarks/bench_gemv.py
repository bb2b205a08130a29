"""Single-row (M=1) GEMV at the Qwen3.5-9B decode shapes (GPU): cuBLAS (torch.mm) against kernels/gemv.py, and
silu_mul + cuBLAS against silu_mul_gemv (down projection), gated_rms_norm + cuBLAS against gated_rms_norm_gemv
(Gated-DeltaNet out_proj); --sweep also times the GEMV kernel over tile
settings (how gemv's were chosen: results/sweep_gemv_71cb1b5.txt, run at 71cb1b5 as sweep_gemv.py).

    python3 benchmarks/bench_gemv.py [--sweep] [--out DIR]
    python3 benchmarks/bench_gemv.py --tiny     # CPU smoke run of this script's logic (TRITON_INTERPRET=1)

Timed as in the decode step: a CUDA graph of calls over distinct weight copies (together > 4x the L2 cache, so
weights stream from HBM), replayed; time per call. Each impl's output is checked against its fp32 reference
(gemv_ref / silu_mul_gemv_ref) and not timed when off by more than bf16 rounding allows. GB/s counts the weight
and the input read once; a pure read stream can exceed the copy bandwidth (which reads and writes).
Rows go to results/gemv.jsonl.
--tiny: the same rows at TINY_SHAPES on the CPU through Triton's interpreter, timed by the wall clock (no CUDA
graphs); prints the rows, appends nothing, and exits 1 if a row fails its check.
"""

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import append_results, bench_ms, copy_bandwidth_gbps, environment  # noqa: E402

from qwen_image_fast.kernels._utils import rel_rms_error  # noqa: E402
from qwen_image_fast.kernels.gemv import (  # noqa: E402
    _launch,
    gated_rms_norm_gemv,
    gated_rms_norm_gemv_ref,
    gemv,
    gemv_ref,
    silu_mul_gemv,
    silu_mul_gemv_ref,
)
from qwen_image_fast.kernels.rms_norm import gated_rms_norm  # noqa: E402
from qwen_image_fast.kernels.swiglu import silu_mul  # noqa: E402

SHAPES = {  # name: (N, K, prologue), weight [N, K]
    "gdn in_proj": (12352, 4096, "none"),
    "attn qkv": (10240, 4096, "none"),
    "out/o_proj": (4096, 4096, "none"),
    "gated_norm + out_proj": (4096, 4096, "gated_norm"),  # 32 value heads x 128
    "gate_up": (24576, 4096, "none"),
    "silu_mul + down": (4096, 12288, "silu_mul"),
    "lm_head": (248320, 4096, "none"),
}
# --tiny: Triton's interpreter runs a program op by op, so a few programs of BLOCK_N=16 rows and one K step each
TINY_SHAPES = {
    "gdn in_proj": (48, 256, "none"),
    "attn qkv": (40, 256, "none"),
    "out/o_proj": (16, 256, "none"),
    "gated_norm + out_proj": (16, 256, "gated_norm"),  # 2 value heads x 128
    "gate_up": (64, 256, "none"),
    "silu_mul + down": (16, 512, "silu_mul"),
    "lm_head": (96, 256, "none"),
}
TOL = 1e-2  # bf16 output rounding is ~2e-3 rel-RMS


def graph_us(fn, weights, x, reps: int = 20) -> float:
    """Time per call of fn(x, w) over all weights, from a replayed CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w in weights:
            fn(x, w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(x, w)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / reps / len(weights)


def wall_us(fn, weights, x) -> float:
    """--tiny: time per call of the same calls by the wall clock (no CUDA graphs on the CPU)."""
    return 1000 * bench_ms(lambda: [fn(x, w) for w in weights]) / len(weights)


def sweep_launcher(block_n, block_k, warps, stages):
    return lambda x, w: _launch(x, w, block_n=block_n, max_block_k=block_k, num_warps=warps, num_stages=stages)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", action="store_true", help="also time the kernel over tile settings")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (logic check; TRITON_INTERPRET=1)")
    args = parser.parse_args()
    device = torch.device("cpu" if args.tiny else "cuda")
    env = environment()
    copy_bw = copy_bandwidth_gbps(16 << 20 if args.tiny else 2 << 30)
    l2 = 0 if args.tiny else torch.cuda.get_device_properties(0).L2_cache_size  # the CPU run: 2 weight copies
    print(f"{env['gpu']}: copy {copy_bw:.0f} GB/s, L2 {l2 / 2**20:.0f} MiB")
    if args.tiny:
        print("--tiny: no CUDA graph replay on the CPU: the same calls timed by the wall clock")
    time_us = wall_us if args.tiny else graph_us
    rows = []
    for name, (n, k, prologue) in (TINY_SHAPES if args.tiny else SHAPES).items():
        copies = max(2, -(-4 * l2 // (n * k * 2)))
        torch.manual_seed(0)
        weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        x = torch.randn(1, 2 * k if prologue == "silu_mul" else k, device=device, dtype=torch.bfloat16) * 3
        if prologue == "silu_mul":
            ref_fn = silu_mul_gemv_ref
            impls = {"cublas": lambda x_, w_: torch.mm(silu_mul(x_), w_.T), "triton": silu_mul_gemv}
        elif prologue == "gated_norm":
            x = x.view(1, k // 128, 128)
            z = torch.randn(1, k // 128, 128, device=device, dtype=torch.bfloat16) * 3
            norm_w = 1 + 0.3 * torch.randn(128, device=device, dtype=torch.bfloat16)
            ref_fn = lambda x_, w_: gated_rms_norm_gemv_ref(x_, z, norm_w, w_)  # noqa: E731
            impls = {"cublas": lambda x_, w_: torch.mm(gated_rms_norm(x_, z, norm_w).view(1, -1), w_.T),
                     "triton": lambda x_, w_: gated_rms_norm_gemv(x_, z, norm_w, w_)}
        else:
            ref_fn = gemv_ref
            impls = {"cublas": lambda x_, w_: torch.mm(x_, w_.T), "triton": gemv}
        if args.sweep and prologue == "none":
            impls |= {f"triton BLOCK_N={bn} BLOCK_K={bk} w{w} s{s}": sweep_launcher(bn, bk, w, s)
                      for bn, bk, w, s in itertools.product((4, 8, 16, 32), (256, 512, 1024), (4, 8), (2, 4))}
        ref = ref_fn(x, weights[0])
        moved = n * k * 2 + x.numel() * 2 * (2 if prologue == "gated_norm" else 1)
        times = {}
        for impl, fn in impls.items():
            err = rel_rms_error(fn(x, weights[0]), ref)
            us = time_us(fn, weights, x) if err <= TOL else None
            times[impl] = us
            row = dict(env, bench="gemv", op=name, shape=f"1x{x.numel()} @ {n}x{k}",
                       impl=impl, us=us, gbps=moved / us / 1e3 if us else None,
                       fraction_of_copy=moved / us / 1e3 / copy_bw if us else None, rel_err=err, ok=us is not None,
                       copy_gbps=copy_bw)
            if not impl.startswith("triton BLOCK"):
                rows.append(row)
                speed = f"{us:8.2f} us {row['gbps']:5.0f} GB/s ({row['fraction_of_copy']:4.0%})" if us else "not timed"
                print(f"{row['op']:22} {impl:8} {speed}  err {err:.1e}{'' if us else ' FAILED'}", flush=True)
        if args.sweep and prologue == "none":
            best = sorted((us, impl) for impl, us in times.items() if us and impl.startswith("triton BLOCK"))[:3]
            for us, impl in best:
                print(f"    {impl}: {us:7.2f} us ({moved / us / 1e3 / copy_bw:4.0%})")
        if times["cublas"] and times["triton"]:
            print(f"{'':22} cublas / triton time: {times['cublas'] / times['triton']:.2f}x", flush=True)
        del weights
        torch.cuda.empty_cache()
    if not args.tiny:
        append_results("gemv", rows, args.out)
    elif not all(row["ok"] for row in rows):
        sys.exit("--tiny: a row failed its check (FAILED above)")


if __name__ == "__main__":
    main()
