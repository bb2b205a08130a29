"""FastConfig.memory="low": where a fast pipeline's components live (offload.py says how
weights take turns on the GPU).

- on the GPU: the VAE and the transformer's small parts (embedders, norm_out, proj_out; ~0.1 GiB);
- on the host, pinned: the modulation weights (img_mod / txt_mod, 12.7 GiB), read block by block while a modulation
  table is built (model/modulation.py);
- taking turns in one GPU buffer the size of the transformer's block linears: those, and the text encoder (its
  vision tower, which text-to-image never runs, stays on the host; what does not fit the buffer gets one of its own
  for its turn).

With a budget (FastConfig(max_memory_gib=...)) the buffer is what the budget leaves (LowMemoryBudget), and the
transformer's blocks and the text encoder's decoder layers that do not fit it stream (streaming.py).
"""

import weakref
from dataclasses import dataclass

import torch
import torch.nn as nn

from .offload import HostArena, TakingTurns, nbytes, tensors_of

SMALL_TRANSFORMER_PARTS = ("time_text_embed", "txt_norm", "img_in", "txt_in", "norm_out", "proj_out")
GIB = 2**30
# What a call needs beside the weights, planned for one image a call (CFG batched) of the official size with the most
# tokens (1328x1328), 50 steps: activations, the graphs' pools and the VAE decode, per image token and transformer
# width (measured on an H200 at 1024^2, 3 steps: 3.0 GiB reserved above the weights = 258 bytes per token x width),
# and one modulation table of PLANNED_STEPS steps (a budget keeps one: 0.43 GiB at the real width).
WORKSPACE_BYTES_PER_TOKEN_WIDTH = 260
PLANNED_SIDE = 1328
PLANNED_STEPS = 50
CONTEXT_GROWTH = GIB // 4  # the CUDA context grows after the plan as kernels load (cuBLAS, FlashAttention, Triton)


@dataclass(frozen=True)
class MemoryPlan:
    """What a family's budget is planned for: one image a call of at most side x side pixels and `steps` steps;
    `alone`: what its memory='low' needs without a budget (the error's advice); condition_images: whether a call
    may have them (Qwen-Image-2.1's plan leaves them out: they lengthen the prefix its keys and values are kept for)."""

    side: int
    steps: int
    alone: str
    condition_images: bool = True


PLAN = MemoryPlan(PLANNED_SIDE, PLANNED_STEPS, "about 22 GiB")  # the 2512 text-to-image pipeline's


@dataclass(frozen=True)
class LowMemoryBudget:
    """Where a budget of `budget` bytes goes: the CUDA context, the weights always on the GPU, a call's workspace
    (`workspace_of` says what it holds, for the error); the rest is the turn-taking buffer (at most what the largest
    arena needs)."""

    budget: int
    context: int
    placed: int
    workspace: int
    floor: int  # the smallest buffer every arena can take its turn in (fixed part + 2 streaming slots)
    workspace_of: str = f"one {PLANNED_SIDE}x{PLANNED_SIDE} image's activations, decode and modulation table"

    @property
    def buffer(self) -> int:
        return self.budget - self.context - self.placed - self.workspace

    def check(self):
        if self.buffer < self.floor:
            smallest = (self.context + self.placed + self.workspace + self.floor) / GIB
            raise ValueError(
                f"max_memory_gib={self.budget / GIB:g} is too small for this pipeline: it needs at least "
                f"{smallest:.2f} GiB (CUDA context {self.context / GIB:.2f}, VAE and transformer parts on the GPU "
                f"{self.placed / GIB:.2f}, {self.workspace_of} {self.workspace / GIB:.2f}, the smallest "
                f"turn-taking buffer {self.floor / GIB:.2f}: "
                f"a set of weights' parts outside its layers and 2 layer slots)")


