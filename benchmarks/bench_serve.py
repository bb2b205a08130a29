"""The server under load (GPU): `qwen-image-fast serve`'s engines on random full-size weights, an async load
generator at several concurrencies, and the same work through pipe() in one process.

    python3 benchmarks/bench_serve.py --tokenizer DIR [--cases 1024-cfg4-50,512-cfg4-30,1024-lightning8]
        [--concurrency 1,4,16] [--rounds 2] [--engines N] [--max-batch 4] [--out DIR]
    python3 benchmarks/bench_serve.py --tiny            # CPU: the tiny model, stock preset, 64², 2 steps (logic)

For each server setting (the Lightning case needs its own: its scheduler), first the in-process reference:
bench_pipeline's full-size random stock pipeline converted by optimize() with the server's FastConfig, warmed up,
then IN_PROCESS_IMAGES single-image calls (seeds 0, 1, ...): in_process_s (median seconds an image) and
in_process_images_per_s. That pipeline is freed, and the server starts in a child process (this script with
--serve) with one engine per GPU, each building the same pipeline (EngineSpec.factory). Then per concurrency C: an
untimed batch of the round's size on each engine (its graphs captured); then ROUNDS x C x engines requests of one
image each (seed i; x engines, so that several engines are not measured mostly on their ramp-up and on a last batch
that keeps one busy while the others idle), C in flight at a time (closed loop, httpx.AsyncClient): images/s over
the wall time, p50 / p95 / p99 latency, the batch sizes the server ran, and from /metrics the mean queue wait, pipeline
call and encoding after it (what a request pays beyond the call). The check beside each timing: the
served image of seed 0 against the in-process one, equal pixel for pixel at C = 1 (the same call), and at least
BATCHED_MIN_PSNR dB where it ran in a batch; a row failing it is printed, not recorded. Each row is appended to
results/serve.jsonl as soon as it is measured (a run cut short keeps the rows it made).
Random weights: the speeds are those of the real shapes, the images are noise.
"""

import argparse
import asyncio
import base64
import collections
import gc
import io
import json
import os
import statistics
import subprocess
import sys
import time
from argparse import Namespace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import append_results, environment  # noqa: E402

CASES = {
    "1024-cfg4-50": dict(size=1024, steps=50, cfg=4.0, lightning=False),
    "512-cfg4-30": dict(size=512, steps=30, cfg=4.0, lightning=False),
    "1024-lightning8": dict(size=1024, steps=8, cfg=1.0, lightning=True),
}
TINY_CASES = {"64-cfg1-2": dict(size=64, steps=2, cfg=1.0, lightning=False)}
IN_PROCESS_IMAGES = 3  # 2 in the tiny run
BATCHED_MIN_PSNR = 40.0  # dB: an image rendered in a batch against the same one alone (a sanity bound)
PROMPT = "A red fox sitting in fresh snow at dawn, soft light, detailed fur, shallow depth of field"


def factory(tiny: bool, tokenizer: str | None) -> tuple[str, str, dict]:
    if tiny:
        return ("qwen_image_fast.pipelines.tiny", "tiny_pipeline", {})
    return ("bench_pipeline", "full_size_stock_pipeline", {"tokenizer_dir": tokenizer})


def preset(tiny: bool) -> str:
    """The tiny run serves the stock pipeline (seconds on the CPU; the fast one's kernels run in Triton's
    interpreter): its logic is the same."""
    return "baseline" if tiny else "fast"


def server_config():
    from qwen_image_fast import FastConfig

    return FastConfig()  # every default optimization, as `serve` runs without options


def in_process(args, case: dict, count: int) -> tuple[list[np.ndarray], float]:
    """The seeds 0 .. count-1 through one pipeline in this process: their images and the median
    seconds an image (after a warm-up call)."""
    import importlib

    import torch

    from qwen_image_fast.cli.jobs import NEGATIVE_PROMPT, Job
    from qwen_image_fast.cli.models import load_pipeline
    from qwen_image_fast.cli.run import run_batch

    device = torch.device("cpu" if args.tiny else "cuda")
    module, function, kwargs = factory(args.tiny, args.tokenizer)
    stock = getattr(importlib.import_module(module), function)(**kwargs)
    pipe = load_pipeline("tiny-random" if args.tiny else "random-full-size", preset(args.tiny), server_config(),
                         device, lightning=case["lightning"], stock=stock)

    def job(seed):
        return Job(index=0, id=None, prompt=PROMPT, negative_prompt=NEGATIVE_PROMPT if case["cfg"] > 1 else None,
                   seed=seed, width=case["size"], height=case["size"], steps=case["steps"], cfg=case["cfg"])

    run_batch(pipe, [job(99)], None)  # warm-up: graphs captured
    images, seconds = [], []
    for seed in range(count):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        images.append(np.asarray(run_batch(pipe, [job(seed)], None)[0].convert("RGB")))
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
    del pipe, stock
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return images, statistics.median(seconds)


