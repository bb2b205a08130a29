"""One rank of a two-GPU parallel render (NCCL): `torchrun --nproc_per_node 2 tests/parallel_gpu_worker.py OUT MODE`,
MODE one of MODES. Both ranks build the same bf16 transformer at the real width (24 heads x 128, 4 blocks, FP8
linears) with the tiny text encoder and VAE, run CALLS one after another with CUDA graphs (other prompts, text
lengths, sizes and step counts; the last repeats the first, replaying its graphs two calls later), and rank 0 then
runs the same calls through a one-GPU pipeline of the same components and config without `parallel` (and without
batched CFG where CFG-parallel runs the branches apart). Rank 0 saves OUT/result.pt: each call's latents on both,
and what ran; test_parallel_gpu.py compares them."""

import gc
import os
import sys

import torch
import torch.distributed as dist
from diffusers import QwenImagePipeline

from qwen_image_fast import FastConfig, QwenImageFastPipeline, optimize
from qwen_image_fast.pipelines.tiny import tiny_pipeline

# the real head layout and width (num_layers: 60)
TRANSFORMER = dict(num_layers=4, num_attention_heads=24, attention_head_dim=128, axes_dims_rope=(16, 56, 56))
# CFG-parallel on cuDNN attention (no JIT compile in each process, as FlashAttention-4's); Ulysses on FlashAttention-4.
# Ulysses is bit-equal with FP8 linears: their rowwise _scaled_mm rows do not depend on the row count (test_fp8.py),
# and the BF16 GEMMs around the blocks run on all rows on every rank (runtime/parallel.py)
MODES = {
    "cfg": dict(parallel="cfg", attention="cudnn"),
    "ulysses": dict(parallel="ulysses", attention="fa4"),
    "cfg-fp8-attention": dict(parallel="cfg", attention="cudnn", fp8_attention="cudnn"),
    "cfg-step-cache": dict(parallel="cfg", attention="cudnn", cache="every:2,1,0"),
}
CALLS = [
    dict(prompt="a red fox asleep in fresh snow at dawn", negative_prompt="blurry", height=256, width=256,
         num_inference_steps=4),
    dict(prompt="a lighthouse on a cliff above a stormy sea, oil painting, dramatic light, seagulls, spray, "
                "dark clouds and a single beam of light cutting through the rain",
         negative_prompt="low quality, deformed, oversaturated", height=384, width=256, num_inference_steps=3),
    dict(prompt="a cat", negative_prompt="bad", height=256, width=384, num_inference_steps=5),
    dict(prompt="a blue kite over green hills", negative_prompt="blurry", height=256, width=256,
         num_inference_steps=4),
]


def run_calls(pipe) -> tuple[list[torch.Tensor], list[list[str]]]:
    latents, applied = [], []
    for seed, call in enumerate(CALLS):
        latents.append(pipe(**call, true_cfg_scale=4.0, output_type="latent",
                            generator=torch.Generator("cuda").manual_seed(seed)).images.cpu())
        applied.append(pipe.applied)
    return latents, applied


def main():
    out, mode = sys.argv[1], sys.argv[2]
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    components = tiny_pipeline(QwenImagePipeline, 0, TRANSFORMER).to("cuda", torch.bfloat16).components
    config = FastConfig(**MODES[mode])
    parallel = QwenImageFastPipeline(**components, fast_config=config)
    parallel.set_progress_bar_config(disable=True)
    got, applied = run_calls(parallel)
    graphs = len(parallel.runner.graphs)
    # graphs that captured NCCL collectives (Ulysses' all-to-alls) must go before the process group, else
    # destroy_process_group hangs in ncclCommDestroy (pytorch issue 115388; seen here on 2 x H200)
    del parallel
    gc.collect()
    if dist.get_rank() == 0:
        # CFG-parallel runs each branch as a batch-1 forward: one GPU does too without batched CFG (the same
        # kernels on the same shapes); Ulysses batches the branches on each rank, as one GPU does by default
        one = optimize(QwenImagePipeline(**components),
                       config.replace(parallel="none", batched_cfg=config.parallel != "cfg"))
        one.set_progress_bar_config(disable=True)
        want, one_applied = run_calls(one)
        torch.save(dict(got=got, want=want, applied=applied, one_applied=one_applied, graphs=graphs),
                   os.path.join(out, "result.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
