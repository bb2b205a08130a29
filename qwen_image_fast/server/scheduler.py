"""Dynamic batching over the engines: requests queue as Items; whenever an engine is free, the oldest item's
compatible images (ImageRequest.batch_key) go to it as one pipeline call, up to max_batch images, after waiting at
most max_wait for company. An engine is free again once its call is computed, while its images are still being
encoded (engine.py): their requests wait in Engine.encoding until its "done". A request's images may span several
calls (n > max_batch); it is answered once all are back. An engine that stops (its pipe closes: a crash, kill -9) fails its batch's requests with 503 and is started
again; a request that times out or whose client goes away is dropped from the queue (a batch already running
finishes, its images unused). Every item is answered once: Item.finish ignores a second outcome.
"""

import asyncio
import itertools
import multiprocessing
import threading
import time
from dataclasses import dataclass, field

from .engine import Batch, EngineSpec, Work, engine_main
from .metrics import Metrics
from .protocol import ApiError, ImageRequest


@dataclass(eq=False)
class Item:
    request: ImageRequest
    works: list[Work]  # one per image, in order
    future: asyncio.Future
    arrived: float = field(default_factory=time.perf_counter)
    next_image: int = 0  # images before it have been sent to engines
    results: dict = field(default_factory=dict)  # image index -> encoded bytes
    applied: list = field(default_factory=list)
    batch_sizes: list = field(default_factory=list)  # images in each pipeline call its images ran in

    @property
    def queued(self) -> int:
        return len(self.works) - self.next_image

    def finish(self, outcome):
        if not self.future.done():
            (self.future.set_exception if isinstance(outcome, BaseException) else self.future.set_result)(outcome)


class Engine:
    """The server's handle on one engine process: start, submit a batch, hear its answers on a reader thread."""

    def __init__(self, index: int, spec: EngineSpec, loop, on_message):
        self.index, self.spec, self.loop, self.on_message = index, spec, loop, on_message
        self.ready, self.busy, self.process, self.conn, self.failure = False, None, None, None, None
        self.encoding: dict[int, list] = {}  # batch id -> its (item, image indices), computed, being encoded

    def start(self):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.ready, self.busy, self.encoding = False, None, {}
        self.process = ctx.Process(target=engine_main, args=(child, self.spec), daemon=True,
                                   name=f"qwen-image-fast-engine-{self.index}")
        self.process.start()
        child.close()
        threading.Thread(target=self._read, args=(self.conn, self.process), daemon=True).start()

    def _read(self, conn, process):
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                process.join(timeout=5)
                self.loop.call_soon_threadsafe(self.on_message, self, ("stopped", process.exitcode))
                return
            self.loop.call_soon_threadsafe(self.on_message, self, message)

    def submit(self, batch: Batch, items: list):
        self.busy = (batch, items)
        self.conn.send(batch)

    def answered(self, batch_id: int) -> list:
        """The (item, indices) of a batch the engine answered ("done" or "error"): encoded, or still running."""
        if batch_id in self.encoding:
            return self.encoding.pop(batch_id)
        (batch, items), self.busy = self.busy, None
        assert batch.id == batch_id, (batch.id, batch_id)
        return items

    def stop(self):
        if self.process is not None and self.process.is_alive():
            try:
                self.conn.send(None)
            except OSError:
                pass
            self.process.join(timeout=10)
            if self.process.is_alive():
                self.process.kill()


