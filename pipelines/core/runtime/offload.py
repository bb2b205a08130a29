"""Weights that live on the host and take turns on the device (FastConfig.memory="low").

The text encoder (a Qwen2.5-VL-7B: 15.5 GiB in BF16) and the fast transformer's block linears (12.7 GiB in FP8) do
not fit a 24 GiB GPU together, and a pipeline call never needs both at once: it encodes, then denoises. So each
set's tensors are moved into one flat host buffer (HostArena: pinned, so a transfer runs at the link's speed and
without blocking the host) and the sets take turns in one device buffer (TakingTurns):
bringing one in is a single host-to-device copy, sending the other out costs nothing (its tensors point back at
their host copies). Because the buffer never moves, a set comes back at the addresses it had, and CUDA graphs
captured over the transformer stay valid across turns.

The device buffer is sized for one set (the transformer's). A larger one (the text encoder, by ~1.5 GiB) puts what
does not fit into a buffer of its own for its turn, given back to the driver when the turn ends, so the denoising
loop never has it reserved. Under a memory budget (FastConfig(max_memory_gib=...)) the buffer is what the budget
leaves, and a set larger than that keeps as many of its layers on the device as fit and streams the others through
two slots at the buffer's end (streaming.py): the transformer's blocks and the text encoder's decoder layers.

A tensor changed in place while on the device (fuse_lora folds adapters into FP8 weights with copy_) is copied back
to its host view before its turn ends: its _version counter moved. One whose storage was replaced is adopted if its
shape and dtype are unchanged.

Smaller weights used now and then (the modulation linears, while a table is built) come from the host one module at
a time (on_device).
"""

import contextlib
import functools
import weakref

import torch
import torch.nn as nn

from .streaming import SLOTS, LayerStream, streamed_layers

ALIGN = 256  # bytes: every view starts aligned for vectorized loads and cuBLAS


@functools.cache
def step_cache_hook_names() -> frozenset[str]:
    """The names diffusers' step caches register their hooks under (diffusers/hooks/): they move no weights."""
    from diffusers.hooks import faster_cache, first_block_cache, mag_cache, pyramid_attention_broadcast, sea_cache
    from diffusers.hooks import taylorseer_cache

    return frozenset(value for module in (faster_cache, first_block_cache, mag_cache, pyramid_attention_broadcast,
                                          sea_cache, taylorseer_cache)
                     for name, value in vars(module).items() if name.endswith("_HOOK") and isinstance(value, str))


def has_offload_hooks(model: nn.Module) -> bool:
    """accelerate's (model / sequential CPU offload) or diffusers' (group offload, or any other but its step caches')
    hooks: they move weights between forwards (a captured graph would read stale addresses), and group offload with
    streams keeps its own host copies."""
    for module in model.modules():  # both set as plain instance attributes; vars() skips Module.__getattr__'s miss
        attributes = vars(module)
        registry = attributes.get("_diffusers_hook")
        if "_hf_hook" in attributes or (registry is not None and set(registry.hooks) - step_cache_hook_names()):
            return True
    return False


def tensors_of(module: nn.Module, recurse: bool = True) -> list[torch.Tensor]:
    """A module's parameters and buffers."""
    return [*module.parameters(recurse=recurse), *module.buffers(recurse=recurse)]


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@contextlib.contextmanager
def on_device(modules: list[nn.Module], device: torch.device):
    """Every parameter and buffer of `modules` not on `device` is put there (from pinned host memory, without
    blocking the host) for the duration, then pointed back at its host tensor; the device copies are freed."""
    moved = []
    for module in modules:
        for t in tensors_of(module):
            if t.device != device:
                moved.append((t, t.data))
                t.data = t.data.to(device, non_blocking=True)
    try:
        yield
    finally:
        for t, host in moved:
            t.data = host


def retire_arenas_holding(tensors: list[torch.Tensor]):
    """Before these tensors are placed again (a pipeline built from another one's components: from_pipe, or the same
    modules passed to a constructor): each HostArena holding one of them ends its turn (unload: they point at its
    host copy again, what changed on the device copied back) and is retired, so that the pipeline that placed them
    refuses to run instead of moving tensors another pipeline now places. Without this, a placement made while a
    streamed layer's tensors point at its slot would copy another layer's weights (the slot's last occupant)."""
    arenas = {}
    for t in tensors:
        ref = getattr(t, "_host_arena", None)
        if (arena := ref() if ref is not None else None) is not None and not arena.retired:
            arenas[id(arena)] = arena
    for arena in arenas.values():
        if arena.loaded:
            arena.unload()
        arena.retired = True


def retire_arenas_of(modules) -> None:
    """retire_arenas_holding for every tensor of these components (those that are not modules are skipped)."""
    retire_arenas_holding([t for m in modules if isinstance(m, nn.Module) for t in tensors_of(m)])


