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
loop never has it reserved.

A tensor changed in place while on the device (fuse_lora folds adapters into FP8 weights with copy_) is copied back
to its host view before its turn ends: its _version counter moved. One whose storage was replaced is adopted if its
shape and dtype are unchanged.

Smaller weights used now and then (the modulation linears, while a table is built) come from the host one module at
a time (on_device).
"""

import contextlib
import functools

import torch
import torch.nn as nn

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


class HostArena:
    """`tensors` (parameters and buffers, by object), moved into one flat host buffer, each now a view of it."""

    def __init__(self, tensors: list[torch.Tensor], pin: bool):
        unique = list({id(t): t for t in tensors}.values())
        offsets, size = [], 0
        for t in unique:
            offsets.append(size)
            size += -(-nbytes(t) // ALIGN) * ALIGN
        self.nbytes = size
        self.host = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
        self.entries = []  # (tensor, offset, host view)
        for t, offset in zip(unique, offsets):
            view = self._view(self.host, offset, t)
            view.copy_(t.detach())
            t.data = view
            self.entries.append((t, offset, view))
        self._on_device: list[tuple[int, int]] | None = None  # per entry: (data_ptr, _version) while loaded
        self.overflow: torch.Tensor | None = None  # while loaded: the device copy of what the buffer could not hold

    @staticmethod
    def _view(buffer: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
        return buffer[offset:offset + nbytes(like)].view(like.dtype).view(like.shape)

    @property
    def loaded(self) -> bool:
        return self._on_device is not None

    def load(self, buffer: torch.Tensor):
        """Copy into the device buffer (uint8) and point every tensor at its view there; the tensors from the first
        that does not fit on go to a buffer of their own (self.overflow) until unload."""
        split = next((offset for t, offset, _ in self.entries if offset + nbytes(t) > buffer.numel()), self.nbytes)
        buffer[:split].copy_(self.host[:split], non_blocking=True)
        self.overflow = None
        if split < self.nbytes:
            self.overflow = torch.empty(self.nbytes - split, dtype=torch.uint8, device=buffer.device)
            self.overflow.copy_(self.host[split:], non_blocking=True)
        self._on_device = []
        for t, offset, _ in self.entries:
            t.data = (self._view(buffer, offset, t) if offset < split else
                      self._view(self.overflow, offset - split, t))
            self._on_device.append((t.data_ptr(), t._version))

    def unload(self):
        """Point every tensor back at its host view, first copying back those changed while loaded."""
        for (t, _, view), (ptr, version) in zip(self.entries, self._on_device):
            if t.data_ptr() != ptr:  # storage replaced while loaded
                if t.shape != view.shape or t.dtype != view.dtype:
                    raise RuntimeError(f"a weight of shape {tuple(view.shape)} {view.dtype} became "
                                       f"{tuple(t.shape)} {t.dtype} while on the device; memory='low' keeps "
                                       "weights at fixed places: reload the pipeline after changing the model")
                view.copy_(t.detach())
            elif t._version != version:
                view.copy_(t.detach())
            t.data = view
        self._on_device = None
        self.overflow = None


class TakingTurns:
    """Named HostArenas sharing one device buffer, allocated on first use, as large as arena `main`."""

    def __init__(self, arenas: dict[str, HostArena], device: torch.device, main: str):
        self.arenas, self.device, self.main = arenas, device, main
        self.buffer: torch.Tensor | None = None
        self.resident: str | None = None
        self.loads = 0  # how many turns began (each one a host-to-device copy of that arena)

    def use(self, name: str):
        """Make arena `name` the one on the device (nothing to do if it is already)."""
        if self.resident == name:
            return
        if self.buffer is None:
            self.buffer = torch.empty(self.arenas[self.main].nbytes, dtype=torch.uint8, device=self.device)
        if self.resident is not None:
            leaving = self.arenas[self.resident]
            overflowed = leaving.overflow is not None
            leaving.unload()
            if overflowed and self.device.type == "cuda":
                torch.cuda.empty_cache()  # the overflow buffer back to the driver, not kept reserved
        arena = self.arenas[name]
        if arena.nbytes > self.buffer.numel() and self.device.type == "cuda":
            # what the allocator keeps cached (the last call's activations and VAE decode) goes back first: the
            # overflow buffer comes on top of what is in use only (Qwen-Image-2.1's ~10 GiB of text encoder)
            torch.cuda.empty_cache()
        arena.load(self.buffer)
        self.resident = name
        self.loads += 1
