"""FlashAttention-4's SM90 forward at the edit shapes: its default tiles against other (tile_m, tile_n), RS and
intra-warpgroup-overlap settings, each checked against an fp32 SDPA reference on 1024 query rows.

    python3 benchmarks/sweep_fa4_tiles.py
    python3 benchmarks/sweep_fa4_tiles.py --tiny  # CPU smoke run of this script's logic

Calls FA4's private `_flash_attn_fwd` (4.0.0b36), the only entry that takes tile sizes. Prints one line per shape
and setting (ms, TF/s, rel-RMS vs fp32); a setting that does not fit shared memory prints its error.
--tiny: the same inputs and reference at a few dozen tokens on the CPU; the sweep itself (FA4) and the cuDNN timing
need a GPU and are skipped with a line saying so.
"""

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

BF16, HEADS, HEAD_DIM = torch.bfloat16, 24, 128
CONFIGS = [None, ((128, 128), True, True), ((128, 176), True, True), ((128, 160), True, True),
           ((128, 192), True, True), ((128, 144), True, True), ((128, 112), True, True),
           ((128, 128), False, True), ((128, 176), False, True), ((128, 96), True, True), ((128, 64), True, True)]
# name: (image tokens, text tokens per sample): text-to-image B=2, Edit-2511 with one and two condition images
SHAPES = {"t2i_b2": (4096, [218, 150]), "edit1_b1": (8192, [280]), "edit1_b2": (8192, [280, 230]),
          "edit2_b1": (12288, [460]), "edit2_b2": (12288, [460, 420])}
TINY_SHAPES = {"t2i_b2": (64, [12, 8]), "edit1_b1": (128, [14])}  # --tiny: a padded B=2 and a B=1 shape


def rel(a, b):
    return ((a.float() - b.float()).pow(2).mean() / b.float().pow(2).mean()).sqrt().item()


def fa4(q, k, v, seqused_k, cfg):
    from flash_attn.cute.interface import _flash_attn_fwd  # imported here: --tiny runs where FA4 is not installed

    tile, rs, overlap = cfg or (None, None, None)
    return _flash_attn_fwd(q, k, v, seqused_k=seqused_k, tile_mn=tile, mma_pv_is_rs=rs, intra_wg_overlap=overlap)[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU, the sweep skipped (logic check)")
    args = parser.parse_args()
    device = "cpu" if args.tiny else "cuda"
    for name, (img, txts) in (TINY_SHAPES if args.tiny else SHAPES).items():
        batch, seq = len(txts), img + max(txts)
        g = torch.Generator(device).manual_seed(0)
        q, k, v = (torch.randn(batch, seq, HEADS, HEAD_DIM, device=device, dtype=BF16, generator=g) for _ in range(3))
        used = torch.tensor([img + t for t in txts], device=device, dtype=torch.int32)
        key_mask = torch.arange(seq, device=device)[None, :] < used[:, None]
        ref = F.scaled_dot_product_attention(q[:, :1024].transpose(1, 2).float(), k.transpose(1, 2).float(),
                                             v.transpose(1, 2).float(), attn_mask=key_mask[:, None, None, :]
                                             ).transpose(1, 2)
        flops = sum(4 * seq * u * HEADS * HEAD_DIM for u in used.tolist())
        if args.tiny:
            print(f"{name:9s} S={seq} fp32 reference {list(ref.shape)}, {flops / 1e9:.3f} GFLOP: the FA4 sweep "
                  f"({len(CONFIGS)} settings){' and cuDNN SDPA' if batch == 1 else ''} skipped (GPU kernels)")
            continue
        for cfg in CONFIGS:
            try:
                err = rel(fa4(q, k, v, used, cfg)[:, :1024], ref)
                ms = do_bench(lambda: fa4(q, k, v, used, cfg), warmup=100, rep=500)
                print(f"{name:9s} S={seq} cfg={cfg} ms={ms:.3f} TF/s={flops / ms / 1e9:.0f} err_vs_fp32={err:.2e}")
            except Exception as e:
                print(f"{name:9s} cfg={cfg} FAILED {type(e).__name__}: {str(e)[:150]}")
        if batch == 1:
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                ms = do_bench(lambda: F.scaled_dot_product_attention(qt, kt, vt), warmup=100, rep=500)
            print(f"{name:9s} cudnn sdpa ms={ms:.3f} TF/s={flops / ms / 1e9:.0f}")


if __name__ == "__main__":
    main()
