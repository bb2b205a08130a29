"""`render --engine ray` against the local render (issue 46): the same prompts and seeds, each run the command as a
user runs it (a fresh process: model load and, for Ray, the cluster's start included), its images checked equal to
the reference run's pixel for pixel before any time is kept.

    python3 benchmarks/bench_ray.py --gpus 1              # one GPU: --engine ray (1 worker) against the local render
    python3 benchmarks/bench_ray.py --gpus 2              # two GPUs: --engine ray with 2 workers against 1
    python3 benchmarks/bench_ray.py --tiny                # CPU logic check (tiny-random), nothing recorded
    python3 benchmarks/bench_ray.py --gpus 1 --cluster started   # the Ray runs on a cluster started before them
    python3 benchmarks/bench_ray.py --gpus 2 --work DIR --only reference   # the two runs in two calls (each run's
    python3 benchmarks/bench_ray.py --gpus 2 --work DIR --only other       # images and seconds kept in DIR between)

Weights: random at the real size (compare_stock_vs_fast.save_random_checkpoint: the full-size transformer and VAE,
a tiny text encoder), saved once to --checkpoint-dir; 1024x1024, 50 steps, CFG 4, the fast preset. images_per_s =
prompts / wall seconds of the whole command. Rows to results/ray.jsonl (bench "ray": engine, gpus, workers,
prompts, images_per_s, seconds, ratio to the reference run). Beside the whole command's rate, each row splits it in
two from the images' file times: first_image_s (start to the first image: cluster, actor, model load, warm-up, one
image; first_call_s, the pipeline call that made it, from its manifest record) and steady_images_per_s (the pool at work: the sum over workers of (images - 1) / (last - first image)); a
Ray row also carries its `Ray startup:` line's times (startup_*_s: checks done, cluster connected, first actor
begun, first pipeline loaded).
--cluster: "command" (default), each Ray run starts its own local cluster (a user's first try); "started", a head
node started before the runs (`ray start --head`, as on a real cluster) and connected to once (start_cluster: ready)
that they connect to (--ray-address), its start not timed (the row's "cluster" field says which).
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import append_results, environment  # noqa: E402

TINY_ARGS = ["--model", "tiny-random", "--device", "cpu", "--preset", "baseline", "--width", "32", "--height", "32",
             "--steps", "2"]


def real_args(checkpoint: Path) -> list[str]:
    return ["--model", str(checkpoint), "--width", "1024", "--height", "1024", "--steps", "50", "--cfg", "4"]


def run(label: str, args: list[str], prompts: Path, out: Path) -> dict:
    """The command's wall seconds and its timeline (timeline()); exits on failure with its output's tail."""
    command = [sys.executable, "-m", "qwen_image_fast", "render", *args, "--prompts", str(prompts), "--out", str(out)]
    start, start_epoch = time.perf_counter(), time.time()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"{label} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    first_image_s, steady, first_call_s = timeline(out, start_epoch)
    print(f"{label}: {seconds:.1f} s; first image at {first_image_s:.1f} s (its call {first_call_s:.1f} s, begun at "
          f"{first_image_s - first_call_s:.1f} s), then {steady:.4f} images/s; "
          f"{done.stdout.strip().splitlines()[-2 if 'note:' in done.stdout else -1]}", flush=True)
    startup = {}
    for line in done.stdout.splitlines():
        if line.startswith("Ray startup:"):  # where a Ray command's time went before its first image
            print(f"  {line}", flush=True)
            startup = startup_fields(line)
    return {"seconds": seconds, "first_image_s": first_image_s, "first_call_s": first_call_s,
            "steady_images_per_s": steady, **startup}


def startup_fields(line: str) -> dict:
    """The `Ray startup:` line's seconds (from the command's start) as row fields: the checks done, Ray connected,
    the first actor begun (its own checks included) and the first to have its pipeline."""
    found = re.search(r"checks done at ([\d.]+) s; Ray imported at [\d.]+ s and cluster connected at ([\d.]+) s.*?"
                      r"actor\(s\) began at ([\d.]+)-[\d.]+ s and had the pipeline at ([\d.]+)-", line)
    if found is None:
        return {}
    names = ("startup_checks_done_s", "startup_connected_s", "startup_actor_began_s", "startup_pipeline_s")
    return dict(zip(names, (float(x) for x in found.groups())))


def timeline(out: Path, start_epoch: float) -> tuple[float, float, float]:
    """(seconds from the command's start to its first image file, the steady rate: the sum over workers (the
    records' "worker"; the local render is one) of (images - 1) / (last - first image's file time), and the first
    image's own call: its record's "seconds", the pipeline call that made it, warm-up work of a first call
    included)."""
    times: dict = {}
    first = (float("inf"), None)
    for line in (out / "manifest.jsonl").read_text().splitlines():
        record = json.loads(line)
        mtime = (out / record["file"]).stat().st_mtime
        times.setdefault(record.get("worker", 0), []).append(mtime)
        first = min(first, (mtime, record["seconds"]))
    steady = sum((len(t) - 1) / (max(t) - min(t)) for t in times.values() if len(t) > 1)
    return min(min(t) for t in times.values()) - start_epoch, steady, first[1]


def start_cluster(temp: Path, *options: str) -> tuple[str, subprocess.Popen]:
    """A head node on loopback (`ray start --head --block`, its own temporary folder; `options`: more of `ray start`'s,
    e.g. "--num-cpus", "2"), with a token of its own in this process's environment, which the commands inherit
    (tests/cli/test_render_ray.py's cluster too); (its address, its process, killed with its group), once it has taken
    a connection. RuntimeError if it does not start."""
    import secrets
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16), RAY_USAGE_STATS_ENABLED="0",
                      RAY_NODE_IP_ADDRESS="127.0.0.1")
    head = subprocess.Popen([sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
                             "--node-ip-address", "127.0.0.1", "--port", str(port), "--include-dashboard", "false",
                             "--temp-dir", str(temp), "--disable-usage-stats", *options], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if head.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the Ray head node did not start") from None
            time.sleep(0.2)
    # the GCS port answers seconds before the node's raylet has registered, and the first ray.init waits for that
    # (it polls each second): one connection made here, as any earlier job on a running cluster would have made it
    ready = subprocess.run([sys.executable, "-c", f"import ray; ray.init(address='127.0.0.1:{port}', "
                            "log_to_driver=False, logging_level='ERROR'); ray.shutdown()"], capture_output=True)
    if ready.returncode != 0:
        os.killpg(head.pid, 9)
        raise RuntimeError(f"the Ray head node did not take a connection: {ready.stderr.decode()[-500:]}")
    return f"127.0.0.1:{port}", head


def same_images(a: Path, b: Path, n: int) -> bool:
    names = sorted(p.name for p in a.glob("*.png"))
    return len(names) == n and names == sorted(p.name for p in b.glob("*.png")) and all(
        np.array_equal(np.asarray(Image.open(a / name)), np.asarray(Image.open(b / name))) for name in names)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpus", type=int, choices=(1, 2), default=1)
    parser.add_argument("--prompts", type=int, help="default 16 on one GPU, 32 on two (4 with --tiny)")
    parser.add_argument("--checkpoint-dir", type=Path, default=Path("/tmp/qwen-image-random-full-size"))
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--work", type=Path, help="keeps each run's images and seconds (seconds.json), so that "
                        "--only can make the two runs in two calls; default a temporary folder")
    parser.add_argument("--only", choices=("reference", "other"),
                        help="make one run; the other's images and seconds are read from --work when kept there")
    parser.add_argument("--cluster", choices=("command", "started"), default="command",
                        help="command: each Ray run starts a local cluster; started: one started before the runs")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/results)")
    parser.add_argument("--warm-up", action="store_true",
                        help="first an untimed local render of one prompt, so that both timed runs find the same "
                        "on-disk caches (compiled kernels) instead of the first run filling them for the second")
    args = parser.parse_args()
    if args.only and not args.work:
        parser.error("--only needs --work (where the other run's images and seconds are kept)")
    n = args.prompts or (4 if args.tiny else 16 * args.gpus)
    if args.tiny:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        common = TINY_ARGS
    else:
        from compare_stock_vs_fast import save_random_checkpoint

        common = real_args(save_random_checkpoint(args.checkpoint_dir))
    head, temp = None, Path(tempfile.mkdtemp(prefix="/tmp/qif-bench-ray-"))  # short: Ray's socket paths
    if args.warm_up:
        (temp / "warm.txt").write_text("a warm-up prompt\n")
        warm = run("warm-up (untimed)", common, temp / "warm.txt", temp / "warm")
        print(f"warm-up: {warm['seconds']:.1f} s", flush=True)
    if args.cluster == "started":
        try:
            address, head = start_cluster(temp)
        except RuntimeError as e:
            sys.exit(str(e))
    on_ray = ["--engine", "ray"] + (["--ray-address", address] if head is not None else [])
    if args.gpus == 1:  # the local render, then Ray with one worker
        runs = [("local", 1, common), ("ray", 1, [*common, *on_ray, "--workers", "1"])]
    else:  # Ray with one worker, then two
        runs = [("ray", 1, [*common, *on_ray, "--workers", "1"]), ("ray", 2, [*common, *on_ray, "--workers", "2"])]
    try:
        seconds, work_done = measure(args, runs, n)
    finally:
        if head is not None:
            os.killpg(head.pid, 9)
            head.wait()
        shutil.rmtree(temp, ignore_errors=True)
    if not work_done:
        return
    labels = [f"{engine} x{workers}" for engine, workers, _ in runs]
    reference = seconds[labels[0]]
    calls = "two calls on one machine (--only)" if args.only else "one call"
    rows = [dict(environment(), bench="ray", engine=engine, gpus=args.gpus, workers=workers, cluster=args.cluster,
                 **seconds[label], images_per_s=n / seconds[label]["seconds"],
                 vs_reference=reference["seconds"] / seconds[label]["seconds"],
                 steady_vs_reference=seconds[label]["steady_images_per_s"] / reference["steady_images_per_s"],
                 reference=labels[0], calls=calls, warm_up=args.warm_up,
                 config="1024x1024, 50 steps, cfg 4, fast preset, random full-size weights")
            for (engine, workers, _), label in zip(runs, labels)]
    for row in rows:
        print(f"{row['engine']} x{row['workers']}: {row['images_per_s']:.3f} images/s ({row['vs_reference']:.2f}x "
              f"{row['reference']}); steady {row['steady_images_per_s']:.4f} images/s "
              f"({row['steady_vs_reference']:.2f}x); first image at {row['first_image_s']:.1f} s", flush=True)
    if not args.tiny:
        append_results("ray", rows, args.out)


def measure(args, runs: list, n: int) -> tuple[dict, bool]:
    """Each run's seconds (kept in --work's seconds.json across calls), and whether both runs are there with equal
    images (exits when they differ)."""
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        prompts = work / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"prompt": f"a photo, number {i}", "id": f"p{i}"}) + "\n"
                                   for i in range(n)))
        kept = work / "seconds.json"
        seconds = json.loads(kept.read_text()) if kept.exists() else {}
        for role, (engine, workers, run_args) in zip(("reference", "other"), runs):
            label = f"{engine} x{workers}"
            if args.only not in (None, role):
                continue
            out = work / f"{engine}{workers}"
            shutil.rmtree(out, ignore_errors=True)  # a fresh run: render would resume a kept folder, rendering none
            seconds[label] = {**run(label, run_args, prompts, out), "prompts": n}
            kept.write_text(json.dumps(seconds))
        labels = [f"{engine} x{workers}" for engine, workers, _ in runs]
        if any(seconds.get(label, {}).get("prompts") != n for label in labels):
            print(f"kept in {work}: {sorted(seconds)}; a row needs both runs of {n} prompts", flush=True)
            return seconds, False
        (ref_engine, ref_workers, _), (engine, workers, _) = runs
        same = same_images(work / f"{ref_engine}{ref_workers}", work / f"{engine}{workers}", n)
        print(f"check: the {n} images of {labels[1]} equal {labels[0]}'s pixel for pixel: {same}", flush=True)
        if not same:
            print("FAILED the check: no row recorded", flush=True)
            sys.exit(1)
    return seconds, True


if __name__ == "__main__":
    main()
