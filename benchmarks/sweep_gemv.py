"""Single-token (M=1) bf16 GEMV at the Qwen3.5-9B decode shapes: cuBLAS (F.linear) against a Triton GEMV over a
sweep of tile settings. Decides whether a Triton GEMV, into which the decode step's norms could later fuse, can
match cuBLAS, which runs these at 64-88% of copy bandwidth in the B=1 profile (splitK for N=4096).

Timing as in the decode step: a CUDA graph of GEMVs over distinct weight copies (> 4x the L2 cache in all), replayed;
time per GEMV. Every output is checked against an fp32 matmul before its time is printed.

    python3 benchmarks/sweep_gemv.py
"""

import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import copy_bandwidth_gbps  # noqa: E402

from qwen_image_fast.kernels._utils import rel_rms_error  # noqa: E402

SHAPES = {  # name: (N, K), weight [N, K]
    "gdn in_proj": (12352, 4096),
    "attn qkv": (10240, 4096),
    "out/o_proj": (4096, 4096),
    "gate_up": (24576, 4096),
    "down": (4096, 12288),
    "lm_head": (248320, 4096),
}


@triton.jit
def _gemv_kernel(X, W, Y, N, K, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[n] = sum_k w[n, k] x[k], fp32 accumulation; K a multiple of BLOCK_K."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_mask = rn < N
    w_ptrs = W + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)  # one reduction at the end
    for k in range(0, K, BLOCK_K):
        x = tl.load(X + k + rk).to(tl.float32)
        w = tl.load(w_ptrs + k, mask=n_mask[:, None], other=0.0, eviction_policy="evict_first").to(tl.float32)
        acc += w * x[None, :]
    tl.store(Y + rn, tl.sum(acc, axis=1).to(Y.dtype.element_ty), mask=n_mask)


def triton_gemv(x, w, y, block_n, block_k, warps, stages):
    n, k = w.shape
    _gemv_kernel[(triton.cdiv(n, block_n),)](x, w, y, n, k, w.stride(0), BLOCK_N=block_n, BLOCK_K=block_k,
                                             num_warps=warps, num_stages=stages)


def graph_us(fn, weights, x, outs) -> float:
    """Time per call of fn(x, w, out) over all weights, from a replayed CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w, o in zip(weights, outs):
            fn(x, w, o)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w, o in zip(weights, outs):
            fn(x, w, o)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 20
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / reps / len(weights)


def main():
    copy_bw = copy_bandwidth_gbps()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(f"{torch.cuda.get_device_name()}: copy {copy_bw:.0f} GB/s, L2 {l2 / 2**20:.0f} MiB")
    configs = list(itertools.product((4, 8, 16, 32), (256, 512, 1024), (4, 8), (2, 4)))
    for name, (n, k) in SHAPES.items():
        nbytes = n * k * 2
        copies = max(2, -(-4 * l2 // nbytes))
        torch.manual_seed(0)
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        outs = [torch.empty(1, n, device="cuda", dtype=torch.bfloat16) for _ in weights]
        ref = (x.float() @ weights[0].float().T)

        def rate(us):
            return f"{us:7.2f} us {nbytes / us / 1e3:5.0f} GB/s ({100 * nbytes / us / 1e3 / copy_bw:3.0f}%)"

        cublas = lambda x_, w_, o_: torch.mm(x_, w_.T, out=o_)  # noqa: E731
        cublas(x, weights[0], outs[0])
        err = rel_rms_error(outs[0], ref)
        us = graph_us(cublas, weights, x, outs)
        print(f"{name:12} N={n} K={k} x{copies}: cuBLAS {rate(us)} err {err:.1e}", flush=True)
        results = []
        for block_n, block_k, warps, stages in configs:
            if k % block_k:
                continue
            fn = lambda x_, w_, o_: triton_gemv(x_, w_, o_, block_n, block_k, warps, stages)  # noqa: E731
            outs[0].fill_(float("nan"))
            fn(x, weights[0], outs[0])
            err = rel_rms_error(outs[0], ref)
            if err > 1e-2:
                print(f"    {block_n}x{block_k} w{warps} s{stages}: err {err:.1e} FAILED, not timed")
                continue
            results.append((graph_us(fn, weights, x, outs), block_n, block_k, warps, stages, err))
        results.sort()
        for us, block_n, block_k, warps, stages, err in results[:4]:
            print(f"    triton BLOCK_N={block_n:2} BLOCK_K={block_k:4} w{warps} s{stages}: {rate(us)} err {err:.1e}")
        del weights, outs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
