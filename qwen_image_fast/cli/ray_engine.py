"""`render --engine ray`: the jobs rendered by a pool of Ray actors (ray_stage.GatedRenderer, a
qwen_image_fast.ray.Renderer), one GPU each, on the cluster at --ray-address (a local one started for the command
without it), into the same folder, files and manifest as the local render. This process is the manifest's only
writer (records appended as they arrive, merged at the end); resume, compare and the folder's rules are the local
render's.

The stage starts as soon as the cluster is connected, beside the command's own checks (Connecting): the actors'
process start, imports and model load (tens of seconds at the real size) overlap the checks, and their rows wait at
a gate until the checks are done and the pending jobs known (render_on_ray opens it). A check that fails stops the
cluster's work before any actor has written anything.
"""

import asyncio
import json
import logging
import os
import queue
import signal
import socket
import threading
import time
from pathlib import Path

from tqdm import tqdm

from .manifest import MANIFEST, append_line, drop_partial_last_line, merge_manifests, pending_jobs
from .output import remove_stale_temp_files
from .ray_stage import FORWARDED_ENV, GatedRenderer, job_json
from .run import Summary

CONNECT_TIMEOUT_S = 5.0


def import_ray():
    # Ray Data's console logs (each dataset's start, plan and progress at INFO) would print beside the command's
    # own lines on stderr, a bad input's one line among them: warnings and errors only, unless the user chose a level
    os.environ.setdefault("RAY_DATA_LOG_LEVEL", "WARNING")
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError:
        raise ValueError("--engine ray needs Ray Data: pip install 'qwen-image-fast[ray]'") from None
    return ray


def check_reachable(address: str):
    """--ray-address HOST:PORT (a head node's GCS port): refused at once, in one line, if nothing listens there,
    instead of Ray's own minutes of retries. "auto" and ray://HOST:PORT (Ray Client) are left to ray.init."""
    if address == "auto" or address.startswith("ray://"):
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--ray-address {address!r}: give auto, HOST:PORT (a head node's address) or ray://HOST:PORT")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise ValueError(f"--ray-address {address}: no Ray head node reachable there ({e.strerror or e}); start one "
                         "with `ray start --head`, or leave --ray-address out for a local cluster") from None


def without_sigterm_warning(record: logging.LogRecord) -> bool:
    """ray.init from the connecting thread warns that it cannot put its SIGTERM handler there; Connecting keeps the
    command's own (wait()), so the warning would only add a line to stderr, at times after a bad input's one line."""
    return "SIGTERM handler is not set" not in record.getMessage()


def connect(ray, address: str | None):
    """ray.init on the cluster at `address` (None: a new local one; check_reachable passed), the actors' environment
    forwarded."""
    env = {name: os.environ[name] for name in FORWARDED_ENV if name in os.environ}
    logging.getLogger("ray._private.worker").addFilter(without_sigterm_warning)  # once per process: the same object
    try:
        ray.init(address=address, runtime_env={"env_vars": env}, log_to_driver=False,
                 logging_level="ERROR", configure_logging=True)
    except ConnectionError as e:
        raise ValueError(f"--ray-address {address}: cannot connect ({e})") from None


class Connecting:
    """The cluster, connected in a thread begun before render's checks (the model's files, the GPU's memory, the
    output folder): ray.init takes seconds (about 7 s on an H200 host, a new local cluster).
    Once connected, the same thread starts the stage (launch: its actors check and load while the command checks).
    The thread stays until close(): a local cluster's processes are its children, started with a parent-death
    signal that fires when the thread that started them ends. Ray's core worker in this process puts its crash
    handler on SIGTERM (a stack dump on stderr, then the previous handler); wait(), on the command's thread, puts
    back the handler there was (the CLI's: 143, one line, what was recorded kept)."""

    def __init__(self, address: str | None, launch=None):
        if address is not None:
            check_reachable(address)  # a wrong address is refused before anything else runs
        self.address, self.launch, self.began = address, launch, time.time()
        # Ray Data imported here, before the thread: beside the checks' imports (torch, diffusers) in the command's
        # thread, the two took turns on the GIL and Ray's import, the first step to the actors' start, took 6 s on
        # an H200 host (2026-11-28) where alone it takes about 1 s; the checks wait for it instead (not the
        # first image's path: the actors load for longer than the checks take)
        ray = import_ray()
        self.imported = time.time()
        self.sigterm = signal.getsignal(signal.SIGTERM)  # None: not set from Python
        self.ray, self.stage, self.error, self.connected = None, None, None, None
        self.ready, self.closed = threading.Event(), threading.Event()
        threading.Thread(target=self._connect, args=(ray,), name="ray-connect", daemon=True).start()

    def _connect(self, ray):
        try:
            connect(ray, self.address)
            self.ray, self.connected = ray, time.time()
            if self.launch is not None:
                self.stage = self.launch(ray)
        except BaseException as e:  # raised in the command's thread, by wait()
            self.error = e
        finally:
            self.ready.set()
        self.closed.wait()  # the local cluster's processes live as long as this thread

    def wait(self):
        """The stage launch() started (Ray itself without launch), connected (the connection's or the launch's
        error, if one failed); SIGTERM's handler as it was before."""
        self.ready.wait()
        if self.sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self.sigterm)
        if self.error is not None:
            raise self.error
        return self.stage if self.launch is not None else self.ray

    def close(self):
        """Disconnects (a local cluster started for the command stops, and with it a stage still running)."""
        self.ready.wait()
        if self.ray is not None:
            # a stage still running (a check failed, Ctrl-C) has Ray Data's executor in its own thread, which then
            # logs, with tracebacks, that Ray is gone: after the command's last line, and nothing the command did
            logging.getLogger("ray.data").setLevel(logging.CRITICAL)
            self.ray.shutdown()
        self.closed.set()


