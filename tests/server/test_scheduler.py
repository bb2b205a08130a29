"""The scheduler's side of the engine protocol (engine.py): an engine is free for the next batch once it says
"computed", while its images are still being encoded; "done" answers the requests; an engine that stops fails both
the batch it computes and those it encodes. The scheduler and its Engine handle are the real ones and send real
Batches down a real pipe; the test reads them at the pipe's other end and answers as an engine process would (an
engine's encoding is too fast on the tiny model for a real one to show the overlap on every machine). The real
engines' side is tested in test_serve.py: every request there goes through it."""

import asyncio
import multiprocessing

import pytest

from qwen_image_fast.server.engine import Batch, Work
from qwen_image_fast.server.metrics import Metrics
from qwen_image_fast.server.protocol import ApiError, ImageRequest
from qwen_image_fast.server.scheduler import Engine, Scheduler


def request(seed: int) -> ImageRequest:
    return ImageRequest(prompt="a cat", negative_prompt=None, n=1, width=64, height=64, steps=2, cfg=1.0, seed=seed,
                        seed_given=True, output_format="png", output_compression=100)


def submit(scheduler: Scheduler, seed: int):
    return scheduler.submit(request(seed), [Work("a cat", None, seed, "png", 100, {})])


async def started(max_batch: int = 1) -> tuple[Scheduler, Engine, multiprocessing.connection.Connection]:
    """A scheduler whose one engine is ready, the test holding the engine's end of its pipe."""
    scheduler = Scheduler([], max_batch=max_batch, max_wait_s=0.0, max_queue=16, metrics=Metrics())
    await scheduler.start()
    engine = Engine(0, None, asyncio.get_running_loop(), scheduler._on_message)
    engine.conn, engine_end = multiprocessing.Pipe()
    scheduler.engines = [engine]
    scheduler._on_message(engine, ("ready",))
    return scheduler, engine, engine_end


async def received(conn) -> Batch:
    """The next batch the scheduler sent down the pipe (within 5 s)."""
    for _ in range(500):
        if conn.poll():
            return conn.recv()
        await asyncio.sleep(0.01)
    raise AssertionError("the scheduler sent no batch")


def test_the_next_batch_goes_out_while_the_last_is_encoded():
    async def scenario():
        scheduler, engine, conn = await started()
        first, second = (submit(scheduler, seed) for seed in (0, 1))
        batch0 = await received(conn)
        assert not conn.poll(0.05), "a second batch sent while the engine computes the first"
        scheduler._on_message(engine, ("computed", batch0.id))
        batch1 = await received(conn)  # sent before the first batch's images are encoded
        assert engine.busy[0].id == batch1.id and list(engine.encoding) == [batch0.id]
        assert not first.future.done() and scheduler.in_flight() == 2
        scheduler._on_message(engine, ("done", batch0.id, [b"image 0"], ["applied"], 0.5, 0.1))
        assert (await first.future).results == {0: b"image 0"} and not second.future.done()
        scheduler._on_message(engine, ("computed", batch1.id))
        scheduler._on_message(engine, ("done", batch1.id, [b"image 1"], ["applied"], 0.5, 0.1))
        assert (await second.future).results == {0: b"image 1"}
        assert engine.busy is None and engine.encoding == {} and scheduler.in_flight() == 0
        scheduler.task.cancel()

    asyncio.run(scenario())


def test_an_error_while_encoding_fails_that_batch_only():
    async def scenario():
        scheduler, engine, conn = await started()
        first, second = (submit(scheduler, seed) for seed in (0, 1))
        batch0 = await received(conn)
        scheduler._on_message(engine, ("computed", batch0.id))
        batch1 = await received(conn)
        scheduler._on_message(engine, ("error", batch0.id, "OSError: disk full"))
        with pytest.raises(ApiError, match="OSError: disk full"):
            await first.future
        assert engine.busy[0].id == batch1.id and not second.future.done()  # still computing
        scheduler._on_message(engine, ("error", batch1.id, "RuntimeError: out of memory"))  # its call failed
        with pytest.raises(ApiError, match="out of memory"):
            await second.future
        assert engine.busy is None and engine.encoding == {}
        scheduler.task.cancel()

    asyncio.run(scenario())


def test_an_engine_that_stops_fails_what_it_computes_and_what_it_encodes():
    async def scenario():
        scheduler, engine, conn = await started()
        scheduler.stopping = True  # no restart: this engine has no process to start
        first, second = (submit(scheduler, seed) for seed in (0, 1))
        batch0 = await received(conn)
        scheduler._on_message(engine, ("computed", batch0.id))
        await received(conn)
        scheduler._on_message(engine, ("stopped", -9))
        for item in (first, second):
            with pytest.raises(ApiError, match="engine 0 stopped") as error:
                await item.future
            assert error.value.status == 503
        assert engine.busy is None and engine.encoding == {} and scheduler.in_flight() == 0
        scheduler.task.cancel()

    asyncio.run(scenario())


def test_the_engine_says_computed_before_its_images_are_encoded():
    """The real engine loop (engine_main, here in this process's main thread on the tiny stock model): each batch's
    ("computed", id) comes before its ("done", id, ...), and a stop answers every batch computed before it."""
    import signal
    import threading

    from qwen_image_fast import FastConfig
    from qwen_image_fast.server.engine import EngineSpec, engine_main

    spec = EngineSpec(model="tiny-random", preset="baseline", config=FastConfig(), device="cpu")
    server_end, engine_end = multiprocessing.Pipe()
    messages = []
    reader = threading.Thread(target=lambda: messages.extend(iter(lambda: _recv(server_end), None)), daemon=True)
    reader.start()
    for i in range(2):
        server_end.send(Batch(id=i, width=64, height=64, steps=2, cfg=1.0, guidance_scale=None, loras=(),
                              works=(Work("a cat", None, i, "png", 100, {}), Work("a dog", None, 9, "webp", 90, {}))))
    server_end.send(None)
    sigint = signal.getsignal(signal.SIGINT)
    try:
        engine_main(engine_end, spec)
    finally:
        signal.signal(signal.SIGINT, sigint)
    engine_end.close()
    reader.join(10)
    order = [m[:2] for m in messages]
    assert order[0] == ("ready",) and sorted(order[1:]) == [("computed", 0), ("computed", 1), ("done", 0),
                                                            ("done", 1)], order
    assert all(order.index(("computed", i)) < order.index(("done", i)) for i in range(2)), order
    assert order.index(("done", 0)) < order.index(("done", 1)), order  # batches answered in the order computed
    for message in messages[1:]:
        if message[0] == "done":
            encoded = message[2]
            assert [data[:4] for data in encoded] == [b"\x89PNG", b"RIFF"], [data[:8] for data in encoded]


def _recv(conn):
    try:
        return conn.recv()
    except EOFError:
        return None
