"""LoRA at the real shapes (GPU): error of each of our LoRA paths (unfused low-rank; fused into the FP8 weights,
requantized from the dequantized FP8 weights or from the BF16 ones re-read from the checkpoint; fused on the stock
model before conversion) against stock + LoRA, beside ours against stock without one, and the
forward time with and without the LoRA.

    python3 benchmarks/bench_lora.py [--out DIR]
    python3 benchmarks/bench_lora.py --tiny  # CPU smoke run of this script's logic

A full-size random transformer (bench_transformer.make_stock) and a random LoRA at the Lightning release's shapes:
the 12 block linears of each of the 60 blocks, rank 64, alpha 8 (scale 1/8), in lightx2v's key format (lora_down /
lora_up / alpha), loaded through diffusers' QwenImage loader into the stock model (peft) and into ours. 1024^2,
B=1 (Lightning runs without CFG). No time is recorded for a path that fails its error bound (GATES). Appends to
results/lora.jsonl.
--tiny: the tiny pipeline's transformer (pipelines/tiny.py, fp32, FP8 block linears) on the CPU, a rank-4 LoRA, 4x4
image tokens; rows printed, not recorded.
"""

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_transformer import make_inputs, make_stock  # noqa: E402
from common import append_results, bench_ms, environment, sync  # noqa: E402
from diffusers import QwenImagePipeline  # noqa: E402

from qwen_image_fast.kernels._utils import rel_rms_error  # noqa: E402
from qwen_image_fast.pipelines.core.config import FastTransformerConfig  # noqa: E402
from qwen_image_fast.pipelines.core.model.checkpoint import CheckpointWeights  # noqa: E402
from qwen_image_fast.pipelines.qwen_image.model.transformer import FastQwenImageTransformer  # noqa: E402
from qwen_image_fast.pipelines.tiny import tiny_components  # noqa: E402

TARGETS = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj",
           "attn.to_out.0", "attn.to_add_out", "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj",
           "txt_mlp.net.2"]


