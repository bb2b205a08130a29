"""Qwen-Image-2.1 (GPU): diffusers' QwenImage21Transformer2DModel / QwenImage21Pipeline against ours, in one process.

    python3 benchmarks/bench_qwen21.py [--sizes 1024,1328] [--condition] [--out DIR]          # the transformer
    python3 benchmarks/bench_qwen21.py --pipeline --tokenizer DIR [--sizes 1024,1328] [--condition]   # end to end
        [--cache every:2,1,0 ...] [--steps6] [--fp8-attention] [--cfg | --cfg-long]
    python3 benchmarks/bench_qwen21.py --pipeline --sizes "" --memory-low --tokenizer DIR   # memory="low" alone
    python3 benchmarks/bench_qwen21.py --pipeline --sizes "" --budgets 16 --tokenizer DIR   # under a 16 GiB cap
    python3 benchmarks/bench_qwen21.py --pipeline --tiny                                  # CPU logic check

The transformer: random full-size weights (32 blocks of 4096, normal(0, 0.02)), bf16, batch 1 (2.1 is
CFG-distilled), 64 text tokens, 40 steps as the pipeline runs them with its prefix KV cache: one prefill ("extract":
the text, and with --condition a 1024^2 condition image's 4096 tokens, block-causally, plus the target) and 39
cached steps (the target's tokens against the cached prefix; ours replayed from CUDA graphs, as in a pipeline call,
and eagerly). Per row: ms per prefill and per cached step, the 40 steps' transformer time, ours against stock, the
cached step against its floor (the block linears' FLOPs at the FP8 GEMM rate measured here, 8192x4096x12288
rowwise with fast accumulation where ours runs its GEMMs so, plus the attention alone, timed), and the error of ours against stock (rel-RMS of a cached step's output,
bf16 stock as the reference) beside what FP8 rounding done in PyTorch on the stock model moves it (emulate_fp8).

--pipeline: stock QwenImage21Pipeline against optimize() of the same components, end to end (one call: text
encoding, the condition image's VAE encode, 40 steps, VAE decode), prompt -> image. The transformer as above; the
RGBA VAE at diffusers' default (full-size) config; the text encoder at Qwen3-VL-8B's shapes (a guess: no config of
the real checkpoint could be read here; 4096 wide as the transformer's context_in_dim) with random weights: its
text stack (36 layers, 4096 wide, MLP 12288, 32 heads / 8 KV heads) and vision tower (27 blocks, 1152 wide, patch
16, 2x2 merge to 4096-wide tokens, deepstack at 8/16/24); the tokenizer: Qwen2.5's BPE folder (qwen_bpe_tokenizer.py;
Qwen3's vocabulary is the same plus a few added tokens) with Qwen's vision tokens. Rows: each size text-to-image,
and with --condition a 1024^2 condition image (RGBA) at 1024^2. Per row: seconds per image, the text encoding, VAE
encode and decode times within it, ms per step (the rest over the steps), latent rel-RMS and image PSNR against
stock. One timed call each after a 3-step warm-up call (ours captures its cached step's graph there, as a user's
first call does). Each row's `variant`: "exact" (40 steps); with --steps6, "steps6" (stock and ours at 6 steps, a
few-step LoRA's count); with --cache RULE, "cache" (ours with FastConfig(cache=RULE), checked against the same call
run eagerly: the same decisions, latents within GRAPH_GATE; its error against stock and ours uncached, the blocks
computed, and its decisions, beside it). With --fp8-attention, ours again with FastConfig(fp8_attention="auto")
(FA3; another optimize() of the same components): "fp8_attention" (40 steps), "fp8_attention+cache" per --cache
RULE, and with --steps6 "steps6" with it too (`fp8_attention` true in the row); each gated on what it adds, its
latents against ours without it, by the option's declared bound (core/optimizations.py; PSNR on the images) or,
where larger, EMULATION_MARGIN x what FP8 rounding emulated on stock moves this random network (which carries any
rounding-level change far: 0.10 at 40 steps, 0.36 at 6), and printed beside stock. With --cfg, the call with a
negative prompt and CFG 4: "cfg" (stock against ours, batched CFG: the cached steps of both branches as one forward)
and "cfg_unpaired" (ours with batched_cfg=False, then ours paired again: paired_again_s), each gated against stock;
--cfg-long the same with ~920- and ~850-token prompts ("cfg_long", "cfg_long_unpaired").

--budgets 16[,N...]: per image of 8 prompts (1024^2, 40 steps, no CFG, decoded; each prompt its own call, the 8
encoded first in one text-encoder turn as `render` does, cli/run.encode_ahead; the time from the encoding to the
last image, over 8), after a 3-step warm-up call: ours resident ("uncapped"), then per budget N
FastConfig(memory="low", max_memory_gib=N) built from the same components after
torch.cuda.set_per_process_memory_fraction(N GiB less the CUDA context) ("cap<N>": what streams, the buffer, peak
reserved, the plan's smallest budget at these shapes and its workspace). Every row also has the largest peak
allocated in a call's denoising loop and in its decode, each above what was allocated when it began (PhasePeaks):
what the plan's workspace must hold. The check: every image equals the uncapped one bit for bit, else no row, and
where it differs (where_it_differs: the loop's latents, or the decode under the cap). With --budget-cfg (4 long
prompts, a long negative prompt, CFG 4) the uncapped reference runs the branches one by one (batched_cfg=False), as
a budget does; the uncapped time with batched CFG is kept beside it
(paired_s_per_image, per_image_vs_uncapped_paired).

The error is checked (GATE) before a speed is reported. Appends to results/qwen21.jsonl.
"""

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (append_results, bench_ms, environment, matmul_tflops, random_on_gpu,  # noqa: E402
                    vision_token_ids, vision_tokenizer)

from qwen_image_fast.kernels._utils import rel_rms_error  # noqa: E402
from qwen_image_fast.pipelines.core.config import FastTransformerConfig  # noqa: E402
from qwen_image_fast.pipelines.core.model.attention import TextMask, joint_attention  # noqa: E402
from qwen_image_fast.pipelines.core.runtime.context import forward_context  # noqa: E402
from qwen_image_fast.pipelines.qwen_image21.model import FastQwenImage21Transformer  # noqa: E402