class HostArena:
    """`tensors` (parameters and buffers, by object), then each of `layers` (a list of tensors per layer), moved
    into one flat host buffer, each tensor now a view of it; a layer's tensors are contiguous there (layer_ranges),
    so that it can be streamed (streaming.py). A tensor is in one live arena at a time: an arena that held it before
    is retired first (retire_arenas_holding)."""

    def __init__(self, tensors: list[torch.Tensor], pin: bool, layers: list[list[torch.Tensor]] | None = None):
        groups = [tensors] + list(layers or ())
        retire_arenas_holding([t for group in groups for t in group])
        self.retired = False  # its tensors were placed again (retire_arenas_holding): it never loads again
        seen, placed, size = set(), [], 0  # placed: (tensor, offset, group)
        self.layer_ranges: list[tuple[int, int]] = []
        for g, group in enumerate(groups):
            size = -(-size // ALIGN) * ALIGN
            start = size
            for t in group:
                if id(t) in seen:
                    continue
                seen.add(id(t))
                placed.append((t, size, g - 1))
                size += -(-nbytes(t) // ALIGN) * ALIGN
            if g:
                self.layer_ranges.append((start, size))
        self.nbytes = size
        self.fixed_nbytes = self.layer_ranges[0][0] if self.layer_ranges else size  # the part that never streams
        self.layer_stride = max((stop - start for start, stop in self.layer_ranges), default=0)
        self.host = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
        self.entries = []  # (tensor, offset, host view, layer or -1)
        for t, offset, layer in placed:
            view = self._view(self.host, offset, t)
            view.copy_(t.detach())
            t.data = view
            t._host_arena = weakref.ref(self)
            self.entries.append((t, offset, view, layer))
        self._on_device: list[tuple[int, int]] | None = None  # per entry: (data_ptr, _version) while loaded
        self.overflow: torch.Tensor | None = None  # while loaded: the device copy of what the buffer could not hold
        self.stream: LayerStream | None = None  # while loaded with streamed layers
        self.streamed: tuple[int, ...] = ()

    @staticmethod
    def _view(buffer: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
        return buffer[offset:offset + nbytes(like)].view(like.dtype).view(like.shape)

    @property
    def loaded(self) -> bool:
        return self._on_device is not None

    def streaming_floor(self) -> int:
        """The smallest buffer (bytes) this arena can take its turn in by streaming: its fixed part and SLOTS layer
        slots (the whole arena if it has no layers)."""
        return self.fixed_nbytes + SLOTS * self.layer_stride if self.layer_ranges else self.nbytes

    def resident_layers(self, buffer_bytes: int) -> int:
        """How many of its layers stay on the device in a buffer of buffer_bytes (all of them if it fits; ValueError
        below streaming_floor)."""
        if self.nbytes <= buffer_bytes:
            return len(self.layer_ranges)
        if buffer_bytes < self.streaming_floor():
            raise ValueError(f"a buffer of {buffer_bytes} bytes cannot hold this arena's fixed part and {SLOTS} "
                             f"layer slots ({self.streaming_floor()} bytes)")
        return min(len(self.layer_ranges), (buffer_bytes - self.streaming_floor()) // self.layer_stride)

    def load(self, buffer: torch.Tensor, stream: bool = False):
        """Copy into the device buffer (uint8) and point every tensor at its view there. stream=False: the tensors
        from the first that does not fit on go to a buffer of their own (self.overflow) until unload. stream=True:
        the layers that do not fit are streamed (streaming.py) through slots at the buffer's end."""
        if stream and self.nbytes > buffer.numel():
            self._load_streamed(buffer)
            return
        split = next((offset for t, offset, _, _ in self.entries if offset + nbytes(t) > buffer.numel()), self.nbytes)
        buffer[:split].copy_(self.host[:split], non_blocking=True)
        self.overflow = None
        if split < self.nbytes:
            self.overflow = torch.empty(self.nbytes - split, dtype=torch.uint8, device=buffer.device)
            self.overflow.copy_(self.host[split:], non_blocking=True)
        self._on_device = []
        for t, offset, _, _ in self.entries:
            t.data = (self._view(buffer, offset, t) if offset < split else
                      self._view(self.overflow, offset - split, t))
            self._on_device.append((t.data_ptr(), t._version))

    def _load_streamed(self, buffer: torch.Tensor):
        """Device layout: [fixed part][resident layers, in order][SLOTS slots of layer_stride bytes]."""
        n = len(self.layer_ranges)
        self.streamed = streamed_layers(n, self.resident_layers(buffer.numel()))
        streamed = set(self.streamed)
        slot_base = self.fixed_nbytes + (n - len(streamed)) * self.layer_stride
        buffer[:self.fixed_nbytes].copy_(self.host[:self.fixed_nbytes], non_blocking=True)
        where, position, slot_of, copies = {}, self.fixed_nbytes, {}, {}  # where: layer -> its device offset
        for layer, (start, stop) in enumerate(self.layer_ranges):
            if layer in streamed:
                slot_of[layer] = len(slot_of) % SLOTS
                where[layer] = slot_base + slot_of[layer] * self.layer_stride
                copies[layer] = (buffer[where[layer]:where[layer] + stop - start], self.host[start:stop])
            else:
                where[layer] = position
                buffer[position:position + stop - start].copy_(self.host[start:stop], non_blocking=True)
                position += self.layer_stride
        self._on_device = []
        for t, offset, _, layer in self.entries:
            device_offset = offset if layer < 0 else where[layer] + offset - self.layer_ranges[layer][0]
            t.data = self._view(buffer, device_offset, t)
            self._on_device.append((t.data_ptr(), t._version))
        self.stream = LayerStream(copies, slot_of, buffer.device)

    def unload(self):
        """Point every tensor back at its host view, first copying back those changed while loaded (a streamed
        layer's cannot be: its slot holds another layer's bytes by then)."""
        streamed = set(self.streamed)
        for (t, _, view, layer), (ptr, version) in zip(self.entries, self._on_device):
            if t.data_ptr() != ptr:  # storage replaced while loaded
                if t.shape != view.shape or t.dtype != view.dtype:
                    raise RuntimeError(f"a weight of shape {tuple(view.shape)} {view.dtype} became "
                                       f"{tuple(t.shape)} {t.dtype} while on the device; memory='low' keeps "
                                       "weights at fixed places: reload the pipeline after changing the model")
                view.copy_(t.detach())
            elif t._version != version:
                if layer in streamed:
                    raise RuntimeError(f"a weight of streamed layer {layer} was changed in place while on the "
                                       "device, where it shares a slot with other layers: with a memory budget "
                                       "that streams layers (FastConfig(max_memory_gib=...)) the weights are read "
                                       "only; change them before building the pipeline")
                view.copy_(t.detach())
            t.data = view
        self._on_device = None
        self.overflow = None
        self.stream, self.streamed = None, ()


class TakingTurns:
    """Named HostArenas sharing one device buffer, allocated on first use: as large as arena `main` (an arena larger
    than that gets an overflow buffer for its turn), or buffer_bytes (a memory budget: an arena larger than that
    streams the layers that do not fit, streaming.py)."""

    def __init__(self, arenas: dict[str, HostArena], device: torch.device, main: str, buffer_bytes: int | None = None):
        self.arenas, self.device, self.main = arenas, device, main
        self.stream = buffer_bytes is not None
        self.buffer_bytes = arenas[main].nbytes if buffer_bytes is None else buffer_bytes
        if self.stream:  # ValueError if an arena cannot take its turn at all
            for arena in arenas.values():
                arena.resident_layers(self.buffer_bytes)
        self.buffer: torch.Tensor | None = None
        self.resident: str | None = None
        self.loads = 0  # how many turns began (each one a host-to-device copy of that arena)

    def streams(self, name: str) -> bool:
        """Whether arena `name` streams some of its layers in its turns (a budget's buffer is smaller than it)."""
        return self.stream and self.arenas[name].nbytes > self.buffer_bytes

    def use(self, name: str):
        """Make arena `name` the one on the device (nothing to do if it is already)."""
        arena = self.arenas[name]
        if arena.retired:
            raise RuntimeError(f"this pipeline's {name} weights were placed again by another pipeline built from the "
                               "same components (from_pipe, or its modules passed to a constructor), which moves "
                               "them now: use that pipeline, or build this one again")
        if self.resident == name:
            return
        if self.buffer is None:
            self.buffer = torch.empty(self.buffer_bytes, dtype=torch.uint8, device=self.device)
        if self.resident is not None and self.arenas[self.resident].loaded:  # (a retired one was unloaded then)
            leaving = self.arenas[self.resident]
            overflowed = leaving.overflow is not None
            leaving.unload()
            if overflowed and self.device.type == "cuda":
                torch.cuda.empty_cache()  # the overflow buffer back to the driver, not kept reserved
        arena = self.arenas[name]
        if arena.nbytes > self.buffer.numel() and not self.stream and self.device.type == "cuda":
            # what the allocator keeps cached (the last call's activations and VAE decode) goes back first: the
            # overflow buffer comes on top of what is in use only (Qwen-Image-2.1's ~10 GiB of text encoder)
            torch.cuda.empty_cache()
        arena.load(self.buffer, stream=self.stream)
        self.resident = name
        self.loads += 1
