"""Layers streamed from pinned host memory (FastConfig(memory="low", max_memory_gib=...)): when a set of weights that
takes turns on the GPU (offload.py) does not fit its buffer, as many of its layers as fit stay there for the turn
(resident) and the rest are copied in ahead of use, each into one of SLOTS fixed slots of the buffer, on a side
stream, while the layers before them compute.

A streamed layer's tensors point at its slot for the whole turn (layer k of the streamed ones at slot k % SLOTS), so
every address is fixed and a CUDA graph captured over the layers replays the copies with the compute: within one
run of layers (LayerStream.begin .. end), the side stream forks from the compute stream, each copy waits for the
compute of the slot's previous layer, each streamed layer waits for its copy, and the compute stream joins the side
stream at the end. The streamed layers are spread evenly among the resident ones (streamed_layers), so each copy has
the compute of the layers in between to hide behind (one 217 MiB block of FP8 linears: 4.1 ms at the 55 GB/s an H200
reaches from pinned memory; benchmarks/RESULTS.md).

On the CPU the copies run in order where they are issued (there is no second stream): the same layout and the same
results, which the CPU tests check.
"""

import torch

SLOTS = 2  # a copy overwrites the slot that the streamed layer two before used


def streamed_layers(n_layers: int, resident: int) -> tuple[int, ...]:
    """The n_layers - resident layers to stream, spread evenly: one at the middle of each of that many equal runs
    of layers (so the first has layers before it to hide its copy behind)."""
    streamed = n_layers - resident
    return tuple(int((k + 0.5) * n_layers / streamed) for k in range(streamed)) if streamed > 0 else ()


class LayerStream:
    """The streamed layers of one loaded arena: `copies[i]` = (device slot view, host view) of layer i's bytes, for
    the streamed i; begin/before/end are called around and inside a run of the layers (in order; layers may be
    skipped)."""

    def __init__(self, copies: dict[int, tuple[torch.Tensor, torch.Tensor]], slot_of: dict[int, int],
                 device: torch.device):
        self.copies, self.slot_of = copies, slot_of
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.copied = 0  # bytes copied in since the arena was loaded (what the CPU tests count)
        self._pending: list[int] = []  # the run's streamed layers not copied in yet, in order
        self._ready: dict[int, torch.cuda.Event | None] = {}  # copied in (or on the way): the copy's event
        self._occupied: dict[int, int] = {}  # slot -> the layer copied into it whose compute is not queued yet

    def begin(self, start: int, stop: int):
        """Before layers start .. stop - 1: fork the side stream and copy in the first streamed layer of each slot."""
        self._pending = [i for i in sorted(self.copies) if start <= i < stop]
        self._ready, self._occupied = {}, {}
        if self.side is not None:
            self.side.wait_stream(torch.cuda.current_stream())
        self._issue()

    def before(self, i: int):
        """Before layer i computes: the slots of the layers before it are free (their compute is queued); wait for
        layer i's copy if it is streamed; start the copies whose slot is free."""
        self._occupied = {slot: j for slot, j in self._occupied.items() if j >= i}
        if i in self.copies:
            if i not in self._ready:
                raise RuntimeError(f"streamed layer {i} ran before its copy was issued (a run is begin, then "
                                   "before(i) for each layer in order, then end)")
            event = self._ready.pop(i)
            if event is not None:
                torch.cuda.current_stream().wait_event(event)
        self._issue()

    def end(self):
        """After the run: the compute stream joins the side stream (every copy issued is waited for)."""
        if self.side is not None:
            torch.cuda.current_stream().wait_stream(self.side)
        self._pending, self._ready, self._occupied = [], {}, {}

    def _issue(self):
        """Copy in the pending layers, in order, while the next one's slot is free."""
        while self._pending and self.slot_of[self._pending[0]] not in self._occupied:
            i = self._pending.pop(0)
            device, host = self.copies[i]
            if self.side is None:
                device.copy_(host)
                event = None
            else:
                self.side.wait_stream(torch.cuda.current_stream())  # after the slot's last layer's compute
                with torch.cuda.stream(self.side):
                    device.copy_(host, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(self.side)
            self._ready[i] = event
            self._occupied[self.slot_of[i]] = i
            self.copied += host.numel()