def start_gate(ray):
    """The actor the stage's rows wait at: take(indexes) returns (the command's RenderSpec, per index its pending
    job as JSON or None) once open(spec, jobs) was called; until then it waits (an async actor: the waiting calls
    hold no thread)."""

    @ray.remote(num_cpus=0)
    class Gate:
        def __init__(self):
            self.opened, self.spec, self.jobs = asyncio.Event(), None, {}

        async def open(self, spec, jobs: dict):
            self.spec, self.jobs = spec, jobs
            self.opened.set()

        async def take(self, indexes: list[int]):
            await self.opened.wait()
            return self.spec, [self.jobs.get(i) for i in indexes]

    return Gate.remote()


class Stage:
    """The render stage, running: its gate, and the records its actors return, read into `records` by a thread
    (a list of JSON strings per batch; an exception of the stage; None when it has ended)."""

    def __init__(self, ray, gate, rendered, *, gpus: int, device_given: bool):
        self.ray, self.gate, self.records = ray, gate, queue.Queue()
        self.gpus, self.device_given = gpus, device_given  # the cluster's GPUs; whether --device chose the actors'
        threading.Thread(target=self._read, args=(rendered,), name="ray-records", daemon=True).start()

    def _read(self, rendered):
        try:
            for batch in rendered.iter_batches(batch_size=None, batch_format="numpy"):
                self.records.put(list(batch["record"]))
            self.records.put(None)
        except BaseException as e:  # a failed stage, or the cluster shut down under it (the command is ending)
            self.records.put(e)

    def open(self, spec, pending: list):
        """The command's checks are done: its spec and the pending jobs, by index, to the actors."""
        self.ray.get(self.gate.open.remote(spec, {job.index: job_json(job) for job in pending}))

    def batches(self):
        """The records, batch by batch, until the stage ends (its error raised here)."""
        while True:
            try:
                item = self.records.get(timeout=0.5)  # a timeout: signals reach the command's thread meanwhile
            except queue.Empty:
                continue
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


def launch_stage(ray, options: list[str], rows: int, device: str | None, workers: int | None,
                 batch_size: int) -> Stage:
    """The stage over `rows` prompts (the command's options, given to each actor to check and load as the command
    does), started: its actors begin at once, their rows wait at the gate. device: --device; without it the actors
    take the cluster's GPUs where it has some, which render's checks confirm (check_actors_device: this process
    chose CUDA too) before the gate opens. torch is not imported here: on an H200 host its import and CUDA's start
    took seconds, all of them ahead of the actors' start."""
    gpus = int(ray.cluster_resources().get("GPU", 0))
    gpu = actors_on_gpus(gpus, device)
    workers = actor_count(gpus, gpu, workers, device is not None)
    gate = start_gate(ray)
    # one row a block: a retried task (its actor killed) redoes one row, never a block some of whose records were
    # already sent (the per-block overhead, milliseconds, is nothing beside an image's seconds). The blocks made
    # here, not by read tasks (ray.data.range): those would wait for CPUs the actors hold on a CPU cluster.
    ds = ray.data.from_items([{"id": i} for i in range(rows)], override_num_blocks=rows)
    # a fixed pool; Ray Data (>= 2.60) runs its actors with max_restarts=-1 and max_task_retries=-1: an actor killed
    # mid-batch is restarted and its batch retried (tests/cli/test_render_ray.py kills one)
    rendered = ds.map_batches(GatedRenderer, fn_constructor_kwargs=dict(options=options, cwd=os.getcwd(), gate=gate),
                              batch_size=batch_size, compute=ray.data.ActorPoolStrategy(size=workers),
                              num_gpus=1 if gpu else 0, num_cpus=0 if gpu else 1)
    return Stage(ray, gate, rendered, gpus=gpus, device_given=device is not None)