def check_within_plan(max_memory_gib: float, images: int, height: int | None, width: int | None, steps: int,
                      plan: MemoryPlan = PLAN, condition_images: int = 0):
    """A call with a budget must stay inside what the budget was planned for (`plan`: one image, at most
    plan.side^2 pixels, at most plan.steps steps, condition images only where the plan has them): its workspace
    would otherwise go past the budget, or past a cap. A size of None: the pipeline's default (1024x1024), inside
    the plan."""
    area = (height or 0) * (width or 0)
    if images > 1 or area > plan.side ** 2 or steps > plan.steps:
        size = f"{width}x{height}" if area else "the default size"
        raise ValueError(
            f"FastConfig(max_memory_gib={max_memory_gib:g}) is planned for one image a call of at most "
            f"{plan.side}x{plan.side} pixels and {plan.steps} steps; this call has {images} image(s) of "
            f"{size} and {steps} steps: call once per image (the command line does), or leave max_memory_gib out "
            f"(memory='low' alone needs {plan.alone})")
    if condition_images and not plan.condition_images:
        raise ValueError(
            f"FastConfig(max_memory_gib={max_memory_gib:g}) is planned for text-to-image calls; this call has "
            f"{condition_images} condition image(s), whose tokens lengthen the prefix past the plan: leave "
            f"max_memory_gib out (memory='low' alone needs {plan.alone})")


def placed_bytes(pipe, parts: tuple[str, ...] = SMALL_TRANSFORMER_PARTS) -> int:
    """The weights memory='low' keeps on the GPU: the VAE and the transformer's `parts` (its modules outside the
    blocks)."""
    modules = [pipe.vae] + [getattr(pipe.transformer, name) for name in parts]
    return sum(nbytes(t) for module in modules for t in tensors_of(module))


