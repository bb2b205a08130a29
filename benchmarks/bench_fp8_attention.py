"""FP8 attention candidates at Qwen-Image's shapes (GPU), in one process: FlashAttention-4 BF16 (what runs today),
FlashAttention-3 FP8 and cuDNN FP8 (pipelines/core/model/fp8_attention.py) on the operands our kernels write.

    python3 benchmarks/bench_fp8_attention.py [--out DIR]
    python3 benchmarks/bench_fp8_attention.py --tiny  # CPU smoke run of this script's logic

Shapes, B=2 (batched CFG), 24 heads x 128, the prompt right-padded (its padding at the end of each sample, counted
out by seqused_k): 1024^2 text-to-image (4096 image tokens + 218 text, 218 and 150 valid), 1328^2 (6889 + 218),
Edit-2511 with two 1024^2 condition images (12288 + 400, 400 and 310 valid). Operands: each stream's fused qkv
[B, L, 3 * H * D] Gaussian, RMSNorm weights 1 + 0.3 N(0, 1) (image) and 1 + 0.5 N(0, 1) (text: a wider bound),
through qkv_pack: BF16 joint buffers for FA4; q, k FP8 with the RMSNorm bound's scales and v by
quantize_fp8_heads (per (sample, head) for FA3, per tensor for cuDNN, whose FP8 output takes v's scale). The
reference: fp32 attention of the same q, k before any rounding (the rotation's fp32 output) and v (SDPA,
memory-efficient, padded keys masked). Per kernel: ms and TF/s of the attention alone (4 B H D S_q S_k,valid
FLOPs), the operand preparation (qkv_pack FP8 against BF16, the V quantization) in ms, and rel-RMS over the valid
query rows against the reference and against FA4 BF16. Gaussian operands, not a checkpoint's activations: the
error of real attention patterns (peakier softmax) is not measured here. A kernel that fails is reported with its
error and the others still run. Appends to results/fp8_attention.jsonl.

--model-activations: instead, q, k, v as the fast transformer's blocks hand them to attention (full width, 3 blocks,
random weights as bench_transformer's, FP8 GEMMs, BF16 attention) at odd sizes, B = 1, 2, 4, prompts padded to
several lengths (ACTIVATION_CASES); per block and per sample, each FP8 kernel on those operands (q, k quantized with
the block's bound scales, v by quantize_fp8_heads) against FlashAttention-4 BF16 on the same operands, over the
sample's valid query rows. (The model quantizes q and k from the rotation's fp32 output, here from its BF16
rounding: 2^-9 against e4m3's 2^-4.) Each also with k's per-(sample, head) mean valid key subtracted before its
quantization (exact for the softmax; k's scale then from its amax): whether that helps.

--tiny: both parts at a few dozen tokens on the CPU (Triton's interpreter), the rows printed, not appended: the shapes
with 2 heads x 128, the activations of pipelines/tiny.py's transformer (fp32). FA4, FA3 and cuDNN need a GPU: SDPA
stands in for FA4 BF16, and fp8_attention_ref (the semantics both FP8 kernels approximate) for each FP8 kernel, on
the operands that kernel would get; the cuDNN plan sweep is skipped. The interpreter rounds some fp32 -> e4m3 casts
down a binade (CONVENTIONS.md): the FP8 errors printed are not the GPU's.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import append_results, bench_ms, environment  # noqa: E402

from qwen_image_fast.kernels._utils import FP8_DTYPE, rel_rms_error  # noqa: E402
from qwen_image_fast.kernels.qkv_pack import qkv_pack, qkv_pack_ref, rms_norm_fp8_scale  # noqa: E402
from qwen_image_fast.kernels.quantize_heads import quantize_fp8_heads  # noqa: E402
from qwen_image_fast.pipelines.core.model.attention import TextMask, joint_attention  # noqa: E402
from qwen_image_fast.pipelines.core.config import FastTransformerConfig  # noqa: E402
from qwen_image_fast.pipelines.core.model.fp8_attention import (  # noqa: E402
    CudnnFp8Attention,
    fp8_attention_fa3,
    fp8_attention_ref,
)
from qwen_image_fast.pipelines.qwen_image.model.transformer import FastQwenImageTransformer  # noqa: E402

B, H, D = 2, 24, 128
SHAPES = {"t2i_1024": (4096, 218, (218, 150)), "t2i_1328": (6889, 218, (218, 150)),
          "edit2_1024": (12288, 400, (400, 310))}
TINY_HEADS, TINY_SHAPES = 2, {"tiny": (16, 8, (8, 6))}  # --tiny: 2 of the 24 heads, a few dozen tokens


def operands(img: int, txt: int, valid: tuple, heads: int = H, device: str = "cuda"):
    g = torch.Generator(device).manual_seed(0)
    streams = [(torch.randn(B, n, 3 * heads * D, generator=g, device=device).bfloat16(),
                (1 + spread * torch.randn(D, generator=g, device=device)).bfloat16(),
                (1 + spread * torch.randn(D, generator=g, device=device)).bfloat16(),
                torch.view_as_real(torch.polar(torch.ones(n, D // 2, device=device),
                                               6.0 * torch.rand(n, D // 2, generator=g, device=device))))
               for n, spread in ((img, 0.3), (txt, 0.5))]
    text_mask = torch.arange(txt, device=device)[None, :] < torch.tensor(valid, device=device)[:, None]
    return streams, TextMask(text_mask, img)


def heads_and_device(streams) -> tuple[int, torch.device]:
    qkv = streams[0][0]  # [B, L, 3 * H * D]
    return qkv.shape[-1] // (3 * D), qkv.device


def pack(streams, s: int, qk_dtype, scales=None):
    heads, device = heads_and_device(streams)
    q, k = (torch.empty(B, s, heads, D, dtype=qk_dtype, device=device) for _ in range(2))
    v = torch.empty(B, s, heads, D, dtype=torch.bfloat16, device=device)
    offset = 0
    for qkv, wq, wk, freqs in streams:
        qkv_pack(qkv, wq, wk, freqs, q, k, v, seq_offset=offset, qk_scales=scales)
        offset += qkv.shape[1]
    return q, k, v


def reference(streams, s: int, mask: TextMask) -> torch.Tensor:
    """fp32 attention of the unrounded operands: qkv_pack_ref's pre-cast values with unit scales are the rotation's
    fp32 output (|q| <= sqrt(D) max|w| < 448: nothing clamped)."""
    heads, device = heads_and_device(streams)
    q, k = (torch.empty(B, s, heads, D, device=device) for _ in range(2))
    v = torch.empty(B, s, heads, D, dtype=torch.bfloat16, device=device)
    ones = (torch.ones(1, device=device), torch.ones(1, device=device))
    offset = 0
    for qkv, wq, wk, freqs in streams:
        qkv_pack_ref(qkv, wq, wk, freqs, q, k, v, seq_offset=offset, qk_scales=ones)
        offset += qkv.shape[1]
    # the CPU (--tiny) has no memory-efficient kernel: its math one
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION if device.type == "cuda" else SDPBackend.MATH):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.float().transpose(1, 2),
                                             attn_mask=mask.key_mask)
    return out.transpose(1, 2)


ACTIVATION_CASES = {"1024x768-b1": (1024, 768, (97,)), "832x1248-b2": (832, 1248, (218, 150)),
                    "1328x1328-b4": (1328, 1328, (218, 180, 120, 64))}
TINY_ACTIVATION_CASES = {"48x80-b2": (48, 80, (11, 6))}  # --tiny: pipelines/tiny.py's transformer, B=2 padded


def model_activation_rows(env: dict, tiny: bool = False) -> list[dict]:
    """--model-activations (the docstring). tiny: pipelines/tiny.py's transformer on the CPU, SDPA in place of FA4
    and fp8_attention's "reference" in place of the FP8 kernels."""
    from bench_transformer import FULL, TINY, make_stock

    from qwen_image_fast.pipelines.qwen_image.model import block as block_module
    from qwen_image_fast.pipelines.core.model.fp8_attention import fp8_attention, installed

    sizes = TINY if tiny else FULL
    device, dtype, bf16_attention = sizes.device, sizes.dtype, "sdpa" if tiny else "fa4"
    fast = FastQwenImageTransformer.from_diffusers(make_stock(sizes=sizes, num_layers=3), FastTransformerConfig())
    original, captured, rows = block_module.joint_attention, [], []

    def capture(q, k, v, mask, backend):
        captured.append((q.clone(), k.clone(), v.clone(), mask))
        return original(q, k, v, mask, backend)

    block_module.joint_attention = capture
    g = torch.Generator(device).manual_seed(0)
    for case, (width, height, texts) in (TINY_ACTIVATION_CASES if tiny else ACTIVATION_CASES).items():
        batch, text = len(texts), max(texts)
        mask = (torch.arange(text, device=device)[None, :] < torch.tensor(texts, device=device)[:, None]).long()
        tokens = (height // 16) * (width // 16)
        inputs = dict(
            hidden_states=torch.randn(batch, tokens, sizes.in_channels, generator=g, device=device).to(dtype),
            encoder_hidden_states=torch.randn(batch, text, sizes.joint_dim, generator=g, device=device).to(dtype),
            encoder_hidden_states_mask=mask, img_shapes=[[(1, height // 16, width // 16)]] * batch,
            timestep=torch.full((batch,), 0.5, device=device, dtype=dtype))
        captured.clear()
        with torch.no_grad():
            fast(**inputs)
        for i, (q, k, v, text_mask) in enumerate(captured):
            valid = text_mask.key_mask[:, 0, 0, :]
            scales = fast.transformer_blocks[i].qk_fp8_scales()
            ref = original(q, k, v, text_mask, bf16_attention).float()
            # the issue's question: each (sample, head)'s mean valid key subtracted before quantizing k (exact for
            # the softmax), k's scale then from its amax (the bound no longer holds)
            counted = valid[:, :, None, None].float()
            centered = k.float() - (k.float() * counted).sum(1, keepdim=True) / counted.sum(1, keepdim=True)
            centered_scale = (centered * counted).abs().amax().reshape(1) / 448
            for variant, k_used, k_scale in (("bound", k.float(), scales[1]), ("mean_key", centered, centered_scale)):
                q8, k8 = ((t.float() / sc).clamp(-448, 448).to(FP8_DTYPE)
                          for t, sc in zip((q, k_used), (scales[0], k_scale)))
                for kernel in ["reference"] if tiny else [name for name in ("cudnn", "fa3") if installed(name)]:
                    out, o_scale = fp8_attention(kernel, q8, k8, v, scales[0], k_scale, text_mask.seqused_k)
                    out = out.float() * (1 if o_scale is None else o_scale)
                    errors = [rel_rms_error(out[b][valid[b]], ref[b][valid[b]]) for b in range(batch)]
                    rows.append(dict(env, bench="fp8_attention_activations", case=case, block=i, kernel=kernel,
                                     k_quantization=variant, seq=q.shape[1], text_lengths=list(texts),
                                     k_scale=float(k_scale), per_sample_rel_rms_vs_fa4_bf16=errors))
                    print(f"{case:13s} S={q.shape[1]:5d} block {i} {kernel:5s} k {variant:8s} (scale {float(k_scale):.2e})"
                          f" per-sample rel-RMS vs {bf16_attention.upper()} BF16: "
                          + " ".join(f"{e:.2e}" for e in errors), flush=True)
    block_module.joint_attention = original
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="both parts, tiny, on the CPU (logic check)")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--cudnn-plans", action="store_true", help="also time every plan cuDNN ranks")
    parser.add_argument("--model-activations", action="store_true", help="per-sample error on the blocks' operands")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    env, rows, cudnn_attention = environment(), [], CudnnFp8Attention()
    print(f"{env['gpu']}  torch {torch.__version__}", flush=True)

    def save(done: list[dict]):
        if args.tiny:
            for row in done:
                print(json.dumps(row))  # the line a GPU run appends
        else:
            append_results("fp8_attention", done, args.out)

    if args.model_activations:
        save(model_activation_rows(env, args.tiny))
        return
    shapes, heads, device = (TINY_SHAPES, TINY_HEADS, "cpu") if args.tiny else (SHAPES, H, "cuda")
    bf16_attention = "sdpa" if args.tiny else "fa4"  # FA4 needs a GPU
    if args.tiny and args.cudnn_plans:
        print("--cudnn-plans: skipped on the CPU (cuDNN needs a CUDA GPU)")
    for name in list(shapes) if args.tiny else args.shapes.split(","):
        img, txt, valid = shapes[name]
        s = img + txt
        streams, mask = operands(img, txt, valid, heads, device)
        queries = mask.key_mask[:, 0, 0, :]  # [B, S]: the valid query rows are the valid key rows
        flops = 4 * heads * D * s * mask.seqused_k.double().sum().item()
        ref = reference(streams, s, mask)[queries]

        def error(out):
            return rel_rms_error(out.float()[queries], ref)

        q16, k16, v16 = pack(streams, s, torch.bfloat16)
        scales = (rms_norm_fp8_scale([st[1] for st in streams], D), rms_norm_fp8_scale([st[2] for st in streams], D))
        bf16_pack_ms = bench_ms(lambda: pack(streams, s, torch.bfloat16))
        fp8_pack_ms = bench_ms(lambda: pack(streams, s, FP8_DTYPE, scales))
        q8, k8, v_bf16 = pack(streams, s, FP8_DTYPE, scales)
        fa4 = joint_attention(q16, k16, v16, mask, bf16_attention)
        base = dict(env, bench="fp8_attention", shape=name, batch=B, heads=heads, head_dim=D, seq=s,
                    valid_keys=mask.seqused_k.tolist(), bf16_pack_ms=bf16_pack_ms, fp8_pack_ms=fp8_pack_ms)
        results = {f"{bf16_attention}_bf16": (bench_ms(lambda: joint_attention(q16, k16, v16, mask, bf16_attention)),
                                              fa4, 0.0)}
        for kernel, per_tensor in (("fa3_fp8", False), ("cudnn_fp8", True)):
            label = f"{kernel}_ref" if args.tiny else kernel
            try:
                v8, v_scales = quantize_fp8_heads(v_bf16, mask.seqused_k, per_tensor)
                quant_ms = bench_ms(lambda: quantize_fp8_heads(v_bf16, mask.seqused_k, per_tensor))
                if args.tiny:  # FA3 and cuDNN need a Hopper GPU: the semantics both approximate, on this kernel's v
                    def run():
                        return fp8_attention_ref(q8, k8, v8, scales[0], scales[1], v_scales, mask.seqused_k)
                    dequant = run
                elif kernel == "fa3_fp8":
                    def run():
                        return fp8_attention_fa3(q8, k8, v8, scales[0], scales[1], v_scales, mask.seqused_k)
                    dequant = run
                else:
                    out = torch.empty(B, s, H, D, dtype=FP8_DTYPE, device="cuda")
                    v_scale = v_scales[0, 0].reshape(1)

                    def run():
                        return cudnn_attention(q8, k8, v8, scales[0], scales[1], v_scale, mask.seqused_k, out)

                    def dequant():
                        out8, o_scale = run()
                        return out8.float() * o_scale
                results[label] = (bench_ms(run), dequant(), quant_ms)
            except Exception as e:  # reported, the other kernels still measured
                if args.tiny:  # only our own code runs here on the CPU: its failure is a bug
                    raise
                print(f"{name} {label}: FAILED {type(e).__name__}: {str(e)[:500]}", flush=True)
                rows.append(dict(base, kernel=label, failed=f"{type(e).__name__}: {str(e)[:500]}"))
        if "cudnn_fp8" in results and args.cudnn_plans:  # every plan cuDNN ranks for this graph, timed
            sweep = CudnnFp8Attention(all_plans=True)
            v8, v_scales = quantize_fp8_heads(v_bf16, mask.seqused_k, True)
            v_scale, out = v_scales[0, 0].reshape(1), torch.empty(B, s, H, D, dtype=FP8_DTYPE, device="cuda")
            for i, plan_name in enumerate(sweep.plan_names(q8)):
                try:
                    ms = bench_ms(lambda: sweep(q8, k8, v8, scales[0], scales[1], v_scale, mask.seqused_k, out, plan=i))
                    print(f"  cudnn plan {i} {plan_name}: {ms:.3f} ms {flops / ms / 1e9:.0f} TF/s", flush=True)
                    rows.append(dict(base, kernel="cudnn_fp8_plan", plan=i, plan_name=plan_name, attention_ms=ms,
                                     tflops=flops / ms / 1e9))
                except Exception as e:
                    print(f"  cudnn plan {i} {plan_name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        for kernel, (ms, out, quant_ms) in results.items():
            row = dict(base, kernel=kernel, attention_ms=ms, tflops=flops / ms / 1e9, v_quant_ms=quant_ms,
                       rel_rms_vs_fp32=error(out), rel_rms_vs_fa4_bf16=rel_rms_error(out.float()[queries],
                                                                                     fa4.float()[queries]))
            rows.append(row)
            print(f"{name:10s} S={s:5d} {kernel:9s} {ms:6.3f} ms  {row['tflops']:5.0f} TF/s  v quant {quant_ms:.3f} ms"
                  f"  pack bf16/fp8 {bf16_pack_ms:.3f}/{fp8_pack_ms:.3f} ms  rel-RMS vs fp32 {row['rel_rms_vs_fp32']:.2e}"
                  f"  vs {bf16_attention} {row['rel_rms_vs_fa4_bf16']:.2e}", flush=True)
    save(rows)
    if args.tiny:  # and the --model-activations part: CI runs --tiny alone
        save(model_activation_rows(env, tiny=True))


if __name__ == "__main__":
    main()
