"""FastConfig(memory="low") on Qwen-Image-2.1: where FastQwenImage21Pipeline keeps its components (core/runtime/
offload.py says how weights take turns on the GPU).

- on the GPU: the VAE and the transformer's parts outside its blocks (model.SHARED_MODULES: the embedders, the shared
  modulation projection, norm_out, proj_out; ~0.2 GiB at the real size);
- taking turns in one GPU buffer the size of the transformer's blocks (6.6 GiB of FP8 linears at the real size):
  those, and the whole text encoder (a Qwen3-VL-8B: ~16 GiB in BF16; its vision tower included, which reads
  condition images), whose part beyond the buffer gets one of its own for its turn, given back when it ends.
Encoding (diffusers' _get_qwen_prompt_embeds) brings the text encoder in; the transformer's forward brings its blocks
back (pipeline.py). The buffer never moves, so the cached steps' CUDA graphs stay valid across turns.

With a budget (FastConfig(max_memory_gib=...)) the buffer is what the budget leaves (core/runtime/memory.py's
LowMemoryBudget) after a call's workspace as PLAN plans it, and what does not fit streams (core/runtime/streaming.py):
the text encoder's decoder layers (its embeddings, lm_head and vision tower stay in the fixed part) and the
transformer's blocks. The workspace is the larger of the denoising loop's (the prefix keys and values of both CFG
branches, at most PLANNED_TEXT_TOKENS of text, and the activations) and the VAE decode's: the prefix caches go back
before the decode (pipeline.py), so the two never meet.
"""

import torch

from ..core.model.vae_2d import why_not_2d
from ..core.runtime import memory as core
from ..core.runtime.memory import MemoryPlan
from ..core.runtime.offload import HostArena, TakingTurns, tensors_of
from .model import SHARED_MODULES

# A budget's plan: one text-to-image call of at most 1024x1024 pixels (the pipeline's default output_resolution) and
# 50 steps, its prompt at most PLANNED_TEXT_TOKENS tokens (the prefix; a condition image's tokens would lengthen it by
# as many as the target has).
PLAN = MemoryPlan(1024, 50, "about 20 GiB", condition_images=False)
PLANNED_TEXT_TOKENS = 1024
BRANCHES = 2  # CFG's cond and uncond passes each keep a prefix cache
# Measured on an H200 (benchmarks/RESULTS.md, "Qwen-Image-2.1", memory='low' at 1024^2): diffusers' RGBA VAE decode of
# one image allocates 6.6 GiB at its peak above what the call holds (6,758 bytes a pixel); planned with a quarter
# more for the allocator's fragmentation (at 7,000 a 16 GiB cap ran out of memory in the decode with 1.5 GiB reserved
# but unusable). The 2D decode (vae_2d_decode, vae.py) allocates 2.67 GiB there (2,738 bytes a pixel; bench_vae.py,
# and bench_qwen21.py --budgets' decode_peak_gib under a 16 GiB cap), planned with the same quarter more. And beside
# the prefix caches, a denoising step's activations, the graphs' pools and the allocator's fragmentation
# (ACTIVATION_BYTES_PER_TOKEN_WIDTH: per target token and transformer width, 2.5 GiB at 1024^2): a 16 GiB cap that
# left 1.0 GiB for them (64 bytes) ran out of memory capturing a CFG call's graphs with ~900-token prompts, 0.8 GiB
# allocated beside both branches' caches and 0.5 GiB reserved but unusable.
DECODE_BYTES_PER_PIXEL = 8400
DECODE_2D_BYTES_PER_PIXEL = 3500
ACTIVATION_BYTES_PER_TOKEN_WIDTH = 160


def planned_target_tokens(pipe) -> int:
    """The target image's tokens in a PLAN.side x PLAN.side call: 4,096 at 1024x1024 (a latent side of 64, as
    diffusers' prepare_latents rounds it, in patches of the transformer's patch_size, 1)."""
    latent_side = 2 * (PLAN.side // (pipe.vae_scale_factor * 2))
    return (latent_side // pipe.transformer.config.patch_size) ** 2


def workspace_bytes(pipe) -> int:
    """A planned call's needs beside the weights: max(the denoising loop's prefix caches (the target's tokens and
    the planned prompt, both CFG branches) and activations, the decode's: the 2D decode's where the VAE runs it,
    diffusers' otherwise; a tiled decode, stock's, holds one tile's activations at a time)."""
    transformer = pipe.transformer
    inner = transformer.config.num_attention_heads * transformer.config.attention_head_dim
    target = planned_target_tokens(pipe)
    keys = (BRANCHES * len(transformer.transformer_blocks) * 2 * (target + PLANNED_TEXT_TOKENS) * inner
            * transformer.dtype.itemsize)
    decode = DECODE_2D_BYTES_PER_PIXEL if why_not_2d(pipe.vae) is None else DECODE_BYTES_PER_PIXEL
    return max(keys + ACTIVATION_BYTES_PER_TOKEN_WIDTH * target * inner, decode * PLAN.side ** 2)


def place_low_memory(pipe, device: torch.device, max_memory_gib: float | None = None) -> TakingTurns:
    """Put the pipeline's components where memory="low" keeps them; returns the turns of the text encoder and the
    transformer's blocks (neither is on the device yet). max_memory_gib: the budget the buffer is planned in."""
    transformer, pin = pipe.transformer, device.type == "cuda"
    for name in SHARED_MODULES:
        getattr(transformer, name).to(device)
    blocks = [tensors_of(block) for block in transformer.transformer_blocks]
    text, decoder = core.text_encoder_arena(pipe.text_encoder, pin, keep_vision=True)  # it reads condition images
    pipe.vae.to(device)
    arenas = {"text_encoder": text, "transformer": HostArena([], pin, blocks)}
    if pin:
        torch.cuda.empty_cache()  # the device copies the arenas replaced
    buffer = None
    if max_memory_gib is not None:
        buffer = core.budget_buffer(
            max_memory_gib, device, core.placed_bytes(pipe, SHARED_MODULES), workspace_bytes(pipe), arenas,
            workspace_of=f"one {PLAN.side}x{PLAN.side} image's prefix caches (both CFG branches, a prompt of at most "
                         f"{PLANNED_TEXT_TOKENS} tokens) and activations, or its decode")
        transformer.planned_prefix = PLANNED_TEXT_TOKENS
    return core.turns_of(arenas, device, buffer, transformer, decoder)