def serve(settings: dict):
    """--serve: the server of these settings in this process (its engines are processes of their own)."""
    import torch

    from qwen_image_fast.cli.jobs import MIN_STEPS, NEGATIVE_PROMPT
    from qwen_image_fast.server.engine import EngineSpec, Work
    from qwen_image_fast.server.main import serve_forever
    from qwen_image_fast.server.metrics import Metrics
    from qwen_image_fast.server.protocol import Served
    from qwen_image_fast.server.scheduler import Scheduler

    tiny, case = settings["tiny"], settings["case"]
    devices = ["cpu"] if tiny else [f"cuda:{i}" for i in range(settings["engines"] or torch.cuda.device_count())]
    served = Served(model="random-full-size", pipeline="QwenImagePipeline", endpoint="generations",
                    default_size=(case["size"], case["size"]), max_side=2048, default_steps=case["steps"],
                    default_cfg=case["cfg"], default_negative=NEGATIVE_PROMPT, min_steps=MIN_STEPS,
                    guidance_embeds=False)
    warm_up = dict(width=case["size"], height=case["size"], steps=case["steps"], cfg=case["cfg"], guidance_scale=None,
                   works=(Work("warm-up", NEGATIVE_PROMPT if case["cfg"] > 1 else None, 99, "png", 100, {}),))
    specs = [EngineSpec(model="random-full-size", preset=preset(tiny), config=server_config(), device=d,
                        lightning=case["lightning"], warm_up=warm_up,
                        factory=factory(tiny, settings["tokenizer"])) for d in devices]
    scheduler = Scheduler(specs, settings["max_batch"], settings["max_wait_ms"] / 1000, 4096, Metrics())
    args = Namespace(request_timeout=3600.0, max_body_mb=64.0, drain_timeout=60.0, host="127.0.0.1",
                     port=settings["port"])
    serve_forever(args, served, scheduler, scheduler.metrics, dict(model="random-full-size", preset="fast"), None)


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


async def load(url: str, case: dict, concurrency: int, requests: int, seed0: int = 0) -> tuple[list, float]:
    """`requests` one-image requests (seed seed0 + i), `concurrency` in flight: [(seconds, answer)], wall seconds."""
    import httpx

    slots = asyncio.Semaphore(concurrency)

    async def one(client, seed):
        async with slots:
            t0 = time.perf_counter()
            answer = await client.post("/v1/images/generations", json=dict(
                prompt=PROMPT, seed=seed, size=f"{case['size']}x{case['size']}", num_inference_steps=case["steps"],
                true_cfg_scale=case["cfg"]))
            answer.raise_for_status()
            return time.perf_counter() - t0, answer.json()

    async with httpx.AsyncClient(base_url=url, timeout=3600) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(client, seed0 + i) for i in range(requests)))
        return results, time.perf_counter() - t0


