"""One rank of a parallel render of the tiny pipeline: `torchrun --nproc_per_node N tests/parallel_worker.py OUT
PARALLEL [ULYSSES_DEGREE [CACHE]]` (gloo on the CPU; CACHE: a FastConfig.cache rule). Each image group's first rank saves every case's latents and what ran
to OUT/rank<R>.pt; test_parallel.py compares them with the single-process fast pipeline."""

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

# 4 heads so that 2 and 4 Ulysses ranks divide them; image token counts (VAE scale 4, 2x2 patches) 15, 35 and 16:
# 15 and 35 divide neither 4 nor 2
TRANSFORMER = {"num_attention_heads": 4}
CASES = [
    dict(prompt="a red fox asleep in fresh snow at dawn", negative_prompt="blurry", height=40, width=24),
    dict(prompt="a cat", negative_prompt="low quality, deformed hands, oversaturated, waxy skin",
         num_images_per_prompt=2, height=56, width=40),
    dict(prompt=["a cat", "a dog riding a skateboard down a hill"], negative_prompt="bad", height=32, width=32),
]
STEPS = 2


def render(pipe, case: dict, seed: int) -> torch.Tensor:
    return pipe(**case, num_inference_steps=STEPS, true_cfg_scale=4.0, output_type="latent",
                generator=torch.Generator().manual_seed(seed)).images


def main():
    out, parallel = sys.argv[1], sys.argv[2]
    ulysses = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    cache = sys.argv[4] if len(sys.argv) > 4 else None
    dist.init_process_group("gloo")
    pipe = optimize(tiny_pipeline(QwenImagePipeline, 0, TRANSFORMER),
                    FastConfig(fp8=False, cuda_graphs=False, parallel=parallel, ulysses_degree=ulysses, cache=cache))
    pipe.set_progress_bar_config(disable=True)
    forwards, img_in = [], pipe.transformer.img_in.forward  # the rows this rank computes: batch, image tokens

    def recording(x):
        forwards.append(tuple(x.shape[:2]))
        return img_in(x)

    pipe.transformer.img_in.forward = recording
    results = {"latents": [], "applied": []}
    for seed, case in enumerate(CASES):
        results["latents"].append(render(pipe, case, seed))
        results["applied"].append(pipe.applied)
    if pipe.parallel.is_image_leader:
        torch.save(results | {"dp_rank": pipe.parallel.dp_rank, "forward": forwards[0]},
                   os.path.join(out, f"rank{dist.get_rank()}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