STEPS, TEXT = 40, 64
# The check before a speed is reported: ours against stock bf16 within the FP8 bound's `full` (0.1), or, where
# FP8 rounding itself moves this random-weight network further, within EMULATION_MARGIN x what it moves the stock
# model with its block linears' weights and inputs rounded to rowwise FP8 in PyTorch (emulate_fp8).
GATE, EMULATION_MARGIN = 0.1, 1.25
GRAPH_GATE = 1e-3  # ours' graphed cached step against the same step run eagerly
PROMPT = ("A red fox curled up asleep in fresh snow at dawn, soft pink light on the drifts, its breath misting, "
          "a few pine needles on the snow, shallow depth of field")
NEGATIVE = "blurry, low quality, distorted, watermark"  # --cfg's negative prompt (a length of its own)


def stock_model():
    from diffusers import QwenImage21Transformer2DModel

    with torch.device("cuda"):
        model = QwenImage21Transformer2DModel().to(torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.02)
            elif "norm" in name:
                p.normal_(0, 0.1)
    return model


def inputs(size: int, condition: bool) -> dict:
    """The pipeline's transformer arguments at size x size (16x VAE, unpatched; the pipeline rounds the size down to
    a multiple of 32: 1328 -> 1312, 82^2 target tokens)."""
    side = size // 32 * 2
    target, cond = side * side, (4096 if condition else 0)
    g = torch.Generator("cuda").manual_seed(0)
    text_slots = torch.zeros(TEXT + cond // 4, dtype=torch.bool, device="cuda")
    text_slots[3: 3 + cond // 4] = True  # a condition image's slots after the template's first tokens
    img_mask = torch.cat([text_slots, torch.ones(target // 4, dtype=torch.bool, device="cuda")])[None]
    shapes = ([(1, 64, 64)] if condition else []) + [(1, side, side)]
    return dict(hidden_states=torch.randn(1, cond + target, 64, generator=g, device="cuda", dtype=torch.bfloat16),
                encoder_hidden_states=torch.randn(1, TEXT + cond // 4, 4096, generator=g, device="cuda",
                                                  dtype=torch.bfloat16),
                img_shapes=[shapes], img_mask=img_mask, timestep=torch.full((1,), 0.5, device="cuda",
                                                                            dtype=torch.bfloat16))


def step_times(model, args: dict, graphs: bool = False) -> tuple[float, float, torch.Tensor]:
    """(prefill ms, cached step ms, a cached step's output); graphs: ours' cached steps replayed from CUDA graphs,
    as in a pipeline call whose plan has them."""
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

    kv = QwenImage21KVCache(len(model.transformer_blocks))
    with torch.no_grad(), forward_context(cuda_graphs=graphs):
        def prefill():
            with model.cache_context("cond"):
                return model(**args, kv_cache=kv, kv_cache_mode="extract", return_dict=False)[0]

        def cached():
            with model.cache_context("cond"):
                return model(**args, kv_cache=kv, kv_cache_mode="cached", return_dict=False)[0]

        prefill_ms = bench_ms(prefill, warmup_ms=200, rep_ms=1000)
        prefill()
        cached_ms = bench_ms(cached, warmup_ms=200, rep_ms=1000)
        return prefill_ms, cached_ms, cached().float()


def floor_ms(config, target: int, prefix: int, fp8_tflops: float, backend: str) -> float:
    """The block linears' FLOPs of a cached step at the FP8 rate, plus the attention alone (FlashAttention-4 or
    SDPA, as ours runs it)."""
    dim, layers = 4096, config.num_layers
    linear_flops = 2 * target * (4 * dim * dim + 3 * dim * 3 * dim) * layers  # qkv + out, gate/up + down
    heads = config.num_attention_heads
    q = torch.randn(1, target, heads, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, target + prefix, heads, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mask = TextMask.of(torch.full((1,), target + prefix, dtype=torch.int32, device="cuda"),
                       torch.ones(1, 1, 1, target + prefix, dtype=torch.bool, device="cuda"))
    attention_ms = bench_ms(lambda: joint_attention(q, k, v, mask, backend)) * layers
    return linear_flops / fp8_tflops / 1e9 + attention_ms


def cached_output(model, args: dict) -> torch.Tensor:
    """A cached step's output (after its prefill), untimed."""
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

    kv = QwenImage21KVCache(len(model.transformer_blocks))
    with torch.no_grad():
        model(**args, kv_cache=kv, kv_cache_mode="extract")
        return model(**args, kv_cache=kv, kv_cache_mode="cached", return_dict=False)[0].float()


class emulate_fp8:
    """Within the block: the stock model's block linears with rowwise-FP8 weights and inputs, dequantized (in place;
    the weights are restored after)."""

    def __init__(self, model):
        from qwen_image_fast.kernels.fp8 import quantize_fp8_rowwise_ref


        def dequantized(x):
            q, s = quantize_fp8_rowwise_ref(x.reshape(-1, x.shape[-1]))
            return (q.float() * s).to(x.dtype).view(x.shape)

        self.saved, self.handles = [], []
        for block in model.transformer_blocks:
            for linear in (block.attn.to_q, block.attn.to_k, block.attn.to_v, block.attn.to_out[0],
                           block.img_mlp.gate_layer, block.img_mlp.proj, block.img_mlp.out):
                self.saved.append((linear, linear.weight.data.clone()))
                linear.weight.data.copy_(dequantized(linear.weight.data))
                self.handles.append(linear.register_forward_pre_hook(lambda m, args: (dequantized(args[0]),)))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for linear, weight in self.saved:
            linear.weight.data.copy_(weight)
        for handle in self.handles:
            handle.remove()


def qwen3_vl_8b_config(tokenizer):
    """Qwen3-VL-8B's shapes as published for Qwen3-VL (a guess for Qwen-Image-2.1's encoder, see the docstring)."""
    from transformers import Qwen3VLConfig

    return Qwen3VLConfig(
        text_config=dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=5000000.0,
                         rope_scaling=dict(rope_type="default", mrope_section=[24, 20, 20], mrope_interleaved=True)),
        vision_config=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                           deepstack_visual_indexes=[8, 16, 24]),
        **vision_token_ids(tokenizer))


def full_size_components(tokenizer_dir: Path) -> dict:
    from diffusers import AutoencoderKLQwenImage21, FlowMatchEulerDiscreteScheduler
    from transformers import Qwen3VLForConditionalGeneration, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from qwen_image_fast.pipelines.core.vl_processor import processor_without_torchvision
    from qwen_image_fast.pipelines.tiny import QWEN21_CHAT_TEMPLATE, QWEN21_SCHEDULER_CONFIG

    tokenizer = vision_tokenizer(tokenizer_dir)
    text_encoder = random_on_gpu(Qwen3VLForConditionalGeneration, qwen3_vl_8b_config(tokenizer))
    # Qwen3-VL's image processor bounds: 256^2 to 4096^2 pixels, 16-pixel patches, 2x2 merge.
    processor = processor_without_torchvision(
        Qwen2VLImageProcessorPil(min_pixels=256 * 256, max_pixels=4096 * 4096, patch_size=16, merge_size=2,
                                 temporal_patch_size=2), tokenizer, Qwen3VLProcessor,
        chat_template=QWEN21_CHAT_TEMPLATE)
    return dict(transformer=stock_model(), vae=AutoencoderKLQwenImage21().to("cuda", torch.bfloat16),
                text_encoder=text_encoder, processor=processor,
                scheduler=FlowMatchEulerDiscreteScheduler(**QWEN21_SCHEDULER_CONFIG))


def pipeline_rows(args, env: dict) -> list[dict]:
    """--pipeline: stock QwenImage21Pipeline and optimize() of the same components, end to end (the docstring)."""
    from bench_edit import test_image
    from diffusers import QwenImage21Pipeline

    from qwen_image_fast import FastConfig, optimize
    from qwen_image_fast.pipelines.tiny import tiny_qwen21_components

    device = torch.device("cpu" if args.tiny else "cuda")
    components = tiny_qwen21_components() if args.tiny else full_size_components(args.tokenizer)
    fp8 = not (args.tiny or args.no_fp8)
    stock = QwenImage21Pipeline(**components)
    fast = optimize(QwenImage21Pipeline(**components), FastConfig(fp8=fp8, attention=args.attention))
    fp8_fast = None if not args.fp8_attention else optimize(
        QwenImage21Pipeline(**components), FastConfig(fp8=fp8, attention=args.attention, fp8_attention="auto"))
    for pipe in (stock, fast, fp8_fast):
        if pipe is not None:
            pipe.set_progress_bar_config(disable=True)
    steps = 3 if args.tiny else STEPS
    sizes = [64] if args.tiny else [int(s) for s in args.sizes.split(",") if s]  # "": no such rows
    cases = [(size, {}) for size in sizes]
    if args.condition:
        size = 64 if args.tiny else 1024
        # output_resolution: the area the pipeline resizes a condition image to (1024^2 by default)
        cases.append((size, dict(image=[test_image(size, 1).convert("RGBA")], output_resolution=size)))
    print(f"{env.get('gpu', 'cpu')}  torch {torch.__version__}  attention {fast.transformer.attention_backend}",
          flush=True)
    rows = []
    for size, inputs in cases:
        kwargs = dict(prompt=PROMPT, height=size, width=size, **inputs)
        for variant, variant_steps in (("exact", steps), *((("steps6", 6),) if args.steps6 else ())):
            results = compare_with_stock(stock, fast, kwargs, variant_steps, device, fp8, env, rows,
                                         dict(size=size, condition_images=len(inputs.get("image", ())),
                                              variant=variant))
            if variant == "exact":
                for rule in args.cache:
                    rows.extend(cache_row(fast, kwargs, steps, rule, results, device, env, size))
                if args.cfg or args.cfg_long:
                    rows.extend(cfg_rows(stock, fast, kwargs, steps, device, fp8, env, size, long=args.cfg_long))
            if fp8_fast is not None:
                rows.extend(fp8_attention_rows(fp8_fast, kwargs, variant_steps, variant, results, device, env, size,
                                               args.cache if variant == "exact" else []))
    return rows


def cfg_rows(stock, fast, kwargs: dict, steps: int, device, fp8: bool, env: dict, size: int,
             long: bool = False) -> list[dict]:
    """--cfg: the call with NEGATIVE and CFG 4, stock against ours (variant "cfg": batched CFG, the cached steps
    paired, compare_with_stock's gate), then ours with batched_cfg=False ("cfg_unpaired", the same gate against
    stock, and its distance to the paired latents printed beside; the pipeline's config put back), then ours paired
    again (`paired_again_s` in that row: an order effect shows as the two paired times apart). long (--cfg-long):
    the first of LONG_PROMPTS4 with LONG_NEGATIVE (~920 and ~850 tokens), variants "cfg_long" and
    "cfg_long_unpaired"."""
    from bench_edit import call

    from qwen_image_fast.cli.compare import psnr

    text = dict(prompt=LONG_PROMPTS4[0], negative_prompt=LONG_NEGATIVE) if long else dict(negative_prompt=NEGATIVE)
    kwargs = dict(kwargs, **text, true_cfg_scale=4.0)
    variant = "cfg_long" if long else "cfg"
    rows = []
    results = compare_with_stock(stock, fast, kwargs, steps, device, fp8, env, rows,
                                 dict(size=size, condition_images=len(kwargs.get("image", ())), variant=variant))
    if "batched_cfg" not in fast.applied:
        raise RuntimeError(f"--cfg: batched CFG did not run ({fast.applied})")
    config = fast.fast_config
    fast.fast_config = config.replace(batched_cfg=False)
    try:
        call(fast, kwargs, 3, device)
        seconds, parts, latents, image = call(fast, kwargs, steps, device)
        applied = fast.applied
    finally:
        fast.fast_config = config
    paired_again_s = call(fast, kwargs, steps, device)[0]
    (stock_s, _, stock_latents, stock_image), (paired_s, _, paired_latents, paired_image) = (results["stock"],
                                                                                          results["ours"])
    error, gate = rel_rms_error(latents, stock_latents), max(GATE, EMULATION_MARGIN * (results["fp8_emulation"] or 0))
    line = dict(env, bench="qwen21_pipeline", impl="ours", size=(size // 32) * 32, steps=steps,
                condition_images=len(kwargs.get("image", ())), variant=f"{variant}_unpaired", s_per_image=seconds,
                paired_again_s=paired_again_s,
                ms_per_step=1000 * (seconds - sum(parts.values())) / steps, latent_rel_rms=error,
                psnr_db=psnr(image, stock_image), rel_rms_vs_paired=rel_rms_error(latents, paired_latents),
                psnr_vs_paired=psnr(image, paired_image), gate=gate, applied=applied, **parts)
    print(f"{size}^2 {variant}_unpaired {seconds:6.2f} s  {line['ms_per_step']:6.1f} ms/step  latent rel-RMS "
          f"{error:.2e} vs stock, {line['rel_rms_vs_paired']:.2e} vs paired (PSNR {line['psnr_vs_paired']:.1f} dB)  "
          f"{applied}; paired again {paired_again_s:.2f} s", flush=True)
    if "batched_cfg" in applied or not error <= gate:
        print(f"  FAILED: batched CFG ran, or the check against stock ({error:.3e} > {gate:.3e}): no speed reported",
              flush=True)
        return rows
    line.update(speedup_vs_stock=stock_s / seconds, paired_speedup=seconds / paired_s)
    print(f"  x{line['speedup_vs_stock']:.2f} stock; batched CFG x{line['paired_speedup']:.3f} over it", flush=True)
    return rows + [line]


def fp8_attention_rows(fast, kwargs: dict, steps: int, variant: str, results: dict, device, env: dict, size: int,
                       rules: list) -> list[dict]:
    """Ours with FastConfig(fp8_attention="auto") (`fast`), after a 3-step warm-up call: its row (variant
    "fp8_attention" for the 40-step call, else `variant` with fp8_attention true), then one per cache rule
    ("fp8_attention+cache", cache_row's check); each gated by the option's bound on its latents against ours without
    it (`results`: compare_with_stock's), printed beside stock."""
    from bench_edit import call

    from qwen_image_fast.cli.compare import psnr
    from qwen_image_fast.pipelines.core.optimizations import BY_NAME

    bound = BY_NAME["fp8_attention"].bound
    # the random network carries any rounding-level change far (FP8 GEMMs emulated on stock move its latents by
    # 0.10 at 40 steps, 0.36 at 6): the bound, or that amplification's gate, whichever is larger
    gate = max(bound.full, EMULATION_MARGIN * (results["fp8_emulation"] or 0.0))
    kernel, why = fast.transformer.fp8_attention
    if kernel is None:  # "auto" found no kernel here (the CPU check): no row says FP8 attention ran
        print(f"{size}^2 fp8_attention: not run here ({why})", flush=True)
        return []
    call(fast, kwargs, 3, device)
    seconds, parts, latents, image = call(fast, kwargs, steps, device)
    (stock_s, _, stock_latents, stock_image), (ours_s, _, ours_latents, ours_image) = results["stock"], results["ours"]
    line = dict(env, bench="qwen21_pipeline", impl="ours", size=(size // 32) * 32, steps=steps,
                condition_images=len(kwargs.get("image", ())),
                variant="fp8_attention" if variant == "exact" else variant, fp8_attention=True, s_per_image=seconds,
                ms_per_step=1000 * (seconds - sum(parts.values())) / steps,
                latent_rel_rms=rel_rms_error(latents, stock_latents), psnr_db=psnr(image, stock_image),
                rel_rms_vs_bf16_attention=rel_rms_error(latents, ours_latents),
                psnr_vs_bf16_attention=psnr(image, ours_image), gate=(gate, bound.full_psnr_db),
                applied=fast.applied, **parts)
    print(f"{size}^2 {line['variant']} ({steps} steps): {seconds:6.2f} s  {line['ms_per_step']:6.1f} ms/step  vs ours "
          f"without it rel-RMS {line['rel_rms_vs_bf16_attention']:.3e} PSNR {line['psnr_vs_bf16_attention']:.1f} dB  "
          f"vs stock rel-RMS {line['latent_rel_rms']:.3e} PSNR {line['psnr_db']:.1f} dB  {fast.applied}", flush=True)
    if not (line["rel_rms_vs_bf16_attention"] <= gate and line["psnr_vs_bf16_attention"] >= bound.full_psnr_db):
        print(f"  FAILED the gate ({gate:.3f}, {bound.full_psnr_db} dB): no speed reported", flush=True)
        return []
    line.update(speedup_vs_stock=stock_s / seconds, speedup_vs_bf16_attention=ours_s / seconds)
    print(f"  x{line['speedup_vs_stock']:.2f} stock, x{line['speedup_vs_bf16_attention']:.2f} ours without it",
          flush=True)
    rows = [line]
    for rule in rules:
        rows.extend(cache_row(fast, kwargs, steps, rule, results, device, env, size, variant="fp8_attention+cache"))
    return rows


def compare_with_stock(stock, fast, kwargs: dict, steps: int, device, fp8: bool, env: dict, rows: list,
                       about: dict) -> dict:
    """Stock and ours on one call's arguments, each after a 3-step warm-up call; their rows appended to `rows`
    (ours only within the gate); returns call()'s results by impl."""
    from bench_edit import call

    from qwen_image_fast.cli.compare import psnr

    size, inputs = about["size"], about["condition_images"]
    results = {}
    for impl, pipe in (("stock", stock), ("ours", fast)):
        call(pipe, kwargs, 3, device)  # warm-up: kernels compiled, allocator settled, graphs captured
        results[impl] = call(pipe, kwargs, steps, device)
    ref_latents, ref_image = results["stock"][2], results["stock"][3]
    emulated_error = None
    if fp8:  # how far FP8 rounding itself moves this random-weight pipeline (done in PyTorch on stock)
        with emulate_fp8(stock.transformer):
            emulated_error = rel_rms_error(call(stock, kwargs, steps, device)[2], ref_latents)
    gate = GATE if emulated_error is None else max(GATE, EMULATION_MARGIN * emulated_error)
    results["fp8_emulation"] = emulated_error  # how far this random network carries a rounding-level change
    what = f"{size}^2{' + condition' if inputs else ''} {about['variant']}"
    for impl in ("stock", "ours"):
        seconds, parts, latents, image = results[impl]
        error, db = rel_rms_error(latents, ref_latents), psnr(image, ref_image)
        line = dict(env, bench="qwen21_pipeline", impl=impl, size=(size // 32) * 32, steps=steps,
                    condition_images=inputs, variant=about["variant"], s_per_image=seconds,
                    ms_per_step=1000 * (seconds - sum(parts.values())) / steps, latent_rel_rms=error,
                    psnr_db=db, fp8_emulation_latent_rel_rms=emulated_error, gate=gate,
                    applied=fast.applied if impl == "ours" else None, **parts)
        print(f"{what:16s} {impl:5s} {seconds:6.2f} s  {line['ms_per_step']:6.1f} ms/step  text "
              f"{parts.get('text_s', 0):.3f} s  vae enc {parts.get('vae_encode_s', 0):.3f} s  dec "
              f"{parts.get('vae_decode_s', 0):.3f} s  latent rel-RMS {error:.2e} (FP8 emulated on stock: "
              f"{emulated_error or 0:.2e})  PSNR {db:.1f} dB", flush=True)
        if impl == "ours":
            if not error <= gate:
                print(f"  FAILED the check against stock ({error:.3e} > {gate:.3e}): no speed reported", flush=True)
                continue
            line["speedup_vs_stock"] = results["stock"][0] / seconds
            print(f"{what}: x{line['speedup_vs_stock']:.2f} end to end", flush=True)
        rows.append(line)
    return results


def memory_rows(args, env: dict) -> list[dict]:
    """--memory-low: ours resident ("fast") and with FastConfig(memory="low") ("low": the text encoder and the
    transformer's blocks take turns on the GPU), one after the other in this process (the resident pipeline dropped
    first), 1024^2, 40 steps, a batch of each of --memory-batches prompts; each a timed call after a 3-step warm-up,
    with the peak reserved memory over both calls. The check: low's latents equal the resident pipeline's bit for
    bit (else no row)."""
    import gc

    from bench_edit import call
    from diffusers import QwenImage21Pipeline

    from qwen_image_fast import FastConfig, optimize

    from qwen_image_fast.pipelines.tiny import tiny_qwen21_components

    gpu = not args.tiny
    device, size, steps = (torch.device("cuda"), 1024, STEPS) if gpu else (torch.device("cpu"), 64, 3)
    components = full_size_components(args.tokenizer) if gpu else tiny_qwen21_components()
    batches = [int(b) for b in args.memory_batches.split(",")]
    results = {}
    for memory in ("fast", "low"):
        pipe = optimize(QwenImage21Pipeline(**components), FastConfig(memory=memory, fp8=gpu,
                                                                      attention=args.attention), device=device)
        pipe.set_progress_bar_config(disable=True)
        if memory == "fast":  # the stock blocks (BF16) are not the resident pipeline's: off the GPU
            components["transformer"].transformer_blocks.to("cpu")
        for batch in batches:
            kwargs = dict(prompt=[PROMPT] * batch, height=size, width=size)
            gc.collect()
            if gpu:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            call(pipe, kwargs, 3, device)
            seconds, parts, latents, _ = call(pipe, kwargs, steps, device)
            results[memory, batch] = (seconds, parts, latents,
                                      torch.cuda.max_memory_reserved() / 2**30 if gpu else None, pipe.applied)
        del pipe
    rows = []
    for batch in batches:
        same = torch.equal(results["low", batch][2], results["fast", batch][2])
        for memory in ("fast", "low"):
            seconds, parts, _, peak, applied = results[memory, batch]
            line = dict(env, bench="qwen21_pipeline", impl="ours", variant=f"memory_{memory}", size=size,
                        steps=steps, batch=batch, s_per_image=seconds / batch,
                        ms_per_step=1000 * (seconds - sum(parts.values())) / steps, peak_reserved_gib=peak,
                        equal_to_resident=same, applied=applied, **parts)
            print(f"{size}^2 batch {batch} memory={memory}: {seconds / batch:6.2f} s an image  "
                  f"{line['ms_per_step']:6.1f} ms/step  text {parts.get('text_s', 0):.3f} s  peak reserved "
                  f"{peak or 0:.1f} GiB  equal to resident: {same}", flush=True)
            if same:
                rows.append(line)
        if not same:
            print("  FAILED: memory='low' differs from the resident pipeline: no speed reported", flush=True)
            continue
        print(f"  batch {batch}, low / fast: x{results['low', batch][0] / results['fast', batch][0]:.3f} the time",
              flush=True)
    return rows


PROMPTS8 = [f"{PROMPT}, picture {i} of a series" for i in range(8)]
# --budget-cfg: the plan's other case, CFG 4 with long prompts (each ~900 tokens of Qwen's BPE: both branches'
# prefix caches near the planned 1024 tokens)
LONG_PROMPTS4 = [", ".join([PROMPT] * 24) + f", picture {i} of a series" for i in range(4)]  # 918 tokens
LONG_NEGATIVE = ", ".join(["blurry, low quality, distorted, oversaturated, watermark, text"] * 60)  # 840 tokens


class PhasePeaks:
    """On a GPU, the peak memory allocated in each phase of the pipeline calls it is told of, above what was
    allocated when the phase began: the denoising loop (from the call's start to its VAE decode: the prefix caches,
    the activations, the graphs' pools) and the decode; what a budget's planned workspace (qwen_image21/memory.py
    workspace_bytes) must hold. The allocator's peaks are reset at each phase's start, so the peak reserved over
    every phase is kept here (peak_reserved_gib). Nothing on the CPU."""

    def __init__(self, device: torch.device):
        self.on, self.loop, self.decode, self.reserved, self.base = device.type == "cuda", [], [], 0, 0

    def _begin(self):
        self.reserved = max(self.reserved, torch.cuda.max_memory_reserved())
        torch.cuda.reset_peak_memory_stats()
        self.base = torch.cuda.memory_allocated()

    def _peak_gib(self) -> float:
        return (torch.cuda.max_memory_allocated() - self.base) / 2**30

    def call_begins(self):
        if self.on:
            self._begin()

    def decode_begins(self):
        if self.on:
            self.loop.append(self._peak_gib())
            self._begin()

    def decode_ends(self):
        if self.on:
            self.decode.append(self._peak_gib())

    def peak_reserved_gib(self) -> float | None:
        return max(self.reserved, torch.cuda.max_memory_reserved()) / 2**30 if self.on else None

    def fields(self) -> dict:
        """The row's: the largest loop and decode peaks over the calls (GiB), and the peak reserved."""
        return dict(loop_peak_gib=max(self.loop, default=None), decode_peak_gib=max(self.decode, default=None),
                    peak_reserved_gib=self.peak_reserved_gib())


class DecodeRecorder:
    """Each VAE decode's input (the denoising loop's latents) and output, as CPU copies, while in the `with`: which
    side of the decode a difference between two runs comes from. The copies follow the decode, which the pipeline
    reads back right after it anyway (output_type="np"). peaks: told where each decode begins and ends."""

    def __init__(self, vae, peaks: PhasePeaks):
        self.vae, self.peaks, self.calls = vae, peaks, []

    def __enter__(self):
        decode = self.vae.decode

        def recorded(z, *args, **kwargs):
            self.peaks.decode_begins()
            out = decode(z, *args, **kwargs)
            self.peaks.decode_ends()
            sample = out[0] if isinstance(out, tuple) else out.sample
            self.calls.append((z.detach().cpu(), sample.detach().cpu()))
            return out

        self.vae.decode = recorded  # an instance attribute over the class's method, deleted on exit
        return self

    def __exit__(self, *exc):
        del self.vae.decode


def tensor_differences(tensors: list, expected: list) -> str:
    """Per pair: equal, or its largest absolute difference."""
    return "; ".join("equal" if torch.equal(a, b) else f"max |diff| {(a.float() - b.float()).abs().max():.3g}"
                     for a, b in zip(tensors, expected))


def eight_images(pipe, size: int, steps: int, device, peaks: PhasePeaks, prompts=PROMPTS8, negative=None,
                 cfg: float = 1.0) -> tuple[float, np.ndarray, list]:
    """(seconds an image over `prompts`, the images [N, H, W, 4], per image its decode's (input, output):
    DecodeRecorder) after a 3-step warm-up call (bench docstring); `peaks` told of each timed call's phases."""
    from types import SimpleNamespace

    from qwen_image_fast.cli.run import encode_ahead

    def render(i, **text):
        peaks.call_begins()
        return pipe(**text, height=size, width=size, num_inference_steps=steps, output_type="np",
                    true_cfg_scale=cfg, generator=torch.Generator(device).manual_seed(i)).images[0]

    pipe(prompt=prompts[0], negative_prompt=negative, true_cfg_scale=cfg, height=size, width=size,
         num_inference_steps=3, output_type="np")
    jobs = [[SimpleNamespace(prompt=p, negative_prompt=negative, images=())] for p in prompts]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    encoded, until = encode_ahead(pipe, jobs, 0)
    if until != len(jobs) or len(encoded) != len(jobs):
        raise RuntimeError(f"encode_ahead covered {len(encoded)} of {len(jobs)} prompts")
    with DecodeRecorder(pipe.vae, peaks) as decodes:
        images = [render(i, **encoded[i]) for i in range(len(jobs))]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / len(jobs), np.stack(images), decodes.calls


def image_differences(images: np.ndarray, expected: np.ndarray) -> str:
    """Per image of [N, H, W, C] in [0, 1]: equal, or its largest difference and PSNR against `expected`'s."""
    def differs(a, b) -> str:
        diff = a.astype(np.float64) - b
        return f"max |diff| {np.abs(diff).max():.3g}, PSNR {10 * np.log10(1 / np.mean(diff ** 2)):.1f} dB"

    return "; ".join("equal" if np.array_equal(a, b) else differs(a, b) for a, b in zip(images, expected))


def where_it_differs(vae, decodes: list, expected_decodes: list, device):
    """A budget's images not equal to the uncapped ones: whether the denoising loop's latents already differ, and if
    they do not, whether the uncapped run's latents decoded again here, under the cap, give its decode outputs (a
    decode that picks other convolution algorithms when the cap leaves less room would not)."""
    latents = [z for z, _ in decodes], [z for z, _ in expected_decodes]
    print(f"  the decode's inputs (the loop's latents) against the uncapped run's: {tensor_differences(*latents)}",
          flush=True)
    if all(torch.equal(a, b) for a, b in zip(*latents)):
        with torch.no_grad():
            again = [vae.decode(z.to(device), return_dict=False)[0].cpu() for z in latents[1]]
        print("  the uncapped run's latents decoded again under the cap, against its own decode: "
              f"{tensor_differences(again, [out for _, out in expected_decodes])}", flush=True)


def budget_rows(args, env: dict) -> list[dict]:
    """--budgets: ours resident, then memory="low" under each budget's cap (module docstring)."""
    import gc

    from diffusers import QwenImage21Pipeline

    from qwen_image_fast import FastConfig, optimize
    from qwen_image_fast.pipelines.core.runtime.memory import GIB, context_bytes, placed_bytes
    from qwen_image_fast.pipelines.qwen_image21 import memory
    from qwen_image_fast.pipelines.qwen_image21.model import SHARED_MODULES
    from qwen_image_fast.pipelines.qwen_image21.pipeline import FastQwenImage21Pipeline, prefix_token_counter

    device, size = torch.device("cuda"), 1024
    fast = optimize(QwenImage21Pipeline(**full_size_components(args.tokenizer)),
                    FastConfig(attention=args.attention), device=device)
    fast.set_progress_bar_config(disable=True)
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    work = dict(prompts=LONG_PROMPTS4, negative=LONG_NEGATIVE, cfg=4.0) if args.budget_cfg else {}
    suffix = "_cfg_long" if args.budget_cfg else ""
    paired, peaks = None, PhasePeaks(device)
    if args.budget_cfg:  # a budget runs the branches one by one: the reference that it must equal does too
        paired, _, _ = eight_images(fast, size, STEPS, device, peaks, **work)
        print(f"uncapped, batched CFG: {paired:.3f} s an image", flush=True)
        fast.fast_config = fast.fast_config.replace(batched_cfg=False)
    per_image, expected, expected_decodes = eight_images(fast, size, STEPS, device, peaks, **work)
    if args.budget_cfg:  # the reference must reproduce itself for "equal to it" to say anything
        _, again, _ = eight_images(fast, size, STEPS, device, peaks, **work)
        print(f"uncapped, again: {image_differences(again, expected)}", flush=True)
    count = prefix_token_counter(fast.processor)
    prompts = work.get("prompts", PROMPTS8)
    base = dict(env, bench="qwen21_pipeline", impl="ours", size=size, steps=STEPS, prompts=len(prompts),
                cfg=work.get("cfg", 1.0), prefix_tokens=max(count(p) for p in prompts),
                negative_prefix_tokens=count(LONG_NEGATIVE) if args.budget_cfg else None)
    rows = [dict(base, variant="uncapped" + suffix, s_per_image=per_image, paired_s_per_image=paired,
                 **peaks.fields(), applied=fast.applied)]
    print(f"uncapped: {per_image:.3f} s an image, peak reserved {rows[0]['peak_reserved_gib']:.1f} GiB, the loop's "
          f"peak {rows[0]['loop_peak_gib']:.2f} GiB above a call's start, the decode's "
          f"{rows[0]['decode_peak_gib']:.2f}", flush=True)
    components = dict(fast.components)
    del fast
    for budget in args.budgets:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(1.0)
        try:
            low = FastQwenImage21Pipeline(**components, fast_config=FastConfig(
                attention=args.attention, memory="low", max_memory_gib=budget))
        except ValueError as refused:  # a budget below the plan's smallest: what it says, then the next budget
            print(f"cap{budget:g}: refused: {refused}", flush=True)
            continue
        low.set_progress_bar_config(disable=True)
        turns = low._turns
        blocks, text = turns.arenas["transformer"], turns.arenas["text_encoder"]
        smallest = (context_bytes(device) + placed_bytes(low, SHARED_MODULES) + memory.workspace_bytes(low)
                    + max(a.streaming_floor() for a in turns.arenas.values())) / GIB
        free, total = torch.cuda.mem_get_info()
        context = (total - free - torch.cuda.memory_reserved()) / GIB
        torch.cuda.set_per_process_memory_fraction((budget - context) * GIB / total)
        torch.cuda.reset_peak_memory_stats()
        planned = memory.workspace_bytes(low) / GIB
        print(f"cap{budget:g}: buffer {turns.buffer_bytes / GIB:.2f} GiB, context {context:.2f} GiB, the plan's "
              f"smallest budget {smallest:.2f} GiB, its workspace {planned:.2f} GiB", flush=True)
        peaks = PhasePeaks(device)
        per_image, images, decodes = eight_images(low, size, STEPS, device, peaks, **work)
        same = bool(np.array_equal(images, expected))
        row = dict(base, variant=f"cap{budget:g}{suffix}", max_memory_gib=budget, s_per_image=per_image,
                   per_image_vs_uncapped=per_image / rows[0]["s_per_image"],
                   per_image_vs_uncapped_paired=per_image / paired if paired else None,
                   **peaks.fields(), planned_workspace_gib=planned, context_gib=context,
                   buffer_gib=turns.buffer_bytes / GIB, smallest_budget_gib=smallest,
                   streamed_blocks=len(blocks.streamed) if turns.streams("transformer") else 0,
                   blocks=len(blocks.layer_ranges),
                   streamed_text_layers=len(text.layer_ranges) - text.resident_layers(turns.buffer_bytes),
                   text_layers=len(text.layer_ranges), equal_to_uncapped=same, applied=low.applied)
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items() if k not in env}, flush=True)
        if same:
            rows.append(row)
        else:
            print(f"  FAILED: cap{budget:g}'s images differ from the uncapped ones ({image_differences(images, expected)})"
                  ": no speed reported", flush=True)
            where_it_differs(low.vae, decodes, expected_decodes, device)
        components = dict(low.components)
        del low, blocks, text, turns
        torch.cuda.set_per_process_memory_fraction(1.0)
    return rows


def cache_row(fast, kwargs: dict, steps: int, rule: str, results: dict, device, env: dict, size: int,
              variant: str = "cache") -> list[dict]:
    """Ours with FastConfig(cache=rule): graphed (after a 3-step warm-up call) against the same call run eagerly
    (the check: the same decisions, latents within GRAPH_GATE; else no speed), and beside stock and ours uncached
    (`results`: compare_with_stock's). The pipeline's config is put back."""
    from bench_edit import call

    from qwen_image_fast.cli.compare import psnr

    config = fast.fast_config

    def decisions():
        return {name: "".join("C" if c else "-" for c, _ in branch.decisions)
                for name, branch in fast._last_step_cache.branches.items()}

    try:
        fast.fast_config = config.replace(cache=rule, cuda_graphs=False)
        eager = call(fast, kwargs, steps, device)
        eager_decisions = decisions()
        fast.fast_config = config.replace(cache=rule)
        call(fast, kwargs, 3, device)  # warm-up: the pieces' graphs captured
        seconds, parts, latents, image = call(fast, kwargs, steps, device)
        label, ran, applied, decided = fast.fast_config.cache.label(), fast.blocks_computed, fast.applied, decisions()
    finally:
        fast.fast_config = config
    (stock_s, _, stock_latents, stock_image), (ours_s, _, ours_latents, ours_image) = results["stock"], results["ours"]
    graph_error = rel_rms_error(latents, eager[2])
    line = dict(env, bench="qwen21_pipeline", impl="ours", variant=variant, cache=label, size=(size // 32) * 32,
                steps=steps, condition_images=len(kwargs.get("image", ())), s_per_image=seconds,
                ms_per_step=1000 * (seconds - sum(parts.values())) / steps, blocks_computed=ran, decisions=decided,
                latent_rel_rms=rel_rms_error(latents, stock_latents), psnr_db=psnr(image, stock_image),
                rel_rms_vs_uncached=rel_rms_error(latents, ours_latents), psnr_vs_uncached=psnr(image, ours_image),
                graphed_vs_eager_rel_rms=graph_error, applied=applied, **parts)
    print(f"{size}^2 {variant} {label}: {seconds:6.2f} s  {line['ms_per_step']:6.1f} ms/step  blocks {ran:.3f}  "
          f"vs uncached rel-RMS {line['rel_rms_vs_uncached']:.3e} PSNR {line['psnr_vs_uncached']:.1f} dB  vs stock "
          f"rel-RMS {line['latent_rel_rms']:.3e} PSNR {line['psnr_db']:.1f} dB  graphed vs eager {graph_error:.1e}  "
          f"{decided}", flush=True)
    if decided != eager_decisions or not graph_error <= GRAPH_GATE:
        print(f"  FAILED: the graphed call differs from the eager one ({eager_decisions}, {graph_error:.3e}): no "
              "speed reported", flush=True)
        return []
    line.update(speedup_vs_stock=stock_s / seconds, speedup_vs_uncached=ours_s / seconds)
    print(f"  x{line['speedup_vs_stock']:.2f} stock, x{line['speedup_vs_uncached']:.2f} ours uncached", flush=True)
    return [line]


def transformer_rows(args, env: dict) -> list[dict]:
    """The transformer alone (the docstring)."""
    stock = stock_model()
    fast = FastQwenImage21Transformer.from_diffusers(stock, FastTransformerConfig(fp8=not args.no_fp8,
                                                                                 attention=args.attention))
    # the floor at the rate of the GEMMs as ours runs them (fast accumulation by default)
    fast_accum = fast.fast_config.fp8 and fast.fast_config.fp8_fast_accum
    fp8_tflops = matmul_tflops(8192, 12288, 4096, fp8=True, fast_accum=fast_accum)
    env.update(fp8_gemm_tflops=fp8_tflops, fp8_gemm_fast_accum=fast_accum)
    print(f"FP8 GEMM 8192x4096x12288{' (fast accumulation)' if fast_accum else ''}: {fp8_tflops:.0f} TF/s; "
          f"attention backend {fast.attention_backend}", flush=True)
    rows = []
    cases = [(int(s), False) for s in args.sizes.split(",")] + ([(1024, True)] if args.condition else [])
    for size, condition in cases:
        call = inputs(size, condition)
        target = (size // 32 * 2) ** 2
        prefix = TEXT + (4096 if condition else 0)
        stock_prefill, stock_cached, ref = step_times(stock, call)
        _, eager_cached, eager_out = step_times(fast, call)
        ours_prefill, ours_cached, out = step_times(fast, call, graphs=True)
        graph_error = rel_rms_error(out, eager_out)
        error = rel_rms_error(out, ref)
        emulated_error = None
        if fast.fast_config.fp8:  # the same network with FP8 rounding done in PyTorch: how far FP8 itself moves it
            with emulate_fp8(stock):
                emulated_error = rel_rms_error(cached_output(stock, call), ref)
        gate = GATE if emulated_error is None else max(GATE, EMULATION_MARGIN * emulated_error)
        floor = floor_ms(stock.config, target, prefix, fp8_tflops, fast.attention_backend)
        stock_total = stock_prefill + (STEPS - 1) * stock_cached
        ours_total = ours_prefill + (STEPS - 1) * ours_cached
        row = dict(env, bench="qwen21", size=size, condition=condition, target_tokens=target, prefix_tokens=prefix,
                   steps=STEPS, stock_prefill_ms=stock_prefill, stock_cached_ms=stock_cached,
                   ours_prefill_ms=ours_prefill, ours_cached_ms=ours_cached, ours_cached_eager_ms=eager_cached,
                   graphed_vs_eager_rel_rms=graph_error, stock_transformer_s=stock_total / 1e3,
                   ours_transformer_s=ours_total / 1e3, speedup=stock_total / ours_total, floor_cached_ms=floor,
                   cached_vs_floor=ours_cached / floor, rel_rms_vs_stock=error,
                   fp8_emulation_rel_rms_vs_stock=emulated_error, gate=gate,
                   applied=[f"{name}:{value}" if value is not True else name for name, value in fast.running()]
                   + ["cuda_graphs"])
        what = f"{size}^2{' + condition' if condition else ''}"
        if not graph_error <= GRAPH_GATE:
            print(f"{what}: FAILED: the graphed step differs from the eager one ({graph_error:.3e})", flush=True)
            continue
        if not error <= gate:
            print(f"{what}: FAILED the check against stock ({error:.3e} > {gate:.3e}): no speed reported", flush=True)
            continue
        rows.append(row)
        print(f"{what}: stock prefill {stock_prefill:.1f} ms, step {stock_cached:.1f} ms, 40 steps {stock_total / 1e3:.2f}"
              f" s | ours prefill {ours_prefill:.1f} ms, step {ours_cached:.1f} ms (eager {eager_cached:.1f}; floor "
              f"{floor:.1f}, x"
              f"{ours_cached / floor:.2f}), 40 steps {ours_total / 1e3:.2f} s | x{stock_total / ours_total:.2f} | "
              f"rel-RMS {error:.3e} (FP8 emulated on stock: {emulated_error or 0:.3e})", flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pipeline", action="store_true", help="end to end: QwenImage21Pipeline, prompt -> image")
    parser.add_argument("--tiny", action="store_true", help="with --pipeline: tiny components on the CPU")
    parser.add_argument("--tokenizer", type=Path, default=None, help="with --pipeline: a Qwen BPE tokenizer folder")
    parser.add_argument("--sizes", default="1024,1328")
    parser.add_argument("--condition", action="store_true", help="also a row with a 1024^2 condition image")
    parser.add_argument("--attention", default="auto", help="ours: auto, fa4, cudnn, sdpa")
    parser.add_argument("--no-fp8", action="store_true", help="ours with BF16 block linears")
    parser.add_argument("--cache", action="append", default=[],
                        help="with --pipeline: also ours with FastConfig(cache=RULE) (repeatable), e.g. every:2,1,0")
    parser.add_argument("--steps6", action="store_true", help="with --pipeline: also stock and ours at 6 steps")
    parser.add_argument("--cfg", action="store_true",
                        help="with --pipeline: also stock and ours with a negative prompt and CFG 4 (batched CFG), "
                        "and ours with batched_cfg=False")
    parser.add_argument("--cfg-long", action="store_true",
                        help="as --cfg with a ~920-token prompt and a ~850-token negative prompt")
    parser.add_argument("--fp8-attention", action="store_true",
                        help="with --pipeline: also ours with FastConfig(fp8_attention='auto') (FA3)")
    parser.add_argument("--memory-low", action="store_true",
                        help="with --pipeline: then ours resident and with memory='low' at 1024^2 (peak reserved)")
    parser.add_argument("--memory-batches", default="1", help="with --memory-low: the batch sizes, e.g. 1,4")
    parser.add_argument("--budgets", type=lambda text: [float(v) for v in text.split(",")], default=None,
                        help="with --pipeline (GPU): ours resident, then memory='low' under each budget, e.g. 16")
    parser.add_argument("--budget-cfg", action="store_true",
                        help="with --budgets: 4 long prompts (~900 tokens) with a long negative prompt, CFG 4")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.pipeline and not args.tiny and args.tokenizer is None:
        parser.error("--pipeline needs --tokenizer DIR (benchmarks/qwen_bpe_tokenizer.py writes one), or --tiny")
    env = {} if args.tiny else environment()
    rows = pipeline_rows(args, env) if args.pipeline else transformer_rows(args, env)
    if args.memory_low:
        rows += memory_rows(args, env)
    if args.budgets:
        rows += budget_rows(args, env)
    if not args.tiny:
        append_results("qwen21", rows, args.out)


if __name__ == "__main__":
    main()