def lightning_lora(model, rank=64, alpha=8.0, seed=5) -> dict:
    """Random factors whose product moves each targeted weight by ~10% of its RMS (at scale alpha / rank)."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for i in range(len(model.transformer_blocks)):
        for t in TARGETS:
            m = model.get_submodule(f"transformer_blocks.{i}.{t}")
            k, n = m.in_features, m.out_features
            # (B A)_ij has std c sqrt(r / k); times alpha / r it is 0.1 x 0.02 (the weights' std) for this c
            c = 0.1 * 0.02 * (rank / alpha) * (k / rank) ** 0.5
            sd[f"transformer_blocks.{i}.{t}.lora_down.weight"] = torch.randn(rank, k, generator=g) / k**0.5
            sd[f"transformer_blocks.{i}.{t}.lora_up.weight"] = torch.randn(n, rank, generator=g) * c
            sd[f"transformer_blocks.{i}.{t}.alpha"] = torch.tensor(alpha)
    return sd


# Error of each path against stock + LoRA (unfused peft), over ours against stock without a LoRA. Unfused and
# folded-from-BF16 keep one e4m3 rounding of each weight: the 1.1x. Folding into the FP8 weight rounds each
# weight a second time (the dequantized FP8 weight plus the LoRA product, requantized), which at most doubles the
# weight-rounding variance: sqrt(2) if all of the error were weight rounding, less with the activations' share.
GATES = {"unfused": 1.1, "fused-bf16": 1.1, "fused-fp8-master": 1.1, "fused-fp8": 2 ** 0.5}


def tiny_inputs(model, side=4, text_len=8, seed=1) -> dict:
    """make_inputs("1024x1024-b1")'s layout at the tiny model's widths (side x side image tokens, B=1, no mask)."""
    g = torch.Generator().manual_seed(seed)
    return dict(
        hidden_states=torch.randn(1, side * side, model.config.in_channels, generator=g),
        encoder_hidden_states=torch.randn(1, text_len, model.config.joint_attention_dim, generator=g),
        encoder_hidden_states_mask=None,
        timestep=torch.full((1,), 0.6),
        img_shapes=[[(1, side, side)]],
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true", help="the tiny transformer on the CPU (logic check)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device("cpu" if args.tiny else "cuda")
    if args.tiny:
        stock = tiny_components()["transformer"]
        shape, inputs, rank = "tiny-4x4-b1", tiny_inputs(stock), 4
    else:
        shape, inputs, rank = "1024x1024-b1", make_inputs("1024x1024-b1"), 64
        stock = make_stock()
    targets = len(TARGETS) * len(stock.transformer_blocks)
    config = FastTransformerConfig(fp8_fast_accum=True)

    def forward(model):
        with torch.no_grad():
            return model(**inputs, return_dict=False)[0].float()

    ref_plain = forward(stock)
    checkpoint = Path(tempfile.mkdtemp())  # the stock weights on disk: the BF16 masters a fold can re-read
    stock.save_pretrained(checkpoint)
    fast = FastQwenImageTransformer.from_diffusers(stock, config, device=device)
    ours = {"no-lora": forward(fast)}
    ms = {"no-lora": bench_ms(lambda: fast(**inputs, return_dict=False))}

    lora = lightning_lora(stock, rank=rank)
    state_dict = QwenImagePipeline.lora_state_dict(dict(lora))  # diffusers' conversion (alpha folded)
    stock.load_lora_adapter(dict(state_dict), prefix="transformer", adapter_name="lightning")
    ref_lora = forward(stock)
    lora_effect = rel_rms_error(ref_plain, ref_lora)
    fast.load_lora_adapter(dict(state_dict), prefix="transformer", adapter_name="lightning")
    ours["unfused"] = forward(fast)
    ms["unfused"] = bench_ms(lambda: fast(**inputs, return_dict=False))
    fuse_s = {}
    for path, source in (("fused-fp8", None), ("fused-fp8-master", CheckpointWeights(checkpoint, stock.dtype))):
        fast.weight_source = source  # None: no folder known, the fold requantizes the dequantized FP8 weights
        sync(device)
        start = time.perf_counter()
        fast.fuse_lora()
        sync(device)
        fuse_s[path] = time.perf_counter() - start
        ours[path] = forward(fast)
        ms[path] = bench_ms(lambda: fast(**inputs, return_dict=False))
        fast.unfuse_lora()
    shutil.rmtree(checkpoint)
    print("fuse_lora: " + ", ".join(f"{path} {s:.2f} s" for path, s in fuse_s.items()))
    del fast
    stock.fuse_lora()
    stock.unload_lora()  # the merged bf16 weights stay
    fast = FastQwenImageTransformer.from_diffusers(stock, config, device=device)
    del stock
    torch.cuda.empty_cache()
    ours["fused-bf16"] = forward(fast)
    ms["fused-bf16"] = bench_ms(lambda: fast(**inputs, return_dict=False))

    err_plain = rel_rms_error(ours["no-lora"], ref_plain)
    print(f"LoRA moves the stock output by {lora_effect:.3e} rel-RMS; ours vs stock without it: {err_plain:.3e}")
    rows = []
    for path, gate in GATES.items():
        err = rel_rms_error(ours[path], ref_lora)
        ok = err / err_plain <= gate
        row = dict(environment(), bench="lora", shape=shape, rank=rank, alpha=8.0, targets=targets,
                   path=path, lora_effect=lora_effect, err_no_lora=err_plain, err_lora=err, ratio=err / err_plain,
                   gate=gate, ok=ok, ms_no_lora=ms["no-lora"], ms_lora=ms[path] if ok else None,
                   fuse_s=fuse_s.get(path))
        print(f"{path:10} vs stock + LoRA: {err:.3e} (ratio {err / err_plain:.3f}, bound {gate:.2f}): "
              f"{'ok' if ok else 'FAILED'}" + (f"; forward (eager) {ms[path]:.1f} ms against {ms['no-lora']:.1f} "
                                               f"without ({100 * (ms[path] / ms['no-lora'] - 1):+.1f}%)" if ok else ""))
        rows.append(row)
    if args.tiny:
        for row in rows:
            print(row, flush=True)
    else:
        append_results("lora", rows, args.out)


if __name__ == "__main__":
    main()
