"""Blocks replayed from CUDA graphs under diffusers' step-cache hooks: the forward context's `block_graphs`.

Under diffusers' step caches (transformer.enable_cache) the cache's hooks decide on the host around each block (and
its attention module), so no graph of a whole forward can run; each block replays from its own graphs instead: the
whole block, or three pieces around a hooked attention module ("pre" / "attn" / "post"), each captured on its second
forward of a signature (cuda_graph.Graphs.run). The pieces of every block share one memory pool and input buffers
(the runner's Graphs(shared=True)); what every block of a forward shares (rotary tables, text mask, timestep
embedding) is copied once per forward into buffers the graphs read (block_buffers, from JointInputs.on_buffers).

BlockGraphs is what one forward's blocks need, set by the runner (runner.py) in the forward context: the store, the
keys run eagerly in the call, and the adapters' key the forward runs; the blocks call its two methods.
"""

from dataclasses import dataclass

from .context import forward_context
from .cuda_graph import CallGraphs, Graphs, signature


@dataclass(frozen=True)
class BlockGraphs:
    store: Graphs  # the runner's block graphs (kept across calls, shared pool and inputs)
    seen: set  # the graph keys the call ran eagerly (its CallRun's)
    lora_key: tuple  # the LoRA scale and adapters' version the forward runs (a graph runs them as captured)

    def graphed_block(self, module, piece: str, inputs: dict, compute, joint_key: tuple):
        """compute(**inputs): `piece` ("block", or "pre" / "attn" / "post" around a hooked attention module) of one
        block, from a graph per (module, piece, signature) from its second forward. It reads the forward's shared
        tensors from the buffers block_buffers filled (joint_key: their signature). Captured, replayed and failed as
        every graph of the runner's (CallGraphs.run), recorded as cuda_graphs:blocks."""
        def run(**tensors):
            with forward_context(block_graphs=None):  # nothing inside a piece is graphed apart
                return compute(**tensors)

        key = (signature(inputs), self.lora_key, (id(module), piece, joint_key))
        return CallGraphs(self.store, self.seen).run(key, inputs, run, kind=piece, label="blocks")

    def block_buffers(self, kind: str, tensors: dict, fill: bool = True) -> dict:
        """The buffers the block graphs read for `kind` and the tensors' signature, holding `tensors` (fill: copied
        in; else scratch, the buffers as they are)."""
        return self.store.filled(kind, tensors, fill)