def start_server(settings: dict, log: Path):
    import httpx

    process = subprocess.Popen([sys.executable, __file__, "--serve", json.dumps(settings)], stdout=open(log, "w"),
                               stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{settings['port']}"
    deadline = time.monotonic() + 1800
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(1)
    process.kill()
    raise SystemExit("the server was not ready within 30 minutes")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def decoded(b64: str) -> np.ndarray:
    from PIL import Image

    with Image.open(io.BytesIO(base64.b64decode(b64))) as image:
        return np.asarray(image.convert("RGB"))


def server_seconds(url: str) -> dict:
    """/metrics' running sums and counts of the queue-wait, compute and encode histograms."""
    import httpx

    samples = dict(line.rsplit(" ", 1) for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines()
                   if line and not line.startswith("#"))
    return {f"{name}_{part}": float(samples[f"qwen_image_fast_{name}_seconds_{part}"])
            for name in ("queue_wait", "compute", "encode") for part in ("sum", "count")}


def server_split(before: dict, after: dict) -> dict:
    """Where a round's time went on the server, from /metrics before and after it: mean seconds a request waited for
    its first batch, a pipeline call took, and its images took to encode after it."""
    def mean(name):
        count = after[f"{name}_count"] - before[f"{name}_count"]
        return (after[f"{name}_sum"] - before[f"{name}_sum"]) / count if count else None

    return dict(server_queue_wait_s=mean("queue_wait"), server_compute_s=mean("compute"),
                server_encode_s=mean("encode"))


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny model on the CPU (logic check; records nothing)")
    parser.add_argument("--tokenizer", default=None, help="a Qwen2.5 BPE tokenizer folder (real prompt lengths)")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--rounds", type=int, default=2,
                        help="requests per concurrency: ROUNDS x C x engines (at least 3)")
    parser.add_argument("--engines", type=int, default=0, help="engines (default: one per GPU)")
    parser.add_argument("--max-batch", type=int, default=4)
    parser.add_argument("--max-wait-ms", type=float, default=0.0, help="the server's (default 0, as serve's)")
    parser.add_argument("--port", type=int, default=0, help="the server's port (default 0: a free one)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--serve", default=None, help=argparse.SUPPRESS)  # the child process: a server
    args = parser.parse_args()
    if args.serve is not None:
        return serve(json.loads(args.serve))
    from qwen_image_fast.cli.compare import psnr

    cases = TINY_CASES if args.tiny else {name: CASES[name] for name in args.cases.split(",")}
    concurrencies = [1, 2] if args.tiny else [int(c) for c in args.concurrency.split(",")]
    env = {} if args.tiny else environment()
    recorded, log = 0, (args.out or Path("/tmp")) / "bench_serve_server.log"
    log.parent.mkdir(parents=True, exist_ok=True)  # an --out folder not made yet (the server's log goes there first)
    for name, case in cases.items():
        reference, in_process_s = in_process(args, case, 2 if args.tiny else IN_PROCESS_IMAGES)
        print(f"{name}: in process {in_process_s:.3f} s an image ({1 / in_process_s:.3f} images/s)", flush=True)
        settings = dict(tiny=args.tiny, case=case, engines=args.engines, max_batch=args.max_batch,
                        max_wait_ms=args.max_wait_ms, tokenizer=args.tokenizer, port=args.port or free_port())
        process, url = start_server(settings, log)
        engines = 1 if args.tiny else args.engines or gpu_count()
        try:
            for concurrency in concurrencies:
                # untimed: one batch of the round's size on each engine, so that its graphs are captured (an engine's
                # warm-up captures batch 1's; a batch of a new size runs its first step eagerly and captures then)
                asyncio.run(load(url, case, concurrency, min(concurrency, args.max_batch) * engines, seed0=10_000))
                before = server_seconds(url)
                results, wall = asyncio.run(load(url, case, concurrency,
                                                 max(args.rounds * concurrency * engines, len(reference))))
                split = server_split(before, server_seconds(url))
                latencies = [seconds for seconds, _ in results]
                batch_sizes = collections.Counter(size for _, answer in results for size in answer["batch_sizes"])
                checks = []
                for seed, expected in enumerate(reference):
                    got = decoded(results[seed][1]["data"][0]["b64_json"])
                    checks.append((results[seed][1]["batch_sizes"] == [1], psnr(got, expected),
                                   int(np.abs(got.astype(int) - expected.astype(int)).max())))
                passed = all((max_abs == 0) if alone else (value >= BATCHED_MIN_PSNR) for alone, value, max_abs in checks)
                row = dict(bench="serve", case=name, concurrency=concurrency, requests=len(results),
                           engines=args.engines or None, max_batch=args.max_batch, max_wait_ms=args.max_wait_ms,
                           images_per_s=len(results) / wall, p50_s=percentile(latencies, 50),
                           p95_s=percentile(latencies, 95), p99_s=percentile(latencies, 99),
                           batch_sizes=dict(sorted(batch_sizes.items())), in_process_s=in_process_s,
                           in_process_images_per_s=1 / in_process_s, **split,
                           check=[dict(alone=a, psnr=None if p == float("inf") else p, max_abs=m) for a, p, m in checks],
                           applied=results[0][1]["applied"])
                print(f"{name} C={concurrency:2d}: {row['images_per_s']:.3f} images/s (in process "
                      f"{row['in_process_images_per_s']:.3f}), p50 {row['p50_s']:.2f} s, p95 {row['p95_s']:.2f}, "
                      f"p99 {row['p99_s']:.2f}, batches {row['batch_sizes']}; server: queue wait "
                      f"{split['server_queue_wait_s']:.3f} s, call {split['server_compute_s']:.3f} s, encode "
                      f"{split['server_encode_s']:.3f} s (means); vs in process (alone, PSNR, max|d|) "
                      f"{checks}", flush=True)
                if passed and not args.tiny:
                    append_results("serve", [env | row], args.out)
                recorded += passed
                if not passed:
                    print(f"  FAILED the check (alone: equal; batched: >= {BATCHED_MIN_PSNR} dB): not recorded",
                          flush=True)
        finally:
            process.terminate()
            process.wait(120)
    if args.tiny:
        print(f"tiny run: {recorded} rows passed their checks (not recorded)", flush=True)


if __name__ == "__main__":
    main()
