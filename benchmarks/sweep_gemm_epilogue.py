"""What fusing the elementwise kernels into the FP8 GEMMs could save at Edit-2511's two-image shape (GPU).

    python3 benchmarks/sweep_gemm_epilogue.py [--out DIR]
    python3 benchmarks/sweep_gemm_epilogue.py --tiny     # CPU smoke run of this script's logic (TRITON_INTERPRET=1)

The image stream of a paired (B=2) forward: 2 x 12,288 rows. Per linear of a block (QKV, out, fc1, fc2):
  - torch._scaled_mm, rowwise scales with fast accumulation (what FastLinear runs) and tensorwise (cuBLAS);
  - quack's CuTe-DSL GEMM (the quack-kernels package FlashAttention-4 installs) with the rowwise scales and bias in
    a custom epilogue, at a few tile / cluster settings, and for out and fc2 also with the gated residual add
    (residual + gate * y) in the epilogue: the fusion's building block.
Then the elementwise kernels the fusion would shrink, against what would remain of them:
  - residual_gate_layer_norm_modulate_fp8 vs layer_norm_modulate_fp8 (the residual add moved into the GEMM);
  - gelu_fp8 vs quantize_fp8_rowwise (GELU moved into fc1's epilogue; the rowwise quantization needs the whole row's
    amax, so a pass over fc1's output remains).
Every GEMM prints its rel-RMS against torch's rowwise output. Appends to results/gemm_epilogue.jsonl.
--tiny: the same rows at TINY_IMG_ROWS x TINY_DIM on the CPU (the kernels through Triton's interpreter), without
quack; prints the rows, appends nothing.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import append_results, bench_ms, environment  # noqa: E402

from qwen_image_fast.kernels.fp8 import quantize_fp8_rowwise  # noqa: E402
from qwen_image_fast.kernels.gelu_fp8 import gelu_fp8  # noqa: E402
from qwen_image_fast.kernels.layer_norm_modulate import layer_norm_modulate_fp8  # noqa: E402
from qwen_image_fast.kernels.residual_gate import residual_gate_layer_norm_modulate_fp8  # noqa: E402

F8 = torch.float8_e4m3fn
BATCH, IMG_ROWS, DIM = 2, 12288, 3072  # edit2: 4,096 noisy + 8,192 condition image tokens per sample
SHAPES = {"qkv": (DIM, 3 * DIM), "out": (DIM, DIM), "fc1": (DIM, 4 * DIM), "fc2": (4 * DIM, DIM)}  # (K, N)
QUACK_CONFIGS = [dict(tile_M=128, tile_N=256, cluster_M=2, cluster_N=1, pingpong=False),
                 dict(tile_M=128, tile_N=256, cluster_M=1, cluster_N=2, pingpong=False),
                 dict(tile_M=128, tile_N=128, cluster_M=2, cluster_N=1, pingpong=True),
                 dict(tile_M=256, tile_N=128, cluster_M=2, cluster_N=1, pingpong=False)]
# --tiny: 2 x 32 rows, 128 wide (K and N stay multiples of 16, as _scaled_mm needs); one interpreter program a kernel
TINY_IMG_ROWS, TINY_DIM = 32, 128
TINY_SHAPES = {name: (k * TINY_DIM // DIM, n * TINY_DIM // DIM) for name, (k, n) in SHAPES.items()}


def rel_rms(a, b) -> float:
    return ((a.float() - b.float()).pow(2).mean() / b.float().pow(2).mean()).sqrt().item()


def quantize(x):
    scale = x.abs().amax(-1, keepdim=True).float().clamp(min=1e-12) / 448.0
    return (x.float() / scale).to(F8), scale


def quack_epilogues():
    """(rowwise, rowwise + gated residual) epilogue mods, or None without quack."""
    try:
        from quack.epilogue.frontend import gemm_epilogue
    except ImportError:
        return None

    @gemm_epilogue()
    def rowwise(acc, sa, sb, bias):
        return {"D": acc * sa * sb + bias}

    @gemm_epilogue()
    def rowwise_residual(acc, c, sa, sb, bias, gate):
        return {"D": c + gate * (acc * sa * sb + bias)}

    return rowwise, rowwise_residual


def gemm_rows(name, k, n, mods, img_rows: int, device: str) -> list[dict]:
    m = BATCH * img_rows
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
    bias = torch.randn(n, device=device, dtype=torch.bfloat16) * 0.1
    xq, sa = quantize(x)
    wq, sb = quantize(w)
    sb = sb.view(n)
    flops, rows = 2 * m * n * k, []

    def rowwise():
        return torch._scaled_mm(xq, wq.t(), scale_a=sa, scale_b=sb[None], bias=bias, out_dtype=torch.bfloat16,
                                use_fast_accum=True)

    ref, one = rowwise(), torch.ones((), device=device)
    tensorwise = lambda: torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16,  # noqa: E731
                                          use_fast_accum=True)
    for impl, fn, err in (("torch_rowwise_fast_accum", rowwise, 0.0), ("torch_tensorwise_fast_accum", tensorwise, None)):
        ms = bench_ms(fn)
        rows.append(dict(gemm=name, impl=impl, ms=ms, tflops=flops / ms / 1e9, rel_rms_vs_rowwise=err))
    if mods is None:
        return rows
    d = torch.empty(m, n, device=device, dtype=torch.bfloat16)
    args = {"sa": sa.view(1, m).contiguous(), "sb": sb.view(1, n).contiguous(), "bias": bias.float().view(1, n)}
    residual = torch.randn(BATCH, img_rows, n, device=device, dtype=torch.bfloat16)
    gate = torch.randn(BATCH, n, device=device, dtype=torch.float32)
    want = (residual.float() + gate[:, None] * ref.view(BATCH, img_rows, n).float()).to(torch.bfloat16)
    args3 = {"sa": sa.view(BATCH, img_rows).contiguous(), "sb": sb.view(1, n).expand(BATCH, n).contiguous(),
             "bias": bias.float().view(1, n).expand(BATCH, n).contiguous(), "gate": gate}
    out3 = torch.empty_like(residual)
    for cfg in QUACK_CONFIGS:
        calls = [("quack_rowwise", lambda: mods[0].gemm(xq, wq, d, epi_args=args, **cfg), d, ref)]
        if name in ("out", "fc2"):
            calls.append(("quack_rowwise_gated_residual",
                          lambda: mods[1].gemm(xq.view(BATCH, img_rows, k), wq.unsqueeze(0).expand(BATCH, n, k),
                                               out3, residual, epi_args=args3, **cfg), out3, want))
        for impl, fn, out, expect in calls:
            try:
                out.fill_(float("nan"))
                fn()
                err = rel_rms(out, expect)
                ms = bench_ms(fn)
                rows.append(dict(gemm=name, impl=impl, config=cfg, ms=ms, tflops=flops / ms / 1e9,
                                 rel_rms_vs_rowwise=err))
            except Exception as e:  # a config quack does not take on this GPU: reported, not timed
                rows.append(dict(gemm=name, impl=impl, config=cfg, error=f"{type(e).__name__}: {e}"[:300]))
    return rows


def elementwise_rows(img_rows: int, dim: int, device: str) -> list[dict]:
    res = torch.randn(BATCH, img_rows, dim, device=device, dtype=torch.bfloat16)
    y = torch.randn_like(res)
    gate, shift, scale = (torch.randn(BATCH, dim, device=device, dtype=torch.bfloat16) for _ in range(3))
    h = torch.randn(BATCH * img_rows, 4 * dim, device=device, dtype=torch.bfloat16)
    cases = (("residual_gate_layer_norm_modulate_fp8",
              lambda: residual_gate_layer_norm_modulate_fp8(res, y, gate, shift, scale, q_dtype=F8)),
             ("layer_norm_modulate_fp8", lambda: layer_norm_modulate_fp8(res, shift, scale, q_dtype=F8)),
             ("gelu_fp8", lambda: gelu_fp8(h, q_dtype=F8)),
             ("quantize_fp8_rowwise", lambda: quantize_fp8_rowwise(h, F8)))
    return [dict(kernel=name, ms=bench_ms(fn)) for name, fn in cases]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (logic check; TRITON_INTERPRET=1)")
    args = parser.parse_args()
    device = "cpu" if args.tiny else "cuda"
    img_rows, dim, shapes = (TINY_IMG_ROWS, TINY_DIM, TINY_SHAPES) if args.tiny else (IMG_ROWS, DIM, SHAPES)
    if args.tiny:
        print("--tiny: no quack GEMMs (CuTe-DSL kernels for Hopper GPUs)")
    mods = None if args.tiny else quack_epilogues()
    rows = []
    for name, (k, n) in shapes.items():
        rows += gemm_rows(name, k, n, mods, img_rows, device)
    rows += elementwise_rows(img_rows, dim, device)
    for row in rows:
        print({key: round(v, 4) if isinstance(v, float) else v for key, v in row.items()}, flush=True)
    ms = {row["kernel"]: row["ms"] for row in rows if "kernel" in row}
    # per block, image stream: two residual-gate kernels (after out and after fc2) and one GELU
    saved = 2 * (ms["residual_gate_layer_norm_modulate_fp8"] - ms["layer_norm_modulate_fp8"]) + \
        ms["gelu_fp8"] - ms["quantize_fp8_rowwise"]
    print(f"at most {60 * saved:.1f} ms per paired forward (60 blocks) from moving the residual adds and GELU into "
          "the GEMM epilogues, if those epilogues were free", flush=True)
    if not args.tiny:
        append_results("gemm_epilogue", [environment() | row for row in rows]
                       + [environment() | dict(bound="elementwise_saved_ms_per_forward", ms=60 * saved)], args.out)


if __name__ == "__main__":
    main()
