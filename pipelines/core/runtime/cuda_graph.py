"""CUDA graphs of transformer forwards: capture, replay, and the store a pipeline keeps across calls.

The fast transformer launches ~15 kernels per block with no host synchronization, so a whole forward can be
captured once and replayed: the CPU then issues one launch per step instead of ~900, and the GPU runs the kernels
back to back. A graph is keyed by its forward's signature (every tensor argument's shape, dtype and device, the
non-tensor arguments such as img_shapes) and what else the forward reads that its arguments do not carry (the LoRA
scale and adapters' version): a new resolution, batch or text length captures a new graph. Inputs are copied into
the graph's static buffers before each replay; the output is copied out, so it stays valid after the next replay.
When to capture is one policy, Graphs.run's, for every user, and what a failed capture does is one too, CallGraphs.run's
(the runner's whole forwards and step-cache pieces, runner.py; the blocks under diffusers' step-cache hooks,
block_graphs.py; a model that graphs its own steps, such as Qwen-Image-2.1's, through the forward context's
`step_graphs`): a key's first forward runs eagerly (it compiles the
kernels and fills the model's caches), its second is captured, later ones replay; a failed capture turns the store's
graphs off for the pipeline, with a warning.

Pieces of a forward between which Python runs (a block under diffusers' step-cache hooks, runner.py) are captured
into one shared memory pool: a piece's intermediates are dead once it returns, and its output is copied out right
after its replay, so any replay order is safe; the input buffers of one piece kind and signature are shared by the
pieces of every block (each is filled just before its replay).

A graph reads memory by address, so whatever it reads must live as long as it does. Its static inputs, its output
and its intermediates are its own; the weights are checked for moves before each call (drop_if_weights_moved); what
else a forward reads that it did not make during the capture (rotary tables and index tensors from a model's
caches, a Ulysses layout, step-cache buffers) the forward names with `read_by_graph`, and the graph captured around
it holds a reference to each for as long as it is kept. Without that, a cache that drops or rebuilds such a tensor
frees its memory while a kept graph still reads it: whatever is allocated there next is read in its place, an index
out of bounds at best, a wrong image and no error at worst.
"""

import logging
from collections import OrderedDict
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Callable

import torch

from .context import record

logger = logging.getLogger(__name__)

# While a graph is captured: the tensors made outside it that its forward said it reads (read_by_graph)
_CAPTURE_READS: ContextVar[list | None] = ContextVar("qwen_image_fast_capture_reads", default=None)


def read_by_graph(*tensors):
    """Tensors a forward reads that were made outside it (a cache's tables or indices): a graph captured around
    this forward keeps them alive for as long as it is kept. Outside a capture, nothing."""
    kept = _CAPTURE_READS.get()
    if kept is not None:
        kept.extend(t for t in tensors if t is not None)


class GraphCaptureError(RuntimeError):
    """Capturing a new graph failed; the caller can run the forward eagerly instead."""


def signature(inputs: dict) -> tuple:
    return tuple(
        (name, (tuple(v.shape), v.dtype, str(v.device)) if isinstance(v, torch.Tensor) else repr(v))
        for name, v in sorted(inputs.items())
    )


