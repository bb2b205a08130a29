"""One rank of parallel renders of the tiny pipeline: `torchrun --nproc_per_node N tests/parallel_worker.py OUT RUN
[RUN ...] [--graphs]` (gloo on the CPU), RUN = PARALLEL[/ULYSSES[/CACHE]] (FastConfig's parallel, ulysses_degree and
cache rule), each run a new fast pipeline, one after the other in the same processes (one launch's startup for
several configurations); --graphs: CUDA graphs through the CPU stand-in of graph_stand_in.py, which also checks what
the captured forwards read (its log begun anew for each run). Each image group's first rank saves every case's
latents and what ran to OUT/rank<R>-run<I>.pt for the I-th run; test_parallel.py compares them with stock diffusers
and the single-process fast pipeline."""

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
    parser.add_argument("runs", nargs="+", help="PARALLEL[/ULYSSES[/CACHE]], each in turn")
    parser.add_argument("--graphs", action="store_true")
    args = parser.parse_args()
    graphs = install(setattr) if args.graphs else None
    dist.init_process_group("gloo")
    for i, run in enumerate(args.runs):
        parallel, ulysses, cache = (run.split("/", 2) + [None, None])[:3]
        if graphs is not None:
            for entries in (graphs["captures"], graphs["replays"], graphs["unowned"]):
                entries.clear()
        config = FastConfig(fp8=False, cuda_graphs=args.graphs, parallel=parallel, ulysses_degree=int(ulysses or 0),
                            cache=cache)
        render_all(config, graphs, os.path.join(args.out, f"rank{dist.get_rank()}-run{i}.pt"))
    dist.destroy_process_group()


def render_all(config: FastConfig, graphs, path: str):
    """Every case through a new fast pipeline with `config`; the image group leader saves what it got to `path`."""
    pipe = optimize(tiny_pipeline(QwenImagePipeline, 0, TRANSFORMER), config)
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
        torch.save(results | {"dp_rank": pipe.parallel.dp_rank, "rows": rows, "graphs": graphs}, path)


if __name__ == "__main__":
    main()
