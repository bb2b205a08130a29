"""FastConfig.memory="low": where a fast pipeline's components live (offload.py says how
weights take turns on the GPU).

- on the GPU: the VAE and the transformer's small parts (embedders, norm_out, proj_out; ~0.1 GiB);
- on the host, pinned: the modulation weights (img_mod / txt_mod, 12.7 GiB), read block by block while a modulation
  table is built (model/modulation.py);
- taking turns in one GPU buffer the size of the transformer's block linears: those, and the text encoder (its
  vision tower, which text-to-image never runs, stays on the host; what does not fit the buffer gets one of its own
  for its turn).
"""

import torch

from .offload import HostArena, TakingTurns, tensors_of

SMALL_TRANSFORMER_PARTS = ("time_text_embed", "txt_norm", "img_in", "txt_in", "norm_out", "proj_out")


def place_low_memory(pipe, device: torch.device) -> TakingTurns:
    """Put a text-to-image pipeline's components where memory="low" keeps them; returns the turns of the text
    encoder and the transformer's block linears (neither is on the GPU yet)."""
    transformer, text_encoder = pipe.transformer, pipe.text_encoder
    pin = device.type == "cuda"
    for name in SMALL_TRANSFORMER_PARTS:
        getattr(transformer, name).to(device)
    blocks, mods = [], []
    for block in transformer.transformer_blocks:
        blocks += tensors_of(block, recurse=False)  # the QK-norm weights
        for name, child in block.named_children():
            (mods if name in ("img_mod", "txt_mod") else blocks).extend(tensors_of(child))
    HostArena(mods, pin)  # host storage only: tables read it block by block
    vision = getattr(getattr(text_encoder, "model", None), "visual", None)
    if vision is not None:
        vision.to("cpu")
    skip = {id(t) for t in tensors_of(vision)} if vision is not None else set()
    encoder = [t for t in tensors_of(text_encoder) if id(t) not in skip]
    pipe.vae.to(device)
    turns = TakingTurns({"text_encoder": HostArena(encoder, pin), "transformer": HostArena(blocks, pin)}, device,
                        main="transformer")
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the block linears' device copies the arenas replaced
    return turns
