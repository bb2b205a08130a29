"""One engine: a process of its own that loads the pipeline on one device, warms it up, and runs batches (one
pipeline call each) sent down a pipe, answering each with its images encoded and what ran.

A batch's images are encoded (PNG / WebP / JPEG) on threads while the device computes the next batch: the engine
says ("computed", id) as soon as the pipeline call returns, so the server can send the next one, and ("done", id,
...) once the images are encoded. Encoding a 1024² image takes tens of ms of CPU (png.py, zlib and PIL release the
GIL while they compress), a batch of four several times that: serially, the device would wait for it after every
call.

A process, not a thread, so that a crash, an out-of-memory kill or kill -9 takes down one engine and not the
server: the server sees the pipe close, answers that engine's requests with 503 and starts it again (engines.py).

LoRAs stay unfused: every adapter is loaded once (those named at start, and the --lora-dir files when a request
first names them), and each batch sets the ones it asks for at its weights (set_adapters; disable_lora for none);
the base weights are never touched, so switching costs no reload.
"""

import io
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..cli.output import image_settings, png_texts, write_image
from . import png
from .protocol import OUTPUT_FORMATS


@dataclass(frozen=True)
class EngineSpec:
    """What an engine loads (picklable: it crosses to the spawned process)."""

    model: str
    preset: str
    config: object  # FastConfig
    device: str
    loras: tuple[tuple[str, str], ...] = ()  # (name, file) loaded at start
    lora_dir: str | None = None
    lightning: bool = False
    max_memory: float | None = None
    warm_up: dict = field(default_factory=dict)  # the pipeline call that warms it up (run_batch's settings)
    shrink_inputs: int | None = None  # a test-size edit model: condition images at 1/this of their area, as render
    # (module, function, kwargs) building a stock pipeline in place of loading `model` (bench_serve.py's random
    # full-size weights); the module must be importable in the engine (spawned engines get the server's sys.path)
    factory: tuple[str, str, dict] | None = None
    files: object = None  # cli.models.SingleFiles: --model FILE and its companions


@dataclass(frozen=True)
class Work:
    """One image of a batch: its text, seed, how to encode it, and the settings it records."""

    prompt: str
    negative_prompt: str | None
    seed: int
    output_format: str
    output_compression: int
    settings: dict


@dataclass(frozen=True)
class Batch:
    """One pipeline call: what every image of it shares, and the images."""

    id: int
    width: int | None
    height: int | None
    steps: int
    cfg: float
    guidance_scale: float | None
    loras: tuple[tuple[str, float], ...]
    works: tuple[Work, ...]
    step_cache: bool = True  # False: this call without the engine's step cache
    images: tuple[bytes, ...] = ()
    mask: bytes | None = None


class UploadedImage:
    """An uploaded input image, as run_batch takes cli.inputs.InputImage: load(mode), record()."""

    def __init__(self, data: bytes):
        import hashlib

        self.data, self.sha256 = data, hashlib.sha256(data).hexdigest()

    def load(self, mode: str):
        from PIL import Image

        with Image.open(io.BytesIO(self.data)) as image:
            return image.convert(mode)

    def record(self) -> dict:
        return {"sha256": self.sha256}


def encode(image, fmt: str, compression: int, settings: dict) -> bytes:
    """The image in `fmt` with its settings embedded as render embeds them (cli.output.write_image); a PNG by png.py
    (deflated on several threads: on a lone request's path, PIL's one thread took ~0.1-0.2 s at 1024²)."""
    if fmt == "png" and png.supports(image):
        return png.png_bytes(image, png_texts(settings))
    out = io.BytesIO()
    write_image(image, out, OUTPUT_FORMATS[fmt], settings, compression)  # RGBA asks for no JPEG (protocol.py)
    return out.getvalue()


class Encoder:
    """Encodes each computed batch's images on ENCODE_THREADS threads and sends its ("done", ...) (or ("error", ...)
    when an image cannot be encoded), batches in the order computed; every send of the engine goes through `send`
    (a pipe is not safe for two threads at once)."""

    ENCODE_THREADS = 4  # a batch's images at once (--max-batch 4 by default)

    def __init__(self, conn):
        self.conn, self.lock = conn, threading.Lock()
        self.images = ThreadPoolExecutor(self.ENCODE_THREADS, thread_name_prefix="encode")
        self.batches = ThreadPoolExecutor(1, thread_name_prefix="answer")  # one batch after another

    def send(self, message):
        with self.lock:
            self.conn.send(message)

    def finish(self, batch: Batch, images: list, applied: list, seconds: float):
        started = time.perf_counter()
        futures = [self.images.submit(encode, image, w.output_format, w.output_compression,
                                      image_settings(w.settings, None, applied))
                   for image, w in zip(images, batch.works)]
        self.batches.submit(self._answer, batch.id, futures, applied, seconds, started)

    def _answer(self, batch_id: int, futures: list, applied: list, seconds: float, started: float):
        try:
            encoded = [future.result() for future in futures]
        except Exception as e:
            traceback.print_exc()
            self.send(("error", batch_id, f"{type(e).__name__}: {e}"))
            return
        self.send(("done", batch_id, encoded, applied, seconds, time.perf_counter() - started))

    def close(self):
        """Answer every batch computed so far (its images are not lost to a stop), then stop the threads."""
        self.batches.shutdown(wait=True)
        self.images.shutdown(wait=True)


