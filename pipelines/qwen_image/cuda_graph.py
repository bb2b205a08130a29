"""CUDA-graph replay of a transformer forward, one graph per input signature.

The fast transformer launches ~15 kernels per block with no host synchronization, so its whole forward can be
captured once and replayed: the CPU then issues one launch per step instead of ~900, and the GPU runs the
kernels back to back. A signature is every tensor argument's shape, dtype and device plus the non-tensor
arguments (img_shapes, ...): a new resolution, batch or text length captures a new graph. Inputs are copied into
the graph's static buffers before each replay; the output is copied out, so it stays valid after the next replay.

Two users: the text-to-image pipeline, whose loop is ours (GraphedForward called like the model, a graph captured
on a signature's first call after two warm-up runs), and the family pipelines, whose loops are diffusers' own
(CallGraphs, lent to the transformer for one call: a graph is captured on a signature's second forward of the call,
the first having run eagerly, so one-off forwards such as an edit's unpaired first step capture nothing).
"""

from collections import OrderedDict

import torch
from diffusers.models.modeling_outputs import Transformer2DModelOutput


class GraphCaptureError(RuntimeError):
    """Warm-up or capture of a new graph failed; the caller can run the model eagerly instead."""


def signature(kwargs: dict) -> tuple:
    return tuple(
        (name, (tuple(v.shape), v.dtype, str(v.device)) if isinstance(v, torch.Tensor) else repr(v))
        for name, v in sorted(kwargs.items())
    )


class GraphedForward:
    """Callable like model(**kwargs) (keyword arguments only); captures on the first call of each signature.
    max_graphs: how many to keep, the least recently replayed dropped first (None: all)."""

    def __init__(self, model, warmup_runs: int = 2, max_graphs: int | None = None):
        self.model = model
        self.run = lambda **kwargs: model(return_dict=False, **kwargs)[0]  # what a graph captures, by default
        self.warmup_runs = warmup_runs
        self.max_graphs = max_graphs
        self.graphs: OrderedDict[tuple, tuple[torch.cuda.CUDAGraph, dict, torch.Tensor]] = OrderedDict()
        self.weights_at: tuple[int, ...] = ()

    def drop_if_weights_moved(self):
        """A graph reads the weights at the addresses they had at capture: after `.to(...)` moved them, or LoRA
        adapters changed, capture anew (and free the stale graphs)."""
        addresses = tuple(t.data_ptr() for t in (*self.model.parameters(), *self.model.buffers()))
        lora = getattr(self.model, "lora_state", None)  # adapters' set, weights, fusing: packed factors rebuilt
        addresses += (lora.version,) if lora is not None else ()
        if addresses != self.weights_at:
            self.graphs.clear()
            self.weights_at = addresses

    @torch.no_grad()
    def __call__(self, return_dict: bool = True, **kwargs):
        sample = self.replay(self.key(kwargs), kwargs, self.warmup_runs)
        return Transformer2DModelOutput(sample=sample) if return_dict else (sample,)

    @staticmethod
    def key(kwargs: dict, state: tuple = ()) -> tuple:
        """A graph's key: the signature, and what else the forward reads that its arguments do not carry."""
        return signature(kwargs), state

    def replay(self, key: tuple, kwargs: dict, warmup_runs: int, run=None) -> torch.Tensor:
        """run(**kwargs) (default: self.run) from the graph of `key`, captured first (after warmup_runs eager runs)
        if there is none."""
        if key not in self.graphs:
            self.graphs[key] = self._capture(run or self.run, kwargs, warmup_runs)
            if self.max_graphs is not None and len(self.graphs) > self.max_graphs:
                self.graphs.popitem(last=False)
        self.graphs.move_to_end(key)
        graph, static, out = self.graphs[key]
        for name, buf in static.items():
            buf.copy_(kwargs[name])
        graph.replay()
        return out.clone()

    @staticmethod
    def _capture(run, kwargs, warmup_runs: int):
        try:
            return GraphedForward._try_capture(run, kwargs, warmup_runs)
        except Exception as e:
            raise GraphCaptureError(f"{type(e).__name__}: {e}") from e

    @staticmethod
    def _try_capture(run, kwargs, warmup_runs: int):
        static = {name: v.clone() for name, v in kwargs.items() if isinstance(v, torch.Tensor)}
        call_kwargs = {**kwargs, **static}
        if warmup_runs:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # compiles kernels and settles the allocator outside the capture
                for _ in range(warmup_runs):
                    run(**call_kwargs)
            torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run(**call_kwargs)
        return graph, static, out


class CallGraphs:
    """A family pipeline's graphs (GraphedForward over the transformer's `_forward`), lent to the transformer for
    one call on a CUDA device. A forward replays when its key (signature and the LoRA state) has a graph; else the
    first forward of a key in this call runs eagerly, and the second captures one with no warm-up runs (the eager
    one compiled the kernels and filled the rotary and mod_row caches, so nothing in the capture copies from the
    host). Forwards with ControlNet residuals (a list of tensors, not graph inputs) or a modulation row run
    eagerly. `replayed` counts the forwards that replayed; `failed` holds a capture error, after which every
    forward runs eagerly."""

    def __init__(self, graphs: GraphedForward):
        self.graphs = graphs
        self.seen: set[tuple] = set()
        self.replayed = 0
        self.failed: GraphCaptureError | None = None

    def __call__(self, forward, inputs: dict, state: tuple) -> torch.Tensor:
        if (self.failed is not None or inputs["controlnet_block_samples"] is not None
                or inputs["modulation"] is not None):
            return forward(**inputs)
        key = self.graphs.key(inputs, state)
        if key not in self.graphs.graphs and key not in self.seen:
            self.seen.add(key)
            return forward(**inputs)
        try:
            out = self.graphs.replay(key, inputs, warmup_runs=0, run=forward)
        except GraphCaptureError as e:
            self.failed = e
            return forward(**inputs)
        self.replayed += 1
        return out
