"""FastConfig(memory="low") on Qwen-Image-2.1: where FastQwenImage21Pipeline keeps its components (core/runtime/
offload.py says how weights take turns on the GPU).

- on the GPU: the VAE and the transformer's parts outside its blocks (model.SHARED_MODULES: the embedders, the shared
  modulation projection, norm_out, proj_out; ~0.2 GiB at the real size);
- taking turns in one GPU buffer the size of the transformer's blocks (6.6 GiB of FP8 linears at the real size):
  those, and the whole text encoder (a Qwen3-VL-8B: ~16 GiB in BF16; its vision tower included, which reads
  condition images), whose part beyond the buffer gets one of its own for its turn, given back when it ends.
Encoding (diffusers' _get_qwen_prompt_embeds) brings the text encoder in; the transformer's forward brings its blocks
back (pipeline.py). The buffer never moves, so the cached steps' CUDA graphs stay valid across turns.
"""

import torch

from ..core.runtime.offload import HostArena, TakingTurns, tensors_of
from .model import SHARED_MODULES


def place_low_memory(pipe, device: torch.device) -> TakingTurns:
    """Put the pipeline's components where memory="low" keeps them; returns the turns of the text encoder and the
    transformer's blocks (neither is on the device yet)."""
    transformer, pin = pipe.transformer, device.type == "cuda"
    for name in SHARED_MODULES:
        getattr(transformer, name).to(device)
    blocks = [t for block in transformer.transformer_blocks for t in tensors_of(block)]
    pipe.vae.to(device)
    turns = TakingTurns({"text_encoder": HostArena(tensors_of(pipe.text_encoder), pin),
                         "transformer": HostArena(blocks, pin)}, device, main="transformer")
    if pin:
        torch.cuda.empty_cache()  # the device copies the arenas replaced
    return turns