def actors_on_gpus(gpus: int, device: str | None) -> bool:
    """Whether the stage's actors ask for a GPU: --device's kind, else whether the cluster has GPUs (render's checks,
    choosing CUDA where this process has it, are held to the same choice by check_actors_device)."""
    return device.partition(":")[0] == "cuda" if device is not None else gpus > 0


def check_actors_device(gpus: int, device_given: bool, device: str):
    """render's checks chose `device` ("cuda" / "cpu") for the rows: actor_count's refusals again, with that choice;
    past them, it is the one actors_on_gpus made for the actors."""
    actor_count(gpus, device == "cuda", None, device_given)


def actor_count(gpus: int, gpu: bool, workers: int | None, device_given: bool) -> int:
    """--workers, or one per GPU of the cluster (`gpus`, as Ray counts them; 1 on CPUs). Refused: GPU actors on a
    cluster without GPUs, and CPU actors chosen only because this process has no GPU while the cluster has some
    (render's checks pick this process's device: the images would come from the CPU without anyone asking)."""
    if gpu and gpus == 0:
        raise ValueError("--engine ray: the cluster has no GPU for the actors; add GPU nodes, or give --device cpu")
    if not gpu and gpus and not device_given:
        raise ValueError(f"--engine ray: this process has no GPU, so render's checks chose the CPU, but the cluster "
                         f"has {gpus} GPU(s): run the command on a node with a GPU, or give --device cpu to render "
                         "on CPUs")
    return workers or (gpus if gpu else 1)


def startup_line(started: float, connection: dict, startups: list[dict], first_image: float | None) -> str:
    """Where a Ray command's time went before its first image, in seconds from the command's start: the connection
    (Connecting's times: it began, Ray imported, connected; checked, when the command's checks were done and it
    began to wait), the actors' start (their __init__) and pipeline loads (the first and last actor to have one),
    the first image."""
    line = (f"Ray startup: checks done at {connection['checked'] - started:.1f} s; Ray imported at "
            f"{connection['imported'] - started:.1f} s and cluster connected at {connection['connected'] - started:.1f}"
            f" s (begun at {connection['began'] - started:.1f} s)")
    if startups:
        inits, loads = sorted(s["init"] - started for s in startups), sorted(s["loaded"] - started for s in startups)
        line += (f"; {len(startups)} actor(s) began at {inits[0]:.1f}-{inits[-1]:.1f} s and had the pipeline at "
                 f"{loads[0]:.1f}-{loads[-1]:.1f} s (loading {min(s['loaded'] - s['init'] for s in startups):.1f} s "
                 "at the fastest)")
    if first_image is not None:
        line += f"; first image recorded at {first_image - started:.1f} s"
    return line


def render_on_ray(spec, jobs: list, out_dir: Path, labels, *, resume: bool, connection: Connecting,
                  started: float) -> Summary:
    """Render the jobs not already done with the stage `connection` started (closed when done); returns the
    command's summary. On KeyboardInterrupt or an error of the stage, what was recorded is merged into the manifest
    first (the actors stop with this driver). started: the command's start (time.time()), for its startup line."""
    checked = time.time()
    pending = pending_jobs(jobs, out_dir, spec.fmt, labels, resume)
    summary = Summary(skipped=len(jobs) - len(pending))
    if not pending:
        connection.close()
        return summary
    try:
        stage = connection.wait()
        check_actors_device(stage.gpus, stage.device_given, spec.device)
    except BaseException:  # no cluster, one without what the render needs, or a stage that could not start
        connection.close()
        raise
    times = dict(began=connection.began, imported=connection.imported, connected=connection.connected,
                 checked=checked)
    startups, first_image = [], None
    manifest = out_dir / MANIFEST
    drop_partial_last_line(manifest)
    seen = set()
    try:
        stage.open(spec, pending)
        with tqdm(total=len(pending), desc="images", unit="img") as bar:
            for batch in stage.batches():
                for text in batch:
                    record = json.loads(str(text))
                    if "startup" in record:
                        startups.append(record.pop("startup"))
                    if record["file"] in seen:  # a retried row's second record: the first was kept
                        continue
                    seen.add(record["file"])
                    bar.update()
                    if "failed" in record:
                        summary.failed += 1
                        tqdm.write(f"failed: {record['file']}: {record['failed']}")
                        continue
                    found = record.pop("found", False)
                    first_image = first_image or (None if found else time.time())
                    append_line(manifest, record)
                    summary.skipped += found
                    summary.written += not found
                    summary.seconds += 0 if found else record["seconds"]  # s/image: an image's render, as locally
                    summary.applied = tuple(record.get("applied", ()))
    except BaseException:  # Ctrl-C, SIGTERM, or the stage failed: what was recorded goes into the manifest first
        merge_manifests(out_dir)
        raise
    finally:
        connection.close()
    print(startup_line(started, times, startups, first_image), flush=True)
    merge_manifests(out_dir)
    remove_stale_temp_files(out_dir, jobs)
    return summary
