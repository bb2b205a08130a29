"""The modulation table: every block's img_mod / txt_mod output and norm_out's, for every step of a schedule.

The modulation vectors depend on nothing but the forward's `timestep` (and `guidance`, `additional_t_cond`, which a
call fixes), and the scheduler fixes the timesteps before the loop. So they can be computed once per schedule and
looked up per step: the forward then reads 60 x 2 x [G, 6D] vectors instead of 2 x 60 Linear(3072, 18432) weights
(12.7 GiB), which need not even be on the GPU (FastConfig.memory="low" keeps them on the host and streams them
block by block while a table is built: runtime/offload.on_device).

Each entry is the same computation on the same input as the forward's own: FastQwenImageTransformer.time_embedding
one step at a time, then FastBlock.modulation (and norm_out's linear) once per block on every step's rows [N x G, D],
one GEMM reading a block's modulation weights once for the schedule instead of once per step. A row's sums are the
forward's own, but their order may follow the row count (CPU fp32 and cuBLAS pick kernels by M), so a lookup equals
computing it to the dtype's last bits rather than bit for bit (tests/pipelines/test_modulation.py).

The table's key is everything those inputs depend on: the timesteps of every step (as the forward gets them, so the
batch too), guidance, additional_t_cond, zero_cond_t (the transformer's config), dtype, device, the LoRA adapters in
effect (lora_state.version and the call's scale) and the weights themselves (each modulation tensor's data_ptr and
_version counter, so a move or an in-place change builds anew).

One step's entry, flat: per block, img [G, 6D] then txt [B, 6D]; then norm_out [B, 2D]. B is the forward's batch, G
its image-modulation rows (2B with zero_cond_t: timestep t, then 0).
"""

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModulationLayout:
    blocks: int
    batch: int  # B
    img_rows: int  # G
    dim: int  # D

    @property
    def block_size(self) -> int:
        return (self.img_rows + self.batch) * 6 * self.dim

    @property
    def size(self) -> int:
        return self.blocks * self.block_size + self.batch * 2 * self.dim

    def block(self, step: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block i's (img [..., G, 6D], txt [..., B, 6D]) of one step's entry [size] (or of a table [N, size])."""
        start, split = i * self.block_size, self.img_rows * 6 * self.dim
        img = step[..., start:start + split].unflatten(-1, (self.img_rows, 6 * self.dim))
        txt = step[..., start + split:start + self.block_size].unflatten(-1, (self.batch, 6 * self.dim))
        return img, txt

    def out(self, step: torch.Tensor) -> torch.Tensor:
        """norm_out's [..., B, 2D] (scale, shift) of one step's entry [size] (or of a table [N, size])."""
        return step[..., self.blocks * self.block_size:].unflatten(-1, (self.batch, 2 * self.dim))


class ModulationTables:
    """The last `capacity` tables built, by key (least recently used dropped first)."""

    def __init__(self, capacity: int = 4):
        self.capacity = capacity
        self.tables: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self.built = 0  # how many tables were computed (not found): what a new schedule cost

    def get(self, key: tuple, build) -> torch.Tensor:
        if key in self.tables:
            self.tables.move_to_end(key)
            return self.tables[key]
        while len(self.tables) >= self.capacity:
            self.tables.popitem(last=False)
        table = self.tables[key] = build()
        self.built += 1
        return table

    def clear(self):
        self.tables.clear()


def tensor_key(t: torch.Tensor | None) -> tuple | None:
    """A table key part for a tensor's values (one host copy; the tables are built before the loop)."""
    if t is None:
        return None
    return tuple(t.shape), str(t.dtype), t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
