"""diffusers' FasterCacheConfig(is_guidance_distilled=True) (diffusers/hooks/faster_cache.py) run by the fast
pipeline's call instead of its hooks (model/step_caches.py says when): the same decisions, the same arithmetic.

With is_guidance_distilled=True diffusers applies FasterCache's attention reuse only: every block's attention module
(the spatial identifiers match `transformer_blocks.<i>.attn`) keeps one state, not one per cache_context, a counter
of the forwards it has seen (cond and uncond alike) and its last two outputs [t-2, t-1]. Inside
`spatial_attention_timestep_skip_range` (exclusive bounds, the pipeline's current timestep) a forward computes the
attention when its iteration is > 0 and a multiple of `spatial_attention_block_skip_range`, and otherwise
approximates it from the two last outputs, whichever branch left them: o = t1 + (t1 - t2) * w, w the config's
attention_weight_callback(module) (diffusers' default 0.5); outside the range it computes. Computed or approximated,
the output becomes the newest of the two. Every module counts the same forwards, so a forward decides once per
branch. With CFG as two forwards (cond, then uncond) and the default skip range of 2, inside the range the cond
forward computes and the uncond forward extrapolates from the cond's output of the same step and its own last one.

In a paired CFG forward the branches go in diffusers' order (cond, then uncond): each block computes the attention
for the rows of the branches that compute, approximates the others from what the branch before left, and a block
whose branches all approximate skips what only attention reads. The two outputs live in two slots per block and
stream that the runner keeps per forward shape, indexed by the iteration's parity (slot i % 2 holds the output of
iteration i, and is t-2 for iteration i + 2), so each pattern of decisions and parities is one CUDA graph and nothing
is copied to age an output; the weights are an input of the graph. As on stock, the texts whose outputs a forward
combines must have one length (stock fails otherwise; so does this, before pairing).
"""

from dataclasses import dataclass, field

import torch

from .cuda_graph import read_by_graph


@dataclass(frozen=True)
class FasterCacheRule:
    """A FasterCacheConfig with is_guidance_distilled=True and spatial attention only (what matches Qwen-Image's
    blocks)."""

    block_skip_range: int
    timestep_skip_range: tuple
    weight: object  # the config's attention_weight_callback(module) -> float
    current_timestep: object  # the config's current_timestep_callback

    kind = "faster_cache"  # optimizations.Facts.cache_rule

    def label(self) -> str:
        return "FasterCacheConfig"

    def computes(self, iteration: int, timestep) -> bool:
        """FasterCacheBlockHook.new_forward's decision (is_guidance_distilled: no batch-size condition)."""
        if not self.timestep_skip_range[0] < timestep < self.timestep_skip_range[1]:
            return True
        return iteration > 0 and iteration % self.block_skip_range == 0


@dataclass
class Branch:
    decisions: list = field(default_factory=list)  # per forward: computed (True) or approximated


class Slots:
    """Per block and stream the outputs of the last two iterations: [(i, stream)] -> [slot 0, slot 1], each
    [B, L, D] (B the rows of one branch); slot i % 2 holds iteration i's."""

    def __init__(self):
        self.tensors: dict[tuple[int, str], list[torch.Tensor]] = {}


