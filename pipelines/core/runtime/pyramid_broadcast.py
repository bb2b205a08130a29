"""diffusers' PyramidAttentionBroadcastConfig (diffusers/hooks/pyramid_attention_broadcast.py) run by the fast
pipeline's call instead of its hooks (model/step_caches.py says when): the same decisions, the same reused values.

diffusers hooks every block's attention module (the spatial identifiers match `transformer_blocks.<i>.attn`) with
one state per module, not one per cache_context: a counter of the forwards it has seen, cond and uncond alike, and
the last output. A forward computes the attention while the state is empty, at its first iteration, outside
`timestep_skip_range` (exclusive bounds, the pipeline's current timestep) and on every `block_skip_range`-th
iteration; otherwise it returns the last output, whichever branch computed it. With CFG run as two forwards (cond,
then uncond) and the default skip range of 2, inside the range the cond forward computes and the uncond forward takes
the cond's attention of the same step. Every module counts the same forwards, so a forward decides once per branch.

In a paired CFG forward the branches' decisions are taken in diffusers' order (cond, then uncond) and each block
computes its attention for the rows of the branches that compute (only the cond half when the uncond half reuses it)
and takes the last output for the others; a block whose branches all reuse skips what only attention reads. The last
output lives in buffers the runner keeps per forward shape, so each decision pattern is one CUDA graph. As on stock,
the two texts must have one length (stock fails at the first reuse otherwise; so does this, before pairing).
"""

from dataclasses import dataclass, field

import torch

from .cuda_graph import read_by_graph


@dataclass(frozen=True)
class PyramidBroadcastRule:
    """A PyramidAttentionBroadcastConfig with spatial attention only (what matches Qwen-Image's blocks)."""

    block_skip_range: int
    timestep_skip_range: tuple
    current_timestep: object  # the config's current_timestep_callback

    kind = "pyramid_broadcast"  # optimizations.Facts.cache_rule

    def label(self) -> str:
        return "PyramidAttentionBroadcastConfig"

    def computes(self, iteration: int, has_cache: bool, timestep) -> bool:
        """PyramidAttentionBroadcastHook.new_forward's should_compute_attention."""
        within = self.timestep_skip_range[0] < timestep < self.timestep_skip_range[1]
        return not has_cache or iteration == 0 or not within or iteration % self.block_skip_range == 0


@dataclass
class Branch:
    decisions: list = field(default_factory=list)  # per forward: computed (True) or reused


class LastOutputs:
    """The last attention output per block and stream ([B, L, D], B the rows of one branch)."""

    def __init__(self):
        self.tensors: dict[tuple[int, str], torch.Tensor] = {}


@dataclass
class BlockCache:
    """What one block of a forward does with its attention (FastBlock.forward reads it)."""

    last: LastOutputs
    index: int
    decisions: tuple  # per branch of the forward, in diffusers' order

    @property
    def reads_no_inputs(self) -> bool:
        return not any(self.decisions)

    def outputs(self, attend, batch: int, text_out: bool) -> tuple:
        """(img, txt) attention outputs of the forward's `batch` rows (txt None when not text_out); attend(rows)
        computes those of the batch rows `rows` (a slice)."""
        n = len(self.decisions)
        if all(self.decisions):
            out = attend(slice(None))
            self._keep(tuple(None if o is None else o[batch - batch // n:] for o in out))
            return out
        rows = batch // n
        value = (self.last.tensors.get((self.index, "img")),
                 self.last.tensors.get((self.index, "txt")) if text_out else None)
        read_by_graph(*value)  # the runner's buffers, which a graph of this forward reads
        parts = []
        for k, computes in enumerate(self.decisions):
            if computes:
                value = attend(slice(k * rows, (k + 1) * rows))
            parts.append(value)
        out = parts[0] if n == 1 else tuple(None if parts[0][j] is None else torch.cat([p[j] for p in parts])
                                            for j in range(2))
        self._keep(value)  # after the outputs are copied out of what it overwrites
        return out

    def _keep(self, value: tuple):
        for stream, tensor in zip(("img", "txt"), value):
            if tensor is None:
                continue
            kept = self.last.tensors.get((self.index, stream))
            if kept is None or kept.shape != tensor.shape:  # first forward of a shape: eager
                self.last.tensors[(self.index, stream)] = tensor.clone()
            elif kept is not tensor:
                read_by_graph(kept)  # the runner's buffer, which a graph of this forward writes
                kept.copy_(tensor)


class PyramidBroadcastRun:
    """Pyramid Attention Broadcast in one pipeline call: the shared counter (diffusers' per-module state, equal in
    every module) and the per-branch decisions; the last outputs are the runner's."""

    def __init__(self, rule: PyramidBroadcastRule, buffers: dict):
        self.rule, self.buffers = rule, buffers
        self.iteration, self.has_cache = 0, False
        self.text_length, self.key = None, None  # of the forward whose output a reuse takes
        self.branches: dict[str, Branch] = {}

    def forward(self, run, inputs: dict, names: list[str], key: tuple, text_lengths: tuple):
        """One forward of `names`' branches (key: the shape of one branch's rows, which share the last outputs;
        text_lengths: each branch's prompt length before any padding). run(variant, scalars, block_cache) runs the
        whole forward with block_cache(i, scalars) telling block i what to do (no scalars here). Returns (output,
        per branch whether it computed)."""
        timestep = self.rule.current_timestep()
        decisions = []
        for name, length in zip(names, text_lengths * len(names) if len(text_lengths) == 1 else text_lengths):
            computes = self.rule.computes(self.iteration, self.has_cache, timestep)
            if not computes and (length != self.text_length or key != self.key):
                raise ValueError(
                    "PyramidAttentionBroadcastConfig keeps one attention output for cond and uncond (as diffusers "
                    f"does): a forward of {length} text tokens cannot reuse one of {self.text_length}; give the prompt "
                    "and the negative prompt the same length (stock diffusers fails here too)")
            if computes:
                self.text_length, self.key = length, key
            self.iteration, self.has_cache = self.iteration + 1, True
            self.branches.setdefault(name, Branch()).decisions.append(computes)
            decisions.append(computes)
        last = self.buffers.setdefault(key, LastOutputs())
        decisions = tuple(decisions)
        out = run(decisions, None, lambda i, scalars: BlockCache(last, i, decisions))
        return out, list(decisions)
