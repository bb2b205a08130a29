"""CUDA-graph replay of a transformer forward, one graph per input signature.

The fast transformer launches ~15 kernels per block with no host synchronization, so its whole forward can be
captured once and replayed: the CPU then issues one launch per step instead of ~900, and the GPU runs the
kernels back to back. A signature is every tensor argument's shape, dtype and device plus the non-tensor
arguments (img_shapes, ...): a new resolution, batch or text length captures a new graph. Inputs are copied into
the graph's static buffers before each replay; the output is copied out, so it stays valid after the next replay.
"""

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
    """Callable like model(**kwargs) (keyword arguments only); captures on the first call of each signature."""

    def __init__(self, model, warmup_runs: int = 2):
        self.model = model
        self.warmup_runs = warmup_runs
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, dict, torch.Tensor]] = {}
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
        key = signature(kwargs)
        if key not in self.graphs:
            self.graphs[key] = self._capture(kwargs)
        graph, static, out = self.graphs[key]
        for name, buf in static.items():
            buf.copy_(kwargs[name])
        graph.replay()
        sample = out.clone()
        return Transformer2DModelOutput(sample=sample) if return_dict else (sample,)

    def _capture(self, kwargs):
        try:
            return self._try_capture(kwargs)
        except Exception as e:
            raise GraphCaptureError(f"{type(e).__name__}: {e}") from e

    def _try_capture(self, kwargs):
        static = {name: v.clone() for name, v in kwargs.items() if isinstance(v, torch.Tensor)}
        call_kwargs = {**kwargs, **static, "return_dict": False}
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # compiles kernels and settles the allocator outside the capture
            for _ in range(self.warmup_runs):
                self.model(**call_kwargs)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            (out,) = self.model(**call_kwargs)
        return graph, static, out