class Scheduler:
    def __init__(self, specs: list[EngineSpec], max_batch: int, max_wait_s: float, max_queue: int,
                 metrics: Metrics):
        self.specs, self.max_batch, self.max_wait_s, self.max_queue = specs, max_batch, max_wait_s, max_queue
        self.metrics, self.pending, self.engines = metrics, [], []
        self.batch_ids = itertools.count()
        self.changed: asyncio.Event | None = None
        self.seconds_per_image = None  # a running estimate, for Retry-After
        self.stopping = False

    async def start(self):
        loop = asyncio.get_running_loop()
        self.changed = asyncio.Event()
        self.engines = [Engine(i, spec, loop, self._on_message) for i, spec in enumerate(self.specs)]
        for engine in self.engines:
            engine.start()
        self.task = asyncio.create_task(self._dispatch())

    def stop(self):
        self.stopping = True
        for engine in self.engines:
            engine.stop()

    @property
    def ready(self) -> int:
        return sum(engine.ready for engine in self.engines)

    @property
    def failures(self) -> list[str]:
        return [f"engine {e.index}: {e.failure}" for e in self.engines if e.failure]

    def queued_images(self) -> int:
        return sum(item.queued for item in self.pending)

    def in_flight(self) -> int:
        return len(self.pending) + sum(bool(engine.busy) + len(engine.encoding) for engine in self.engines)

    def submit(self, request: ImageRequest, works: list[Work]) -> Item:
        """Queue a request; ApiError 429 when max_queue requests already wait."""
        if len(self.pending) >= self.max_queue:
            per_image = self.seconds_per_image or 1.0
            retry = max(1, round(per_image * self.queued_images() / max(1, len(self.engines))))
            raise ApiError(429, f"the queue is full ({len(self.pending)} requests wait); retry in about {retry} s",
                           type="rate_limit_error", code="queue_full", headers={"Retry-After": str(retry)})
        item = Item(request, works, asyncio.get_running_loop().create_future())
        self.pending.append(item)
        self.changed.set()
        return item

    def drop(self, item: Item):
        """A request answered otherwise (timeout, client gone): its images not yet sent are not rendered."""
        if item in self.pending:
            self.pending.remove(item)
            self.changed.set()

    async def _dispatch(self):
        while True:
            self.changed.clear()
            engine = next((e for e in self.engines if e.ready and e.busy is None), None)
            if engine is None or not self.pending:
                await self.changed.wait()
                continue
            oldest = self.pending[0]
            key = oldest.request.batch_key()
            takers = [item for item in self.pending if item.request.batch_key() == key]
            images = sum(item.queued for item in takers)
            waited = time.perf_counter() - oldest.arrived
            if images < self.max_batch and waited < self.max_wait_s:
                try:  # wait for company, or for the oldest to have waited long enough
                    await asyncio.wait_for(self.changed.wait(), self.max_wait_s - waited)
                except TimeoutError:
                    pass
                continue
            self._send(engine, takers)

    def _send(self, engine: Engine, takers: list[Item]):
        # the edit pipelines take one prompt a call: a request with input images sends its images one at a time
        works, parts, room = [], [], 1 if takers[0].request.images else self.max_batch
        for item in takers:
            if room == 0:
                break
            if item.next_image == 0:  # its first batch starts
                self.metrics.queue_wait.observe(time.perf_counter() - item.arrived)
            take = min(room, item.queued)
            parts.append((item, list(range(item.next_image, item.next_image + take))))
            works += item.works[item.next_image:item.next_image + take]
            item.next_image += take
            room -= take
            if item.queued == 0:
                self.pending.remove(item)
        request = takers[0].request
        batch = Batch(id=next(self.batch_ids), width=request.width, height=request.height, steps=request.steps,
                      cfg=request.cfg, guidance_scale=request.guidance_scale, loras=request.loras,
                      works=tuple(works), step_cache=request.step_cache, images=request.images, mask=request.mask)
        for item, _ in parts:
            item.batch_sizes.append(len(works))
        try:
            engine.submit(batch, parts)
        except OSError:  # the engine's pipe is gone: its reader reports it stopped, which fails these
            pass
        self.metrics.batch_size.observe(len(works))

    def _on_message(self, engine: Engine, message):
        kind = message[0]
        if kind == "ready":
            engine.ready, engine.failure = True, None
        elif kind == "failed":
            engine.failure = message[1]
        elif kind == "computed":  # free for the next batch; this one's images are being encoded
            batch, items = engine.busy
            engine.busy, engine.encoding[batch.id] = None, items
        elif kind in ("done", "error"):
            items = engine.answered(message[1])
            if kind == "done":
                _, _, encoded, applied, seconds, encode_seconds = message
                self.metrics.compute.observe(seconds)
                self.metrics.encode.observe(encode_seconds)
                per_image = seconds / max(1, len(encoded))
                self.seconds_per_image = per_image if self.seconds_per_image is None else (
                    0.8 * self.seconds_per_image + 0.2 * per_image)
                it = iter(encoded)
                for item, indices in items:
                    for i in indices:
                        item.results[i] = next(it)
                    item.applied = applied
                    if len(item.results) == len(item.works):
                        item.finish(item)
            else:
                self._fail(items, ApiError(500, f"the pipeline failed on this request: {message[2]}",
                                           type="server_error", code="pipeline_error"))
        elif kind == "stopped":
            lost = [] if engine.busy is None else [engine.busy[1]]
            lost += engine.encoding.values()
            engine.busy, engine.encoding, engine.ready = None, {}, False
            for items in lost:
                self._fail(items, ApiError(
                    503, f"engine {engine.index} stopped (exit code {message[1]}) while rendering this request; it "
                         "is being restarted: retry", type="server_error", code="engine_stopped"))
            if not self.stopping and engine.failure is None:
                self.metrics.engine_restarts += 1
                engine.start()
        self.changed.set()

    def _fail(self, parts: list, error: ApiError):
        for item, _ in parts:
            self.drop(item)
            item.finish(error)