@dataclass
class BlockCache:
    """What one block of a forward does with its attention (FastBlock.forward reads it)."""

    slots: Slots
    index: int
    decisions: tuple  # per branch of the forward, in diffusers' order: (computes, iteration parity)
    first: bool  # the state holds no output yet (the first branch computes and fills both slots)
    weights: torch.Tensor | None  # [branches, blocks]: each approximating branch's weight for this block

    @property
    def reads_no_inputs(self) -> bool:
        return not any(computes for computes, _ in self.decisions)

    def outputs(self, attend, batch: int, text_out: bool) -> tuple:
        """(img, txt) attention outputs of the forward's `batch` rows (txt None when not text_out); attend(rows)
        computes those of the batch rows `rows` (a slice)."""
        n, rows = len(self.decisions), batch // len(self.decisions)
        streams = ("img", "txt") if text_out else ("img",)
        computed = attend(slice(None)) if all(c for c, _ in self.decisions) else None
        parts = []
        for k, (computes, parity) in enumerate(self.decisions):
            part = slice(k * rows, (k + 1) * rows)
            if computed is not None:
                value = tuple(None if o is None else o[part] for o in computed)
            elif computes:
                value = attend(part)
            else:
                value = tuple(self._approximate(stream, parity, self.weights[k, self.index]) for stream in streams)
            for stream, tensor in zip(streams, value):
                self._keep(stream, parity, tensor, fill_both=self.first and k == 0)
            parts.append(value if text_out else (value[0], None))
        if computed is not None:
            return computed
        return parts[0] if n == 1 else tuple(None if parts[0][j] is None else torch.cat([p[j] for p in parts])
                                             for j in range(2))

    def _approximate(self, stream: str, parity: int, weight: torch.Tensor) -> torch.Tensor:
        """FasterCacheBlockHook._compute_approximated_attention_output: t1 + (t1 - t2) * w."""
        slots = self.slots.tensors[(self.index, stream)]
        read_by_graph(*slots)  # the runner's buffers, which a graph of this forward reads
        t2, t1 = slots[parity], slots[1 - parity]
        return t1 + (t1 - t2) * weight

    def _keep(self, stream: str, parity: int, tensor: torch.Tensor, fill_both: bool):
        slots = self.slots.tensors.get((self.index, stream))
        if slots is None or slots[0].shape != tensor.shape:  # first forward of a shape: eager
            self.slots.tensors[(self.index, stream)] = slots = [torch.empty_like(tensor), torch.empty_like(tensor)]
        read_by_graph(*slots)  # the runner's buffers, which a graph of this forward writes
        for p in ((0, 1) if fill_both else (parity,)):
            slots[p].copy_(tensor)


class FasterCacheRun:
    """FasterCache in one pipeline call: the shared counter (diffusers' per-module state, equal in every module) and
    the per-branch decisions; the slots are the runner's."""

    def __init__(self, rule: FasterCacheRule, buffers: dict, attention_modules: list):
        self.rule, self.buffers, self.modules = rule, buffers, attention_modules
        self.iteration = 0
        self.held = [None, None]  # per slot: (text length, key) of the output it holds
        self.branches: dict[str, Branch] = {}

    def forward(self, run, inputs: dict, names: list[str], key: tuple, text_lengths: tuple):
        """One forward of `names`' branches (key: the shape of one branch's rows, which share the slots;
        text_lengths: each branch's prompt length before any padding). run(variant, scalars, block_cache) runs the
        whole forward with block_cache(i, scalars) telling block i what to do (scalars: the weights). Returns
        (output, per branch whether it computed)."""
        timestep = self.rule.current_timestep()
        first, decisions, weights = self.held[0] is None, [], []
        for name, length in zip(names, text_lengths * len(names) if len(text_lengths) == 1 else text_lengths):
            computes, parity = self.rule.computes(self.iteration, timestep), self.iteration % 2
            if not computes:
                if self.held[0] is None:
                    raise ValueError("FasterCacheConfig approximates the attention at its first forward, with no "
                                     "output to start from (the timestep is inside spatial_attention_timestep_skip_"
                                     f"range {self.rule.timestep_skip_range} at the first step); stock diffusers "
                                     "fails here too: widen the range's lower bound past the first timestep")
                if {self.held[0], self.held[1]} != {(length, key)}:
                    raise ValueError(
                        "FasterCacheConfig keeps one state for cond and uncond (as diffusers does): a forward of "
                        f"{length} text tokens cannot extrapolate from outputs of {self.held[0][0]} and "
                        f"{self.held[1][0]}; give the prompt and the negative prompt the same length (stock diffusers "
                        "fails here too)")
            self.held[parity] = (length, key)
            if self.held[1 - parity] is None:  # the first output fills both
                self.held[1 - parity] = (length, key)
            self.iteration += 1
            self.branches.setdefault(name, Branch()).decisions.append(computes)
            decisions.append((computes, parity))
            weights.append([float(self.rule.weight(m)) if not computes else 0.0 for m in self.modules])
        slots = self.buffers.setdefault(key, Slots())
        device = inputs["hidden_states"].device
        scalars = None if all(c for c, _ in decisions) else torch.tensor(weights, device=device)
        decisions = tuple(decisions)
        out = run(decisions + (first,), scalars,
                  lambda i, scalars: BlockCache(slots, i, decisions, first, scalars))
        return out, [c for c, _ in decisions]
