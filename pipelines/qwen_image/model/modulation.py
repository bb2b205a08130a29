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
import torch.nn as nn
import torch.nn.functional as F

from ...core.runtime.context import forward_context
from ...core.runtime.offload import on_device, tensors_of


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

    DEFAULT_CAPACITY = 4

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
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

    def reset(self):
        """No tables kept, and the default capacity: a pipeline set up anew over the transformer builds its own (a
        memory budget's placement then keeps one: core/runtime/memory.py)."""
        self.clear()
        self.capacity = self.DEFAULT_CAPACITY


def tensor_key(t: torch.Tensor | None) -> tuple | None:
    """A table key part for a tensor's values (one host copy; the tables are built before the loop)."""
    if t is None:
        return None
    return tuple(t.shape), str(t.dtype), t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


class ModulationTable:
    """The transformer's modulation tables (mixed into FastQwenImageTransformer: its time_text_embed, norm_out and
    blocks' img_mod / txt_mod, zero_cond_t, lora_state and modulation_tables): what a forward's timestep makes of
    them, and a whole schedule's at once."""

    def modulation_layout(self, batch: int) -> ModulationLayout:
        return ModulationLayout(blocks=len(self.transformer_blocks), batch=batch,
                                img_rows=2 * batch if self.zero_cond_t else batch, dim=self.inner_dim)

    @property
    def inner_dim(self) -> int:
        return self.config.num_attention_heads * self.config.attention_head_dim

    def time_embedding(self, timestep: torch.Tensor, guidance: torch.Tensor | None, additional_t_cond,
                       dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The modulation inputs of a forward given `timestep` [B] (and guidance, additional_t_cond) in `dtype`:
        silu(temb) [G, D] and its timestep-t rows [B, D] (G = 2B with zero_cond_t: timestep t, then 0)."""
        timestep = timestep.to(dtype)
        if self.zero_cond_t:
            timestep = torch.cat([timestep, timestep * 0], dim=0)
        like = timestep.new_empty(0)  # QwenTimestepProjEmbeddings reads only its dtype
        if guidance is not None:
            guidance = guidance.to(dtype) * 1000
        temb = (
            self.time_text_embed(timestep, like, additional_t_cond)
            if guidance is None
            else self.time_text_embed(timestep, guidance, like, additional_t_cond)
        )  # [G, D]
        silu_temb = F.silu(temb)
        return silu_temb, silu_temb.chunk(2, dim=0)[0] if self.zero_cond_t else silu_temb

    def _modulation_modules(self) -> list[nn.Module]:
        return [self.time_text_embed, self.norm_out.linear] + [
            m for block in self.transformer_blocks for m in (block.img_mod, block.txt_mod)]

    @torch.no_grad()
    def modulation_table(self, timesteps: torch.Tensor, guidance: torch.Tensor | None = None, additional_t_cond=None,
                         lora_scale: float = 1.0) -> torch.Tensor:
        """[N, layout.size]: row n is the modulation of a forward given timestep=timesteps[n] ([N, B], on the
        model's device, exactly as passed to forward), guidance=guidance[n] (None or [N, B]), additional_t_cond and
        attention_kwargs={"scale": lora_scale}; pass it as forward(..., modulation=table[n]). Built one block at a
        time over every step's rows, each block's img_mod / txt_mod put on the model's device while it is used (they
        may live on the host: FastConfig.memory="low"). The last few tables are kept (modulation.py says what the key
        holds)."""
        device, dtype = self.device, self.dtype
        layout = self.modulation_layout(timesteps.shape[1])
        weights = tuple((t.data_ptr(), t._version) for m in self._modulation_modules() for t in tensors_of(m))
        key = (tensor_key(timesteps), tensor_key(guidance), tensor_key(additional_t_cond), self.zero_cond_t,
               str(dtype), str(device), self.lora_state.version, float(lora_scale), weights)

        def build() -> torch.Tensor:
            steps = timesteps.shape[0]
            table = torch.empty(steps, layout.size, dtype=dtype, device=device)
            with forward_context(lora_scale=float(lora_scale)):
                inputs = [self.time_embedding(timesteps[n], None if guidance is None else guidance[n],
                                              additional_t_cond, dtype) for n in range(steps)]
                silu_temb = torch.cat([rows for rows, _ in inputs])  # [N x G, D], step-major as the table
                silu_temb_t = torch.cat([rows for _, rows in inputs])  # [N x B, D]
                layout.out(table).copy_(self.norm_out.linear(silu_temb_t).view(steps, layout.batch, -1))
                for i, block in enumerate(self.transformer_blocks):
                    with on_device([block.img_mod, block.txt_mod], device):
                        img, txt = layout.block(table, i)  # [N, G, 6D], [N, B, 6D]
                        mods = block.modulation(silu_temb, silu_temb_t)
                        img.copy_(mods[0].view(img.shape))
                        txt.copy_(mods[1].view(txt.shape))
            return table

        return self.modulation_tables.get(key, build)
