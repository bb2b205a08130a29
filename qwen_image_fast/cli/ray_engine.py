"""`render --engine ray`: the jobs rendered by a pool of Ray actors (qwen_image_fast.ray.Renderer), one GPU each,
on the cluster at --ray-address (a local one started for the command without it), into the same folder, files and
manifest as the local render. This process is the manifest's only writer (records appended as they arrive, merged
at the end); resume, compare and the folder's rules are the local render's.
"""

import json
import os
import socket
import time
from pathlib import Path

from tqdm import tqdm

from .manifest import MANIFEST, append_line, drop_partial_last_line, merge_manifests, pending_jobs
from .output import remove_stale_temp_files
from .ray_stage import FORWARDED_ENV, Renderer, job_json
from .run import Summary

CONNECT_TIMEOUT_S = 5.0


def import_ray():
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


def connect(ray, address: str | None):
    """ray.init on the cluster at `address` (None: a new local one), the actors' environment forwarded."""
    env = {name: os.environ[name] for name in FORWARDED_ENV if name in os.environ}
    if address is not None:
        check_reachable(address)
    try:
        ray.init(address=address, runtime_env={"env_vars": env}, log_to_driver=False,
                 logging_level="ERROR", configure_logging=True)
    except ConnectionError as e:
        raise ValueError(f"--ray-address {address}: cannot connect ({e})") from None


def actor_count(ray, gpu: bool, workers: int | None, device_given: bool) -> int:
    """--workers, or one per GPU of the cluster (1 on CPUs). Refused: GPU actors on a cluster without GPUs, and
    CPU actors chosen only because this process has no GPU while the cluster has some (render's checks pick this
    process's device: the images would come from the CPU without anyone asking for it)."""
    gpus = int(ray.cluster_resources().get("GPU", 0))
    if gpu and gpus == 0:
        raise ValueError("--engine ray: the cluster has no GPU for the actors; add GPU nodes, or give --device cpu")
    if not gpu and gpus and not device_given:
        raise ValueError(f"--engine ray: this process has no GPU, so render's checks chose the CPU, but the cluster "
                         f"has {gpus} GPU(s): run the command on a node with a GPU, or give --device cpu to render "
                         "on CPUs")
    return workers or (gpus if gpu else 1)


def startup_line(started: float, connected: float, startups: list[dict], first_image: float | None) -> str:
    """Where a Ray command's time went before its first image, in seconds from the command's start: the cluster,
    the actors' start (their __init__) and pipeline loads (the first and last actor to have one), the first image."""
    line = f"Ray startup: cluster connected at {connected - started:.1f} s"
    if startups:
        inits, loads = sorted(s["init"] - started for s in startups), sorted(s["loaded"] - started for s in startups)
        line += (f"; {len(startups)} actor(s) began at {inits[0]:.1f}-{inits[-1]:.1f} s and had the pipeline at "
                 f"{loads[0]:.1f}-{loads[-1]:.1f} s (loading {min(s['loaded'] - s['init'] for s in startups):.1f} s "
                 "at the fastest)")
    if first_image is not None:
        line += f"; first image recorded at {first_image - started:.1f} s"
    return line


def render_on_ray(spec, jobs: list, out_dir: Path, labels, *, resume: bool, address: str | None,
                  workers: int | None, batch_size: int, device_given: bool, started: float) -> Summary:
    """Render the jobs not already done; returns the command's summary. On KeyboardInterrupt or an error of the
    stage, what was recorded is merged into the manifest first (the actors stop with this driver). started: the
    command's start (time.time()), for its startup line."""
    ray = import_ray()
    pending = pending_jobs(jobs, out_dir, spec.fmt, labels, resume)
    summary = Summary(skipped=len(jobs) - len(pending))
    if not pending:
        return summary
    connect(ray, address)
    connected, startups, first_image = time.time(), [], None
    gpu = spec.device != "cpu"
    try:
        workers = actor_count(ray, gpu, workers, device_given)
    except ValueError:
        ray.shutdown()
        raise
    manifest = out_dir / MANIFEST
    drop_partial_last_line(manifest)
    # one row a block: a retried task (its actor killed) redoes one row, never a block some of whose records were
    # already sent (the per-block overhead, milliseconds, is nothing beside an image's seconds)
    ds = ray.data.from_items([{"job": job_json(job)} for job in pending], override_num_blocks=len(pending))
    rendered = ds.map_batches(Renderer, fn_constructor_kwargs={"spec": spec}, batch_size=batch_size,
                              concurrency=workers, num_gpus=1 if gpu else 0, num_cpus=0 if gpu else 1,
                              max_restarts=-1, max_task_retries=-1)
    seen = set()
    try:
        with tqdm(total=len(pending), desc="images", unit="img") as bar:
            for batch in rendered.iter_batches(batch_size=None, batch_format="numpy"):
                for text in batch["record"]:
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
        ray.shutdown()
    print(startup_line(started, connected, startups, first_image), flush=True)
    merge_manifests(out_dir)
    remove_stale_temp_files(out_dir, jobs)
    return summary
