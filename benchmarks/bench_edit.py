"""Image editing and img2img end to end (GPU): stock diffusers vs optimize() on the same pipeline, same inputs and seed.

    python3 benchmarks/bench_edit.py --tokenizer DIR [--rows edit1,img2img,graphs] [--out DIR]   # full size, a GPU
    python3 benchmarks/bench_edit.py --tokenizer DIR --rows edit2 --cache every:2,8,0              # + a step cache
    python3 benchmarks/bench_edit.py --tiny                                                     # CPU logic check

Components: the full-size transformer (Edit-2511's config: zero_cond_t) and VAE with random weights; the text
encoder at Qwen2.5-VL-7B's shapes with random weights: its text stack (28 layers, 3584 wide, MLP 18944) and its
vision tower (32 blocks, 1280 wide, MLP 3420, 16 heads, windowed attention with full attention in blocks 7/15/23/31,
merged to 3584-wide tokens: the real output width). The tokenizer: a Qwen2.5 BPE tokenizer folder (real prompt
lengths) plus Qwen's vision tokens; the processor: transformers' Qwen2VLProcessor with Qwen-Image-Edit's image
bounds, built as qwen_image_fast/vl_processor.py says (the same object in both pipelines).

Rows (all true_cfg_scale=4 with a negative prompt, B=1):
  edit1    QwenImageEditPlusPipeline, one 1024x1024 condition image -> 1024x1024, 40 steps (Edit-2511's settings)
  edit2    the same with two 1024x1024 condition images
  img2img  QwenImageImg2ImgPipeline, 1024x1024, strength 0.6, 50 steps (30 run); the same transformer (one image:
           zero_cond_t computes what a model without it does)
  graphs   the fast transformer alone at edit1's shapes: eager vs CUDA-graph replay, B=1 vs cond+uncond batched
           (B=2), per image-forward: what a rewrite of the pipelines' loops could gain
With --fp8-attention KERNEL ours runs with FastConfig(fp8_attention=KERNEL), its rows gated by that option's bound.
With --cache RULE (FastConfig.cache, as `render --cache` takes it), each pipeline row adds ours with that step cache,
against ours uncached (latent rel-RMS, image PSNR; the fraction of block forwards run and each branch's decisions).
Per pipeline row: seconds per image (the call: text + VL encoding, VAE encode, denoising, VAE decode), the text
encoding, VAE encode and decode times within it, ms per step (the rest over the steps), and ours against stock:
latent rel-RMS (the latents after the last step) and image PSNR. One timed call each after a 3-step warm-up call
(in which ours captures its paired forward's CUDA graph, as a user's first call does: the timed call is a later one).
A row of ours must pass the gate first (latent rel-RMS <= 0.1, PSNR >= 38 dB) or it is printed and not recorded.
Appends to results/edit.jsonl.
"""

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pipeline import NEGATIVE  # noqa: E402
from common import (append_results, bench_ms, environment, random_on_gpu, sync, vision_token_ids,  # noqa: E402
                    vision_tokenizer)

from qwen_image_fast import FastConfig, optimize  # noqa: E402
from qwen_image_fast.cli.compare import psnr  # noqa: E402
from qwen_image_fast.kernels._utils import rel_rms_error  # noqa: E402
from qwen_image_fast.pipelines.core.optimizations import BY_NAME  # noqa: E402

EDIT_PROMPT = "Turn the fox into a snow leopard, keep the pose and the dawn light"
GATE = (0.1, 38.0)  # latent rel-RMS, image PSNR dB: FP8 against bf16 stock with the same sampler
# Qwen-Image-Edit's processor: Qwen2VLImageProcessor bounds (56x56 to 3584x3584 pixels), 14-pixel patches, 2x2 merge.
VL_PIXELS = (56 * 56, 28 * 28 * 16384)


def qwen25_vl_7b_config(tokenizer):
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(
        text_config=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                         num_key_value_heads=4, vocab_size=152064, rope_theta=1000000.0,
                         rope_scaling=dict(mrope_section=[16, 24, 24], rope_type="default", type="default")),
        vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[7, 15, 23, 31]),
        vocab_size=152064, **vision_token_ids(tokenizer))


