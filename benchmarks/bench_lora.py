"""LoRA at the real shapes (GPU): error of ours + LoRA against stock + LoRA, beside ours against stock without one,
and the forward time with and without the LoRA.

    python3 benchmarks/bench_lora.py [--out DIR]

A full-size random transformer (bench_transformer.make_stock) and a random LoRA at the Lightning release's shapes:
the 12 block linears of each of the 60 blocks, rank 64, alpha 8 (scale 1/8), in lightx2v's key format (lora_down /
lora_up / alpha), loaded through diffusers' QwenImage loader into the stock model (peft) and into ours. 1024^2,
B=1 (Lightning runs without CFG). The error check runs first; no time is recorded if it fails (ours + LoRA must be
within 1.1x of ours without). Appends to results/lora.jsonl.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_transformer import make_inputs, make_stock  # noqa: E402
from common import append_results, bench_ms, environment  # noqa: E402
from diffusers import QwenImagePipeline  # noqa: E402

from qwen_image_fast.kernels._utils import rel_rms_error  # noqa: E402
from qwen_image_fast.pipelines.qwen_image.transformer import (  # noqa: E402
    FastQwenImageTransformer,
    FastTransformerConfig,
)

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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    inputs = make_inputs("1024x1024-b1")
    stock = make_stock()
    with torch.no_grad():
        ref_plain = stock(**inputs, return_dict=False)[0].float()
    fast = FastQwenImageTransformer.from_diffusers(stock, FastTransformerConfig(fp8_fast_accum=True), device="cuda")
    with torch.no_grad():
        ours_plain = fast(**inputs, return_dict=False)[0].float()
    ms_plain = bench_ms(lambda: fast(**inputs, return_dict=False))

    lora = lightning_lora(stock)
    state_dict = QwenImagePipeline.lora_state_dict(dict(lora))  # diffusers' conversion (alpha folded)
    stock.load_lora_adapter(dict(state_dict), prefix="transformer", adapter_name="lightning")
    with torch.no_grad():
        ref_lora = stock(**inputs, return_dict=False)[0].float()
    lora_effect = rel_rms_error(ref_plain, ref_lora)
    del stock
    torch.cuda.empty_cache()
    fast.load_lora_adapter(dict(state_dict), prefix="transformer", adapter_name="lightning")
    with torch.no_grad():
        ours_lora = fast(**inputs, return_dict=False)[0].float()
    err_plain, err_lora = rel_rms_error(ours_plain, ref_plain), rel_rms_error(ours_lora, ref_lora)
    ratio = err_lora / err_plain
    ok = ratio <= 1.1
    print(f"LoRA moves the stock output by {lora_effect:.3e} rel-RMS")
    print(f"ours vs stock: no LoRA {err_plain:.3e}, with LoRA {err_lora:.3e} (ratio {ratio:.3f}, bound 1.1): "
          f"{'ok' if ok else 'FAILED'}")
    row = dict(environment(), bench="lora", shape="1024x1024-b1", rank=64, alpha=8.0, targets=len(TARGETS) * 60,
               lora_effect=lora_effect, err_no_lora=err_plain, err_lora=err_lora, ratio=ratio, ok=ok)
    if ok:
        ms_lora = bench_ms(lambda: fast(**inputs, return_dict=False))
        print(f"ours forward (eager), 1024^2 B=1: {ms_plain:.1f} ms without, {ms_lora:.1f} ms with the LoRA "
              f"(+{100 * (ms_lora / ms_plain - 1):.1f}%)")
        row.update(ms_no_lora=ms_plain, ms_lora=ms_lora)
    append_results("lora", [row], args.out)


if __name__ == "__main__":
    main()
