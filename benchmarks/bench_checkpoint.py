"""Checkpoint size and load time (GPU): the fast layout save_pretrained writes against the upstream BF16 layout
plus conversion, with random full-size weights.

    python3 benchmarks/bench_checkpoint.py [--dir /tmp/qif-ckpt] [--out DIR]
    python3 benchmarks/bench_checkpoint.py --tiny  # CPU smoke run of this script's logic

1. A full-size QwenImageTransformer2DModel with random bf16 weights, saved in diffusers' upstream layout.
2. Load it as QwenImageFastPipeline.from_pretrained does for an upstream checkpoint (diffusers' loader on the CPU,
   then FastQwenImageTransformer.from_diffusers onto the GPU, FP8 block linears quantized there): model A.
3. A.save_pretrained (FP8 block linears with their scales, the rest bf16, sharded safetensors); the upstream folder is
   deleted first, so the disk holds one checkpoint at a time.
4. FastQwenImageTransformer.from_pretrained straight onto the GPU: model B, nothing requantized.
5. Check (before any time is recorded): A and B bit-equal, every tensor, and one forward equal.
The page cache is dropped before each load when the machine allows it (root); the row says whether it was.
--tiny: the tiny pipeline's transformer (pipelines/tiny.py, fp32, FP8 block linears) on the CPU, in a temporary
folder, the page cache left alone; the row printed, not recorded.
Appends to results/checkpoint.jsonl.
"""

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_transformer import make_stock  # noqa: E402
from common import append_results, environment, sync  # noqa: E402

from qwen_image_fast.pipelines.core.config import FastTransformerConfig  # noqa: E402
from qwen_image_fast.pipelines.qwen_image.model.transformer import FastQwenImageTransformer  # noqa: E402
from qwen_image_fast.pipelines.tiny import tiny_components  # noqa: E402


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def drop_page_cache() -> bool:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def timed(fn, device):
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


def forward(model, side, text_len, seed=3):
    """One forward on a side x side token image (32: 512x512) and text_len text tokens, at the model's widths."""
    device, dtype, config = model.device, model.dtype, model.config
    g = torch.Generator(device).manual_seed(seed)
    x = torch.randn(1, side * side, config.in_channels, device=device, dtype=dtype, generator=g)
    e = torch.randn(1, text_len, config.joint_attention_dim, device=device, dtype=dtype, generator=g)
    t = torch.tensor([0.5], device=device, dtype=dtype)
    return model(hidden_states=x, encoder_hidden_states=e, timestep=t, img_shapes=[[(1, side, side)]]).sample


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true", help="the tiny transformer on the CPU (logic check)")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/qif-ckpt"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.tiny:
        print("--tiny: the page cache is not dropped before the loads (machine-wide, and a load time at this size "
              "means nothing)", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            run(Path(tmp) / "ckpt", args.out, tiny=True)
    else:
        run(args.dir, args.out, tiny=False)


def run(folder: Path, out: Path | None, tiny: bool):
    """Steps 1-5 in `folder` (emptied first, removed at the end)."""
    device = torch.device("cpu" if tiny else "cuda")
    tokens = (4, 8) if tiny else (32, 64)  # the check's forward: image side in tokens, text tokens
    upstream, fast_dir = folder / "upstream", folder / "fast"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    print(f"disk: {shutil.disk_usage(folder).free / 2**30:.1f} GiB free at {folder}", flush=True)

    stock = tiny_components()["transformer"] if tiny else make_stock()
    dtype = stock.dtype
    _, save_upstream_s = timed(lambda: stock.save_pretrained(upstream), device)
    upstream_bytes = folder_bytes(upstream)
    del stock
    gc.collect()
    torch.cuda.empty_cache()
    print(f"upstream layout: {upstream_bytes / 2**30:.2f} GiB, saved in {save_upstream_s:.1f} s", flush=True)

    from diffusers import QwenImageTransformer2DModel

    def load_upstream_and_convert():
        stock = QwenImageTransformer2DModel.from_pretrained(upstream, dtype=dtype)
        return FastQwenImageTransformer.from_diffusers(stock, FastTransformerConfig(fp8=True), device=device)

    dropped_1 = not tiny and drop_page_cache()
    a, convert_s = timed(load_upstream_and_convert, device)
    gc.collect()
    print(f"upstream load + conversion: {convert_s:.1f} s (page cache dropped: {dropped_1})", flush=True)
    shutil.rmtree(upstream)

    _, save_fast_s = timed(lambda: a.save_pretrained(fast_dir), device)
    fast_bytes = folder_bytes(fast_dir)
    shards = len(list(fast_dir.glob("*.safetensors")))
    print(f"fast layout: {fast_bytes / 2**30:.2f} GiB in {shards} shards, saved in {save_fast_s:.1f} s", flush=True)
    dropped_2 = not tiny and drop_page_cache()
    b, load_fast_s = timed(lambda: FastQwenImageTransformer.from_pretrained(fast_dir, device=device), device)
    print(f"fast load: {load_fast_s:.1f} s (page cache dropped: {dropped_2})", flush=True)

    sa, sb = a.state_dict(), b.state_dict()
    exact = sa.keys() == sb.keys() and all(sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]) for k in sa)
    fa, fb = forward(a, *tokens), forward(b, *tokens)
    same_output = bool(torch.equal(fa, fb)) and bool(torch.isfinite(fa).all())
    print(f"check: {len(sa)} tensors bit-equal: {exact}; forward equal: {same_output}", flush=True)
    if not (exact and same_output):
        print("FAILED the round-trip check: no times recorded", flush=True)
        sys.exit(1)
    row = dict(environment(), bench="checkpoint", upstream_gib=upstream_bytes / 2**30, fast_gib=fast_bytes / 2**30,
               fast_shards=shards, fast_config=json.loads((fast_dir / "config.json").read_text())["fast_config"],
               upstream_load_convert_s=convert_s, fast_load_s=load_fast_s, save_upstream_s=save_upstream_s,
               save_fast_s=save_fast_s, page_cache_dropped=dropped_1 and dropped_2, tensors=len(sa), bit_exact=exact)
    if tiny:
        print(row, flush=True)
    else:
        append_results("checkpoint", [row], out)
    print(f"{'layout':10} {'GiB':>7} {'load s':>7}\nupstream   {row['upstream_gib']:7.2f} {convert_s:7.1f}  (+ "
          f"conversion)\nfast       {row['fast_gib']:7.2f} {load_fast_s:7.1f}  ({convert_s / load_fast_s:.2f}x faster)")
    shutil.rmtree(folder)


if __name__ == "__main__":
    main()
