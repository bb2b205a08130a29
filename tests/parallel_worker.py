"""One rank of a parallel render of the tiny pipeline: `torchrun --nproc_per_node N tests/parallel_worker.py OUT
PARALLEL [--ulysses DEGREE] [--cache RULE ...] [--graphs]` (gloo on the CPU; RULE: a FastConfig.cache rule; --graphs:
CUDA graphs through the CPU stand-in of graph_stand_in.py, which also checks what the captured forwards read). Each
image group's first rank saves every case's latents and what ran to OUT/rank<R>.pt (with --cache, one pipeline per
rule, one after the other in the same processes: OUT/rank<R>-cache<I>.pt for the I-th rule); test_parallel.py
compares them with stock diffusers and the single-process fast pipeline."""

import argparse
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch.distributed as dist  # noqa: E402
from diffusers import QwenImagePipeline  # noqa: E402

from qwen_image_fast import FastConfig, optimize  # noqa: E402
from qwen_image_fast.pipelines.tiny import tiny_pipeline  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from graph_stand_in import install  # noqa: E402

# 4 heads so that 2 and 4 Ulysses ranks divide them; image token counts (VAE scale 4, 2x2 patches) 15, 35 and 16:
# 15 and 35 divide neither 4 nor 2
TRANSFORMER = {"num_attention_heads": 4}
CASES = [
    dict(prompt="a red fox asleep in fresh snow at dawn", negative_prompt="blurry", height=40, width=24),
    dict(prompt="a cat", negative_prompt="low quality, deformed hands, oversaturated, waxy skin",
         num_images_per_prompt=2, height=56, width=40),
    dict(prompt=["a cat", "a dog riding a skateboard down a hill"], negative_prompt="bad", height=32, width=32),
    # the first case's shapes again (text padded to the same bucket with graphs), other prompts and step count: with
    # --graphs it replays graphs captured two calls before
    dict(prompt="a lighthouse on a cliff in a storm", negative_prompt="ugly, blurry", height=40, width=24,
         num_inference_steps=3),
]
STEPS = 2


def render(pipe, case: dict, seed: int) -> torch.Tensor:
    return pipe(**{"num_inference_steps": STEPS} | case, true_cfg_scale=4.0, output_type="latent",
                generator=torch.Generator().manual_seed(seed)).images


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("parallel")
    parser.add_argument("--ulysses", type=int, default=0)
    parser.add_argument("--cache", action="append", help="a step cache rule; repeated: each in turn (one launch)")
    parser.add_argument("--graphs", action="store_true")
    args = parser.parse_args()
    graphs = install(setattr) if args.graphs else None
    dist.init_process_group("gloo")
    for i, cache in enumerate(args.cache or [None]):
        suffix = "" if args.cache is None else f"-cache{i}"
        render_all(args, cache, graphs, suffix)
    dist.destroy_process_group()


def render_all(args, cache: str | None, graphs, suffix: str):
    """Every case through a new fast pipeline with `cache`; the image group leader saves what it got."""
    pipe = optimize(tiny_pipeline(QwenImagePipeline, 0, TRANSFORMER),
                    FastConfig(fp8=False, cuda_graphs=args.graphs, parallel=args.parallel,
                               ulysses_degree=args.ulysses, cache=cache))
    pipe.set_progress_bar_config(disable=True)
    # the first forward's [B, L] rows: the BF16 GEMMs around the blocks take (all of them, under Ulysses too), and
    # the first block (this rank's part)
    rows = {}
    transformer = pipe.transformer
    for name, module in (("img_in", transformer.img_in), ("txt_in", transformer.txt_in),
                         ("proj_out", transformer.proj_out), ("block_img", transformer.transformer_blocks[0])):
        def recording(x, *args, _name=name, _forward=module.forward, **kwargs):
            rows.setdefault(_name, tuple(x.shape[:2]))
            if _name == "block_img":
                rows.setdefault("block_txt", tuple(args[0].shape[:2]))
            return _forward(x, *args, **kwargs)

        module.forward = recording
    results = {"latents": [], "applied": []}
    for seed, case in enumerate(CASES):
        results["latents"].append(render(pipe, case, seed))
        results["applied"].append(pipe.applied)
    if pipe.parallel.is_image_leader:
        torch.save(results | {"dp_rank": pipe.parallel.dp_rank, "rows": rows, "graphs": graphs},
                   os.path.join(args.out, f"rank{dist.get_rank()}{suffix}.pt"))


if __name__ == "__main__":
    main()