def full_size_components(tokenizer_dir: Path) -> dict:
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler
    from transformers import Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from bench_transformer import make_stock
    from qwen_image_fast.pipelines.tiny import QWEN_IMAGE_SCHEDULER_CONFIG
    from qwen_image_fast.pipelines.core.vl_processor import processor_without_torchvision

    tokenizer = vision_tokenizer(tokenizer_dir)
    text_encoder = random_on_gpu(Qwen2_5_VLForConditionalGeneration, qwen25_vl_7b_config(tokenizer))
    min_pixels, max_pixels = VL_PIXELS
    processor = processor_without_torchvision(
        Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels, patch_size=14, merge_size=2,
                                 temporal_patch_size=2), tokenizer)
    return dict(transformer=make_stock(zero_cond_t=True), vae=AutoencoderKLQwenImage().to("cuda", torch.bfloat16),
                text_encoder=text_encoder, tokenizer=tokenizer, processor=processor,
                scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER_CONFIG))


def tiny_components() -> dict:
    from qwen_image_fast.pipelines.tiny import tiny_components as tiny

    return tiny(0, vision=True, transformer_config=dict(zero_cond_t=True))


def test_image(size: int, seed: int) -> Image.Image:
    """A smooth random picture (blurred noise), size x size RGB."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (size // 32, size // 32, 3), dtype=np.uint8)
    return Image.fromarray(small).resize((size, size), Image.BICUBIC)


class Timings:
    """Wall time spent in some of a pipeline's methods during a call (the GPU synchronized around each; the VAE's
    decode, 2D or not). restore() takes the wrappers off."""

    def __init__(self, pipe, device):
        self.seconds: dict[str, float] = {}
        self.wrapped = []
        for owner, method, label in ((pipe, "encode_prompt", "text_s"), (pipe, "_encode_vae_image", "vae_encode_s"),
                                     (pipe.vae, "decode", "vae_decode_s")):
            if hasattr(owner, method):
                self.wrapped.append((owner, method, owner.__dict__.get(method)))
                setattr(owner, method, self._timed(getattr(owner, method), label, device))

    def restore(self):
        for owner, method, own in self.wrapped:
            if own is None:
                delattr(owner, method)
            else:
                setattr(owner, method, own)

    def _timed(self, fn, label, device):
        def timed(*args, **kwargs):
            sync(device)
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            sync(device)
            self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - start
            return out

        return timed


def call(pipe, kwargs: dict, steps: int, device) -> tuple[float, dict, torch.Tensor, np.ndarray]:
    """One call: seconds, the timed parts, the latents after the last step, the image [H, W, 3] in [0, 1]."""
    seen = {}

    def keep(pipe, step, t, tensors):
        seen["latents"] = tensors["latents"].float().clone()
        return {}

    timings = Timings(pipe, device)
    sync(device)
    start = time.perf_counter()
    out = pipe(**kwargs, num_inference_steps=steps, output_type="np", callback_on_step_end=keep,
               generator=torch.Generator(device).manual_seed(0))
    sync(device)
    seconds = time.perf_counter() - start
    timings.restore()
    return seconds, timings.seconds, seen["latents"], out.images[0]


def cached_row(pipe, kwargs: dict, steps: int, run_steps: int, uncached: tuple, rule: str, device) -> dict:
    """Ours with FastConfig(cache=rule) against ours uncached (`uncached`: call()'s result), after a 3-step warm-up
    call; the pipeline's config is put back."""
    config = pipe.fast_config
    pipe.fast_config = config.replace(cache=rule)
    try:
        if device.type == "cuda":  # warm-up (none on the CPU: no graph to capture)
            call(pipe, kwargs, 3, device)
        seconds, parts, latents, image = call(pipe, kwargs, steps, device)
        decisions = {name: "".join("C" if c else "-" for c, _ in branch.decisions)
                     for name, branch in pipe._last_step_cache.branches.items()}
        line = dict(impl="ours", cache=pipe.fast_config.cache.label(), steps=steps, steps_run=run_steps,
                    s_per_image=seconds, ms_per_step=1000 * (seconds - sum(parts.values())) / run_steps,
                    rel_rms_vs_uncached=rel_rms_error(latents, uncached[2]), psnr_vs_uncached=psnr(image, uncached[3]),
                    speedup_vs_uncached=uncached[0] / seconds, blocks_run=pipe.blocks_computed,
                    decisions=decisions, applied=pipe.applied, **parts)
    finally:
        pipe.fast_config = config
    print(f"  cache {line['cache']}: {seconds:7.2f} s  {line['ms_per_step']:7.1f} ms/step  "
          f"x{line['speedup_vs_uncached']:.2f} vs uncached  blocks run {line['blocks_run']:.3f}  rel-RMS "
          f"{line['rel_rms_vs_uncached']:.3f}  PSNR {line['psnr_vs_uncached']:.1f} dB  {decisions}", flush=True)
    return line


def graph_rows(fast, size: int, device) -> list[dict]:
    """The fast transformer at edit1's shapes, eager vs graphed (the runner's policy: the second forward of a
    signature captured), B=1 vs B=2 (cond + uncond, the shorter text padded and masked), ms per image-forward."""
    from qwen_image_fast.pipelines.core.optimizations import CallRecord
    from qwen_image_fast.pipelines.core.runtime.runner import Runner

    transformer, side = fast.transformer, size // 16
    g = torch.Generator(device).manual_seed(1)

    def inputs(batch):
        mask = torch.ones(batch, 260, dtype=torch.long, device=device)
        mask[1:, 230:] = 0  # the negative prompt is shorter
        return dict(hidden_states=torch.randn(batch, 2 * side * side, 64, device=device, generator=g,
                                              dtype=torch.bfloat16),
                    encoder_hidden_states=torch.randn(batch, 260, 3584, device=device, generator=g,
                                                      dtype=torch.bfloat16),
                    encoder_hidden_states_mask=mask, timestep=torch.full((batch,), 0.5, device=device),
                    img_shapes=[[(1, side, side), (1, side, side)]] * batch, guidance=None,
                    controlnet_block_samples=None, additional_t_cond=None, modulation=None)

    rows = []
    with Runner().call(transformer, CallRecord(), graphs=True, pair_cfg=False, bucket=1) as run:
        for batch in (1, 2):
            x = inputs(batch)
            eager_out = transformer.compute(**x)
            run.forward("cond", **x)  # the signature's first forward: eager; the next captures
            graph_out = run.forward("cond", **x)
            err = rel_rms_error(graph_out, eager_out)
            assert err < 1e-2, f"graph replay vs eager: rel-RMS {err:.2e}"
            for mode, fn in (("eager", lambda: transformer.compute(**x)), ("graph", lambda: run.forward("cond", **x))):
                rows.append(dict(row="graphs", impl="ours", mode=mode, batch=batch,
                                 ms_per_image_forward=bench_ms(fn, 500, 3000) / batch, graph_vs_eager_rel_rms=err))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny random components on the CPU (logic check)")
    parser.add_argument("--rows", default="edit1,img2img,graphs", help="edit1, edit2, img2img, graphs")
    parser.add_argument("--tokenizer", type=Path, default=None, help="a Qwen2.5 BPE tokenizer folder")
    parser.add_argument("--cache", default=None, help="a step-cache rule (FastConfig.cache) to add rows of ours with")
    parser.add_argument("--fp8-attention", default="off", help="ours with FastConfig(fp8_attention=...): auto, cudnn, "
                        "fa3 (its rows gated by the option's bound)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from diffusers import QwenImageEditPlusPipeline, QwenImageImg2ImgPipeline

    device = torch.device("cpu" if args.tiny else "cuda")
    if args.tiny:  # condition images at 64x64 for the VAE, not 1024x1024 (minutes in Triton's interpreter)
        import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as edit_plus

        edit_plus.VAE_IMAGE_SIZE = 64 * 64
    components = tiny_components() if args.tiny else full_size_components(args.tokenizer)
    size, edit_steps, img2img_steps = (64, 2, 3) if args.tiny else (1024, 40, 50)
    stock = QwenImageEditPlusPipeline(**components)
    fast = optimize(QwenImageEditPlusPipeline(**components), FastConfig(fp8=not args.tiny,
                                                                         fp8_attention=args.fp8_attention))
    gate = GATE if args.fp8_attention == "off" else (BY_NAME["fp8_attention"].bound.full,
                                                      BY_NAME["fp8_attention"].bound.full_psnr_db)
    img2img_parts = {k: v for k, v in components.items() if k != "processor"}
    img2img_stock = QwenImageImg2ImgPipeline(**img2img_parts)
    img2img_fast = optimize(QwenImageImg2ImgPipeline(**img2img_parts | {"transformer": fast.transformer}),
                            fast.fast_config)
    for pipe in (stock, fast, img2img_stock, img2img_fast):
        pipe.set_progress_bar_config(disable=True)
    common = dict(prompt=EDIT_PROMPT, negative_prompt=NEGATIVE, true_cfg_scale=4.0, height=size, width=size)
    rows_wanted = args.rows.split(",")
    cases = {"edit1": (stock, fast, dict(image=[test_image(size, 1)]), edit_steps),
             "edit2": (stock, fast, dict(image=[test_image(size, 1), test_image(size, 2)]), edit_steps),
             "img2img": (img2img_stock, img2img_fast, dict(image=test_image(size, 1), strength=0.6), img2img_steps)}
    rows, env = [], {} if args.tiny else environment()
    print(f"{env.get('gpu', 'cpu')}  torch {torch.__version__}  attention {fast.transformer.attention_backend}",
          flush=True)
    for row in [r for r in rows_wanted if r in cases]:
        stock_pipe, fast_pipe, inputs, steps = cases[row]
        kwargs = common | inputs
        run_steps = int(steps * inputs.get("strength", 1.0))
        results = {}
        for impl, pipe in (("stock", stock_pipe), ("ours", fast_pipe)):
            if device.type == "cuda":  # warm-up: kernels compiled, allocator settled, graph captured
                call(pipe, kwargs, 3, device)
            results[impl] = call(pipe, kwargs, steps, device)
        ref_latents, ref_image = results["stock"][2], results["stock"][3]
        for impl in ("stock", "ours"):
            seconds, parts, latents, image = results[impl]
            err, db = rel_rms_error(latents, ref_latents), psnr(image, ref_image)
            denoise_s = seconds - sum(parts.values())
            line = dict(row=row, impl=impl, size=size, steps=steps, steps_run=run_steps,
                        condition_images=len(inputs["image"]) if row.startswith("edit") else 0, s_per_image=seconds,
                        ms_per_step=1000 * denoise_s / run_steps, latent_rel_rms=err, psnr_db=db,
                        applied=fast_pipe.applied if impl == "ours" else None, **parts)
            print(f"{row:8s} {impl:5s} {seconds:7.2f} s  {line['ms_per_step']:7.1f} ms/step  text "
                  f"{parts.get('text_s', 0):.2f} s  vae enc {parts.get('vae_encode_s', 0):.2f} s  dec "
                  f"{parts.get('vae_decode_s', 0):.2f} s  rel-RMS {err:.2e}  PSNR {db:.1f} dB", flush=True)
            if impl == "ours":
                if not (err <= gate[0] and db >= gate[1]):
                    print(f"  FAILED the gate {gate}: not recorded", flush=True)
                    continue
                line["speedup_vs_stock"] = results["stock"][0] / seconds
                print(f"{row}: {line['speedup_vs_stock']:.2f}x end to end", flush=True)
            rows.append(line)
        if args.cache and "speedup_vs_stock" in rows[-1]:
            rows.append(cached_row(fast_pipe, kwargs, steps, run_steps, results["ours"], args.cache, device)
                        | dict(row=row, size=size, condition_images=rows[-1]["condition_images"]))
    if "graphs" in rows_wanted and not args.tiny:
        for line in graph_rows(fast, size, device):
            print(f"graphs B={line['batch']} {line['mode']:5s} {line['ms_per_image_forward']:7.1f} ms per image-forward",
                  flush=True)
            rows.append(line)
    if not args.tiny:
        append_results("edit", [env | line for line in rows], args.out)


if __name__ == "__main__":
    main()