def load(spec: EngineSpec):
    import torch

    from ..cli.devices import cap_memory
    from ..cli.models import load_pipeline

    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cap_memory(spec.max_memory, device)
    stock = None
    if spec.factory is not None:
        import importlib

        module, function, kwargs = spec.factory
        stock = getattr(importlib.import_module(module), function)(**kwargs)
    pipe = load_pipeline(spec.model, spec.preset, spec.config, device, lightning=spec.lightning, stock=stock,
                         files=spec.files)
    for name, file in spec.loras:
        pipe.load_lora_weights(file, adapter_name=name)
    if spec.loras:
        pipe.disable_lora()
    return pipe


def set_loras(pipe, loras: tuple[tuple[str, float], ...], lora_dir: str | None):
    """The batch's adapters at their weights, loading a --lora-dir one the first time it is named."""
    from pathlib import Path

    loaded = set(pipe.get_list_adapters().get("transformer", [])) if hasattr(pipe, "get_list_adapters") else set()
    for name, _ in loras:
        if name not in loaded:
            try:
                pipe.load_lora_weights(str(Path(lora_dir) / f"{name}.safetensors"), adapter_name=name)
            except Exception as e:
                if name in pipe.get_list_adapters().get("transformer", []):  # what loaded of it goes
                    pipe.delete_adapters([name])
                raise ValueError(f"the LoRA {name!r} in the LoRA folder cannot be loaded ({type(e).__name__}: "
                                 f"{e})") from e
            loaded.add(name)
    if not loras:
        if loaded:
            pipe.disable_lora()
        return
    pipe.enable_lora()
    pipe.set_adapters([name for name, _ in loras], [weight for _, weight in loras])


def run(pipe, batch: Batch, lora_dir: str | None, config=None) -> list:
    """The batch's images (PIL), one pipeline call: cli.run.run_batch, the call render makes. config: the engine's
    FastConfig (None: the stock pipeline), its step cache dropped for a batch that asks so (as render's
    --compare-uncached runs its uncached pass)."""
    from ..cli.jobs import Job
    from ..cli.run import run_batch

    set_loras(pipe, batch.loras, lora_dir)
    if config is not None:
        pipe.fast_config = config if batch.step_cache else config.replace(cache=None)
    inputs = tuple(UploadedImage(data) for data in batch.images)
    jobs = [Job(index=i, id=None, prompt=w.prompt, negative_prompt=w.negative_prompt, seed=w.seed,
                width=batch.width, height=batch.height, steps=batch.steps, cfg=batch.cfg, images=inputs,
                mask=UploadedImage(batch.mask) if batch.mask is not None else None)
            for i, w in enumerate(batch.works)]
    extra = {} if batch.guidance_scale is None else {"guidance_scale": batch.guidance_scale}
    return run_batch(pipe, jobs, None, extra=extra)


def condition_images(shrink: int | None):
    """A test-size edit model's condition images shrunk as render shrinks them (pipelines/tiny.py), else as they are."""
    import contextlib

    if shrink is None:
        return contextlib.nullcontext()
    from ..pipelines.tiny import small_condition_images

    return small_condition_images(shrink)


def engine_main(conn, spec: EngineSpec):
    """The engine process: ("ready",) once loaded and warmed up (or ("failed", why)), then for each Batch
    received ("computed", id) when its pipeline call returns and then ("done", id, [bytes], applied, seconds: the
    call's, seconds from the call's end to its images encoded) once they are, or ("error", id, why) in place of
    either; None or a closed pipe ends it, after the batches computed so far are answered. Ctrl-C reaches the server's whole process group: the server
    drains, so an engine ignores SIGINT and ends when told."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        pipe = load(spec)
        config = getattr(pipe, "fast_config", None)
        if spec.warm_up:
            run(pipe, Batch(id=-1, loras=(), **spec.warm_up), spec.lora_dir, config)
        conn.send(("ready",))
    except Exception as e:
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    encoder = Encoder(conn)
    while True:
        try:
            batch = conn.recv()
        except EOFError:
            batch = None
        if batch is None:
            encoder.close()
            return
        t0 = time.perf_counter()
        try:
            with condition_images(spec.shrink_inputs):
                images = run(pipe, batch, spec.lora_dir, config)
            applied = list(getattr(pipe, "applied", []) or [])
        except Exception as e:
            traceback.print_exc()
            encoder.send(("error", batch.id, f"{type(e).__name__}: {e}"))
            continue
        encoder.send(("computed", batch.id))
        encoder.finish(batch, images, applied, time.perf_counter() - t0)