def workspace_bytes(pipe) -> int:
    """A planned call's needs beside the weights (WORKSPACE_BYTES_PER_TOKEN_WIDTH): its activations, pools and
    decode, and its modulation table."""
    transformer = pipe.transformer
    tokens = (PLANNED_SIDE // (pipe.vae_scale_factor * 2)) ** 2
    table = PLANNED_STEPS * transformer.modulation_layout(2).size * transformer.dtype.itemsize
    return WORKSPACE_BYTES_PER_TOKEN_WIDTH * tokens * transformer.inner_dim + table


def context_bytes(device: torch.device) -> int:
    """The CUDA context (and anything else outside this process's allocator) on `device`, with room to grow."""
    if device.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(device)
    return total - free - torch.cuda.memory_reserved(device) + CONTEXT_GROWTH


def text_encoder_layers(text_encoder: nn.Module, skip: set[int]) -> tuple[nn.Module, nn.ModuleList] | None:
    """(the decoder, its ModuleList of layers) of a transformers text model, none of whose tensors are in `skip`
    (the vision tower's, by id)."""
    for module in text_encoder.modules():
        layers = getattr(module, "layers", None)
        if isinstance(layers, nn.ModuleList) and len(layers) and not any(id(t) in skip for t in tensors_of(layers)):
            return module, layers
    return None


def stream_text_encoder(decoder: nn.Module, layers: nn.ModuleList, arena: HostArena):
    """Hooks running the arena's streamed layers (when its turn streams) around the decoder's forward, replacing
    those of an earlier placement of the same text encoder. They hold the arena weakly: a pipeline dropped does not
    keep its device buffer alive through its text encoder."""
    for handle in getattr(decoder, "_streaming_hooks", ()):
        handle.remove()
    arena_ref = weakref.ref(arena)

    def stream():
        live = arena_ref()
        return live.stream if live is not None else None

    def begin(module, args):
        if (live := stream()) is not None:
            live.begin(0, len(layers))

    def end(module, args, output):
        if (live := stream()) is not None:
            live.end()

    def before(i):
        if (live := stream()) is not None:
            live.before(i)

    decoder._streaming_hooks = [decoder.register_forward_pre_hook(begin), decoder.register_forward_hook(end)] + [
        layer.register_forward_pre_hook(lambda module, args, i=i: before(i)) for i, layer in enumerate(layers)]


def text_encoder_arena(text_encoder: nn.Module, pin: bool, keep_vision: bool) -> tuple[HostArena, tuple | None]:
    """(the text encoder's HostArena, (its decoder, its layers) for stream_text_encoder or None): the decoder layers
    are the arena's layers (streamed under a budget), the rest its fixed part. The vision tower is in the fixed part
    with keep_vision (Qwen-Image-2.1's encoder reads condition images), else left on the host, out of the arena (the
    2512 text-to-image pipeline never runs it)."""
    vision = getattr(getattr(text_encoder, "model", None), "visual", None)
    if vision is not None and not keep_vision:
        vision.to("cpu")
    skip = {id(t) for t in tensors_of(vision)} if vision is not None else set()
    decoder = text_encoder_layers(text_encoder, skip)
    left_out = ({id(t) for t in tensors_of(decoder[1])} if decoder else set()) | (set() if keep_vision else skip)
    fixed = [t for t in tensors_of(text_encoder) if id(t) not in left_out]
    return HostArena(fixed, pin, [tensors_of(layer) for layer in decoder[1]] if decoder else []), decoder


def budget_buffer(max_memory_gib: float, device: torch.device, placed: int, workspace: int,
                  arenas: dict[str, HostArena], workspace_of: str | None = None) -> int:
    """The turn-taking buffer's bytes under a budget (LowMemoryBudget; ValueError below its floor): what the budget
    leaves, at most what the largest arena needs."""
    budget = LowMemoryBudget(budget=int(max_memory_gib * GIB), context=context_bytes(device), placed=placed,
                             workspace=workspace, floor=max(arena.streaming_floor() for arena in arenas.values()),
                             **({"workspace_of": workspace_of} if workspace_of else {}))
    budget.check()
    return min(budget.buffer, max(arena.nbytes for arena in arenas.values()))


def turns_of(arenas: dict[str, HostArena], device: torch.device, buffer_bytes: int | None, transformer,
             decoder: tuple | None) -> TakingTurns:
    """The text encoder's and the transformer's blocks' turns in one buffer (buffer_bytes: a budget's, or None),
    the transformer told its blocks' arena and the text encoder's layers hooked to stream with it."""
    turns = TakingTurns(arenas, device, main="transformer", buffer_bytes=buffer_bytes)
    transformer.block_arena = arenas["transformer"]
    if decoder is not None:
        stream_text_encoder(*decoder, arenas["text_encoder"])
    return turns


def place_low_memory(pipe, device: torch.device, max_memory_gib: float | None = None) -> TakingTurns:
    """Put a text-to-image pipeline's components where memory="low" keeps them; returns the turns of the text
    encoder and the transformer's block linears (neither is on the GPU yet). max_memory_gib: the budget (PyTorch's
    reserved memory and the CUDA context) the turn-taking buffer is planned in; what does not fit it streams."""
    transformer = pipe.transformer
    pin = device.type == "cuda"
    for name in SMALL_TRANSFORMER_PARTS:
        getattr(transformer, name).to(device)
    blocks, mods = [], []
    for block in transformer.transformer_blocks:
        layer = list(tensors_of(block, recurse=False))  # the QK-norm weights
        for name, child in block.named_children():
            (mods if name in ("img_mod", "txt_mod") else layer).extend(tensors_of(child))
        blocks.append(layer)
    HostArena(mods, pin)  # host storage only: tables read it block by block
    text, decoder = text_encoder_arena(pipe.text_encoder, pin, keep_vision=False)
    pipe.vae.to(device)
    arenas = {"text_encoder": text, "transformer": HostArena([], pin, blocks)}
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the block linears' device copies the arenas replaced
    buffer = None
    if max_memory_gib is not None:
        buffer = budget_buffer(max_memory_gib, device, placed_bytes(pipe), workspace_bytes(pipe), arenas)
        transformer.modulation_tables.capacity = 1  # the plan's one table
    return turns_of(arenas, device, buffer, transformer, decoder)