class Graphs:
    """Captured graphs by key, at most max_graphs (the least recently replayed dropped first)."""

    def __init__(self, max_graphs: int = 4, shared: bool = False):
        self.max_graphs, self.shared = max_graphs, shared
        # key -> (graph, static inputs, output, the tensors made outside it that it reads: read_by_graph)
        self.graphs: OrderedDict[tuple, tuple] = OrderedDict()
        self.weights_at: tuple = ()  # (the weights' data_ptrs, the LoRA adapters' version)
        self.pool = None  # shared: the memory pool of every capture
        self.inputs: dict[tuple, dict] = {}  # shared: (input kind, signature) -> static input buffers
        self.failed: str | None = None  # a capture error: its users capture and replay no more (runner.py)

    def clear(self):
        self.graphs.clear()
        self.inputs.clear()

    def fail(self, error: str):
        """A capture failed: every graph dropped, and `failed` says why."""
        self.clear()
        self.failed = error

    def __contains__(self, key: tuple) -> bool:
        return key in self.graphs

    def __len__(self) -> int:
        return len(self.graphs)

    def drop_if_weights_moved(self, model):
        """A graph reads the weights at the addresses they had at capture: after `.to(...)` moved them, or LoRA
        adapters changed (their packed factors are rebuilt), capture anew (and free the stale graphs)."""
        addresses = tuple(t.data_ptr() for module in model.modules()  # every module's own tensors, one walk
                          for t in (*module._parameters.values(), *module._buffers.values()) if t is not None)
        lora = getattr(model, "lora_state", None)
        weights_at = (addresses, lora.version if lora is not None else None)
        if weights_at != self.weights_at:
            self.clear()
            self.weights_at = weights_at

    def filled(self, kind: str, tensors: dict, fill: bool = True) -> dict:
        """The shared buffers of `kind` and the tensors' signature (created as copies the first time), holding
        `tensors` when fill."""
        key = (kind, signature(tensors))
        if key not in self.inputs:
            self.inputs[key] = {name: v.clone() for name, v in tensors.items()}
        elif fill:
            for name, buf in self.inputs[key].items():
                buf.copy_(tensors[name])
        return self.inputs[key]

    def run(self, key: tuple, inputs: dict, compute, seen: set, kind: str = "") -> tuple:
        """(compute(**inputs), whether it came from a graph): eagerly the first time `key` runs (noted in `seen`,
        the caller's set of keys run eagerly), from the graph of `key` every time after (captured the second
        time). A failed capture raises GraphCaptureError; the caller decides how to go on."""
        if key not in self.graphs and key not in seen:
            seen.add(key)
            return compute(**inputs), False
        return self.replay(key, inputs, compute, kind), True

    def replay(self, key: tuple, inputs: dict, run, kind: str = ""):
        """run(**inputs) from the graph of `key`, captured first if there is none (no warm-up runs: the caller ran
        this signature eagerly before, which compiled the kernels and filled the model's caches). kind: which
        input buffers a shared store gives the graph (those of every graph of this kind and signature). The output
        (a tensor, or a tuple of tensors and Nones) is a copy."""
        if key not in self.graphs:
            static = None
            if self.shared:
                static = self.filled(kind, {name: v for name, v in inputs.items() if isinstance(v, torch.Tensor)},
                                     fill=False)
                if self.pool is None:
                    self.pool = torch.cuda.graph_pool_handle()
            reads = _CAPTURE_READS.set([])
            try:
                self.graphs[key] = (*self.capture(run, inputs, static, self.pool), tuple(_CAPTURE_READS.get()))
            except Exception as e:
                raise GraphCaptureError(f"{type(e).__name__}: {e}") from e
            finally:
                _CAPTURE_READS.reset(reads)
            if len(self.graphs) > self.max_graphs:
                self.graphs.popitem(last=False)
        self.graphs.move_to_end(key)
        graph, static, out, _ = self.graphs[key]
        for name, buf in static.items():
            buf.copy_(inputs[name])
        graph.replay()
        if isinstance(out, tuple):
            return tuple(None if t is None else t.clone() for t in out)
        return out.clone()

    @staticmethod
    def capture(run, inputs: dict, static: dict | None = None, pool=None) -> tuple:
        """(graph, static input buffers by name, static output) of run(**inputs) on the current stream; static: the
        input buffers to capture it on (None: new copies of the inputs); pool: a shared memory pool."""
        if static is None:
            static = {name: v.clone() for name, v in inputs.items() if isinstance(v, torch.Tensor)}
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = run(**{**inputs, **static})
        return graph, static, out


@dataclass(frozen=True)
class CallGraphs:
    """One pipeline call's use of the runner's store: the store (kept across calls) and the keys the call ran
    eagerly. The runner graphs its forwards through it, and sets it in the forward context (`step_graphs`) for a
    model that graphs its own steps (its forward does host work first, then a fixed-shape step: Qwen-Image-2.1's
    cached steps)."""

    store: Graphs
    seen: set

    def run(self, key: tuple, inputs: dict, compute, kind: str = "", label=True):
        """compute(**inputs), from the store's graph of `key` from the second time it runs (Graphs.run; kind: a
        shared store's input buffers), recorded as cuda_graphs (value `label`) when replayed. A failed capture runs
        it eagerly, with a warning, and turns the store's graphs off (Graphs.failed: the runner keeps them off for
        the pipeline); so does a store failed before."""
        if self.store.failed:
            return compute(**inputs)
        try:
            out, replayed = self.store.run(key, inputs, compute, self.seen, kind)
        except GraphCaptureError as e:
            logger.warning("CUDA graph capture failed, running the transformer eagerly from now on: %s",
                           e.__cause__ or e)
            self.store.fail(str(e))
            return compute(**inputs)
        if replayed:
            record("cuda_graphs", label)
        return out

    def drop(self, stale: Callable[[tuple], bool]):
        """Drops the graphs whose key is stale (they read buffers their owner has let go of)."""
        for key in [key for key in self.store.graphs if stale(key)]:
            del self.store.graphs[key]
