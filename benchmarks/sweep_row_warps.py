"""Warps per program for the row kernels at the DiT shape (8628 x 3072 bf16): which num_warps rows_launch should
pick. Prints GB/s per setting; the checked outputs are compared with the default setting's.

    python3 benchmarks/sweep_row_warps.py
    python3 benchmarks/sweep_row_warps.py --tiny     # CPU smoke run of this script's logic (TRITON_INTERPRET=1)
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_ms, copy_bandwidth_gbps  # noqa: E402

import qwen_image_fast.kernels.attn_split_fp8 as attn_split_mod  # noqa: E402
import qwen_image_fast.kernels.layer_norm_modulate as ln_mod  # noqa: E402
import qwen_image_fast.kernels.residual_gate as res_mod  # noqa: E402
from qwen_image_fast.kernels._utils import rel_rms_error, rows_launch  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (logic check; TRITON_INTERPRET=1)")
    args = parser.parse_args()
    device = "cpu" if args.tiny else "cuda"
    # B x (image + text tokens) x D; --tiny: one program of the interpreter's row tile
    b, s, d, l_img = (2, 32, 256, 24) if args.tiny else (2, 4314, 3072, 4096)
    x = torch.randn(b, s, d, device=device, dtype=torch.bfloat16)
    res = torch.randn_like(x) * 4
    mod = torch.randn(b, 6 * d, device=device, dtype=torch.bfloat16) * 0.5
    shift, scale, gate = mod[:, :d], mod[:, d : 2 * d], mod[:, 2 * d : 3 * d]
    copy_bw = copy_bandwidth_gbps(16 << 20 if args.tiny else 2 << 30)
    ops = {
        "layer_norm_modulate_fp8": (ln_mod, lambda: ln_mod.layer_norm_modulate_fp8(x, shift, scale), 3 * x.numel()),
        "layer_norm_modulate": (ln_mod, lambda: ln_mod.layer_norm_modulate(x, shift, scale), 4 * x.numel()),
        "residual_gate_layer_norm_modulate_fp8": (
            res_mod, lambda: res_mod.residual_gate_layer_norm_modulate_fp8(res, x, gate, shift, scale),
            7 * x.numel()),
        "attn_split_fp8": (attn_split_mod, lambda: attn_split_mod.attn_split_fp8(x, l_img), 3 * x.numel()),
    }
    print(f"copy {copy_bw:.0f} GB/s")
    if args.tiny:
        print("--tiny: the interpreter ignores num_warps: every setting runs the same program (a check of the script)")
    for name, (module, fn, n_bytes) in ops.items():
        default = [t.float() for t in fn()]
        line = []
        for warps in (2, 4, 8, 16, 32):
            module.rows_launch = lambda m, n, w=warps: (rows_launch(m, n)[0], dict(rows_launch(m, n)[1], num_warps=w))
            out = [t.float() for t in fn()]
            err = max(rel_rms_error(a, r) for a, r in zip(out, default))
            ms = bench_ms(fn)
            line.append(f"w{warps}: {n_bytes / ms / 1e6:5.0f} GB/s ({100 * n_bytes / ms / 1e6 / copy_bw:3.0f}%) "
                        f"err {err:.0e}")
        module.rows_launch = rows_launch
        print(f"{name:40} " + " | ".join(line))


if __name__ == "__main__":
    main()
