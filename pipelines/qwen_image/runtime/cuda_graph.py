"""CUDA graphs of transformer forwards: capture, replay, and the store a pipeline keeps across calls.

The fast transformer launches ~15 kernels per block with no host synchronization, so a whole forward can be
captured once and replayed: the CPU then issues one launch per step instead of ~900, and the GPU runs the kernels
back to back. A graph is keyed by its forward's signature (every tensor argument's shape, dtype and device, the
non-tensor arguments such as img_shapes) and what else the forward reads that its arguments do not carry (the LoRA
scale and adapters' version): a new resolution, batch or text length captures a new graph. Inputs are copied into
the graph's static buffers before each replay; the output is copied out, so it stays valid after the next replay.
When to capture is the runner's policy (runner.py); this file only captures and replays.
"""

from collections import OrderedDict

import torch


class GraphCaptureError(RuntimeError):
    """Capturing a new graph failed; the caller can run the forward eagerly instead."""


def signature(inputs: dict) -> tuple:
    return tuple(
        (name, (tuple(v.shape), v.dtype, str(v.device)) if isinstance(v, torch.Tensor) else repr(v))
        for name, v in sorted(inputs.items())
    )


class Graphs:
    """Captured graphs by key, at most max_graphs (the least recently replayed dropped first)."""

    def __init__(self, max_graphs: int = 4):
        self.max_graphs = max_graphs
        self.graphs: OrderedDict[tuple, tuple] = OrderedDict()  # key -> (graph, static inputs, output)
        self.weights_at: tuple = ()

    def __contains__(self, key: tuple) -> bool:
        return key in self.graphs

    def __len__(self) -> int:
        return len(self.graphs)

    def drop_if_weights_moved(self, model):
        """A graph reads the weights at the addresses they had at capture: after `.to(...)` moved them, or LoRA
        adapters changed (their packed factors are rebuilt), capture anew (and free the stale graphs)."""
        addresses = tuple(t.data_ptr() for t in (*model.parameters(), *model.buffers()))
        lora = getattr(model, "lora_state", None)
        addresses += (lora.version,) if lora is not None else ()
        if addresses != self.weights_at:
            self.graphs.clear()
            self.weights_at = addresses

    def replay(self, key: tuple, inputs: dict, run) -> torch.Tensor:
        """run(**inputs) from the graph of `key`, captured first if there is none (no warm-up runs: the caller ran
        this signature eagerly before, which compiled the kernels and filled the model's caches)."""
        if key not in self.graphs:
            try:
                self.graphs[key] = self.capture(run, inputs)
            except Exception as e:
                raise GraphCaptureError(f"{type(e).__name__}: {e}") from e
            if len(self.graphs) > self.max_graphs:
                self.graphs.popitem(last=False)
        self.graphs.move_to_end(key)
        graph, static, out = self.graphs[key]
        for name, buf in static.items():
            buf.copy_(inputs[name])
        graph.replay()
        return tuple(t.clone() for t in out) if isinstance(out, tuple) else out.clone()

    @staticmethod
    def capture(run, inputs: dict) -> tuple:
        """(graph, static input buffers by name, static output) of run(**inputs) on the current stream."""
        static = {name: v.clone() for name, v in inputs.items() if isinstance(v, torch.Tensor)}
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run(**{**inputs, **static})
        return graph, static, out
