"""Checkpoint size and load time (GPU): the fast layout save_pretrained writes against the upstream BF16 layout
plus conversion, with random full-size weights.

    python3 benchmarks/bench_checkpoint.py [--dir /tmp/qif-ckpt] [--out DIR]

1. A full-size QwenImageTransformer2DModel with random bf16 weights, saved in diffusers' upstream layout.
2. Load it as QwenImageFastPipeline.from_pretrained does for an upstream checkpoint (diffusers' loader on the CPU,
   then FastQwenImageTransformer.from_diffusers onto the GPU, FP8 block linears quantized there): model A.
3. A.save_pretrained (FP8 block linears with their scales, the rest bf16, sharded safetensors); the upstream folder is
   deleted first, so the disk holds one checkpoint at a time.
4. FastQwenImageTransformer.from_pretrained straight onto the GPU: model B, nothing requantized.
5. Check (before any time is recorded): A and B bit-equal, every tensor, and one forward equal.
The page cache is dropped before each load when the machine allows it (root); the row says whether it was.
Appends to results/checkpoint.jsonl.
"""

import argparse
import gc
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_transformer import make_stock  # noqa: E402
from common import append_results, environment  # noqa: E402

from qwen_image_fast.pipelines.qwen_image.config import FastTransformerConfig  # noqa: E402
from qwen_image_fast.pipelines.qwen_image.model.transformer import FastQwenImageTransformer  # noqa: E402


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def drop_page_cache() -> bool:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def forward(model, seed=3):
    g = torch.Generator("cuda").manual_seed(seed)
    x = torch.randn(1, 1024, 64, device="cuda", dtype=torch.bfloat16, generator=g)  # 512x512
    e = torch.randn(1, 64, 3584, device="cuda", dtype=torch.bfloat16, generator=g)
    t = torch.tensor([0.5], device="cuda", dtype=torch.bfloat16)
    return model(hidden_states=x, encoder_hidden_states=e, timestep=t, img_shapes=[[(1, 32, 32)]]).sample


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, default=Path("/tmp/qif-ckpt"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    upstream, fast_dir = args.dir / "upstream", args.dir / "fast"
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    print(f"disk: {shutil.disk_usage(args.dir).free / 2**30:.1f} GiB free at {args.dir}", flush=True)

    stock = make_stock()
    _, save_upstream_s = timed(lambda: stock.save_pretrained(upstream))
    upstream_bytes = folder_bytes(upstream)
    del stock
    gc.collect()
    torch.cuda.empty_cache()
    print(f"upstream layout: {upstream_bytes / 2**30:.2f} GiB, saved in {save_upstream_s:.1f} s", flush=True)

    from diffusers import QwenImageTransformer2DModel

    def load_upstream_and_convert():
        stock = QwenImageTransformer2DModel.from_pretrained(upstream, dtype=torch.bfloat16)
        return FastQwenImageTransformer.from_diffusers(stock, FastTransformerConfig(fp8=True), device="cuda")

    dropped_1 = drop_page_cache()
    a, convert_s = timed(load_upstream_and_convert)
    gc.collect()
    print(f"upstream load + conversion: {convert_s:.1f} s (page cache dropped: {dropped_1})", flush=True)
    shutil.rmtree(upstream)

    _, save_fast_s = timed(lambda: a.save_pretrained(fast_dir))
    fast_bytes = folder_bytes(fast_dir)
    shards = len(list(fast_dir.glob("*.safetensors")))
    print(f"fast layout: {fast_bytes / 2**30:.2f} GiB in {shards} shards, saved in {save_fast_s:.1f} s", flush=True)
    dropped_2 = drop_page_cache()
    b, load_fast_s = timed(lambda: FastQwenImageTransformer.from_pretrained(fast_dir, device="cuda"))
    print(f"fast load: {load_fast_s:.1f} s (page cache dropped: {dropped_2})", flush=True)

    sa, sb = a.state_dict(), b.state_dict()
    exact = sa.keys() == sb.keys() and all(sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]) for k in sa)
    fa, fb = forward(a), forward(b)
    same_output = bool(torch.equal(fa, fb)) and bool(torch.isfinite(fa).all())
    print(f"check: {len(sa)} tensors bit-equal: {exact}; forward equal: {same_output}", flush=True)
    if not (exact and same_output):
        print("FAILED the round-trip check: no times recorded", flush=True)
        sys.exit(1)
    row = dict(environment(), bench="checkpoint", upstream_gib=upstream_bytes / 2**30, fast_gib=fast_bytes / 2**30,
               fast_shards=shards, fast_config=json.loads((fast_dir / "config.json").read_text())["fast_config"],
               upstream_load_convert_s=convert_s, fast_load_s=load_fast_s, save_upstream_s=save_upstream_s,
               save_fast_s=save_fast_s, page_cache_dropped=dropped_1 and dropped_2, tensors=len(sa), bit_exact=exact)
    append_results("checkpoint", [row], args.out)
    print(f"{'layout':10} {'GiB':>7} {'load s':>7}\nupstream   {row['upstream_gib']:7.2f} {convert_s:7.1f}  (+ "
          f"conversion)\nfast       {row['fast_gib']:7.2f} {load_fast_s:7.1f}  ({convert_s / load_fast_s:.2f}x faster)")
    shutil.rmtree(args.dir)


if __name__ == "__main__":
    main()
