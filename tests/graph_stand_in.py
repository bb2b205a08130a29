"""CUDA graphs on the CPU, for the tests and the gloo worker: a stand-in for Graphs.capture that runs the function it
is given (a real capture records kernels without running them), replays by running it again on the static inputs,
and checks what the forward reads as a real graph would need it: every tensor the captured function reads that it
did not make itself must be owned by the graph store (a static input, a shared input buffer, a tensor the forward
declared with read_by_graph) or be a weight of the model (drop_if_weights_moved watches those). A tensor read from
anywhere else, a cache's table or a layout's indices, is what a real graph would go on reading after its owner
freed it (the two-GPU Ulysses crash): the stand-in records it in log["unowned"], and the fixture fails the test."""

import bisect

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from qwen_image_fast.pipelines.core.runtime import cuda_graph


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _storage(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


# ops that take a tensor as a template only (its dtype, device, shape): they read none of its memory
TEMPLATE_OPS = {torch.ops.aten.new_empty.default, torch.ops.aten.new_empty_strided.default,
                torch.ops.aten.new_zeros.default, torch.ops.aten.new_ones.default, torch.ops.aten.new_full.default,
                torch.ops.aten.empty_like.default, torch.ops.aten.zeros_like.default,
                torch.ops.aten.ones_like.default, torch.ops.aten.full_like.default}


class ExternalReads(TorchDispatchMode):
    """The storages that the ops run under it take as arguments and that no op run under it made: what a graph
    captured from this code reads from outside. Under Triton's interpreter a kernel's tensor arguments are copied
    back after the launch (an aten copy_ of each), so kernels' reads are seen too."""

    def __init__(self):
        super().__init__()
        self.made: set[int] = set()
        self.read: dict[int, tuple] = {}  # storage address -> (bytes, the first op and argument that read it)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in [] if func in TEMPLATE_OPS else _tensors((args, kwargs)):
            address, size = _storage(t)
            if size and address not in self.made and address not in self.read:
                self.read[address] = (size, f"{func} {tuple(t.shape)} {t.dtype}")
        out = func(*args, **kwargs)
        for t in _tensors(out):
            address, size = _storage(t)
            if size and address not in self.read:
                self.made.add(address)
        return out


def unowned_reads(reads: ExternalReads, store: cuda_graph.Graphs, static: dict) -> list[str]:
    """What `reads` saw that the store does not own for the graph: not a static input, a shared input buffer or a
    declared read, and no weight of the model (by drop_if_weights_moved's addresses) inside its storage."""
    owned = {_storage(t)[0] for t in [*static.values(), *cuda_graph._CAPTURE_READS.get(),
                                      *(b for buffers in store.inputs.values() for b in buffers.values())]}
    weights = sorted(store.weights_at[0] if store.weights_at else ())
    unowned = []
    for address, (size, what) in reads.read.items():
        i = bisect.bisect_left(weights, address)
        if address not in owned and not (i < len(weights) and weights[i] < address + size):
            unowned.append(what)
    return unowned


def batch_of(inputs: dict) -> int:
    """A graphed forward's batch: its latents' (hidden_states), or a later piece's rows' (Qwen-Image-2.1's img)."""
    return (inputs["hidden_states"] if "hidden_states" in inputs else inputs["img"]).shape[0]


def install(setattr_, log: dict | None = None) -> dict:
    """Put the stand-in in place with `setattr_(obj, name, value)` (monkeypatch.setattr, or setattr in a worker
    process). Returns the log: the batch of each capture and replay in order, and the unowned reads."""
    from qwen_image_fast.pipelines.core import optimizations

    log = log if log is not None else {"captures": [], "replays": [], "capturing": False, "unowned": []}

    def capture(store, run, inputs, static=None, pool=None):
        if static is None:
            static = {name: v.clone() for name, v in inputs.items() if isinstance(v, torch.Tensor)}
        log["capturing"] = True  # what runs now is the capture, not a forward (a real capture launches nothing)
        try:
            with ExternalReads() as reads:
                out = run(**inputs | static)
        finally:
            log["capturing"] = False
        log["unowned"] += unowned_reads(reads, store, static)
        log["captures"].append(batch_of(inputs))

        class Graph:
            def replay(self):
                log["replays"].append(batch_of(inputs))
                new = run(**inputs | static)
                for into, value in zip(*((out, new) if isinstance(out, tuple) else ((out,), (new,)))):
                    if into is not None:
                        into.copy_(value)

        return Graph(), static, out

    setattr_(cuda_graph.Graphs, "capture", capture)
    setattr_(torch.cuda, "graph_pool_handle", lambda: None)
    setattr_(optimizations, "no_graphs_reason", lambda facts: None)
    return log
