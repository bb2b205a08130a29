"""The GPU test suite in parts, and its record: one row per full run in results/gpu_tests.jsonl.

    python3 benchmarks/gpu_tests.py run --of 4 --shards 1,2 --out DIR     # on the GPU machine
    python3 benchmarks/gpu_tests.py record DIR [DIR ...]                  # once every part's report is in the DIRs
    python3 benchmarks/gpu_tests.py run --tiny --out DIR                  # CPU: 2 parts of tests/test_package.py

`run` starts each part (`pytest -m gpu --gpu-shard K/N`, tests/conftest.py) as its own process at once, part i on
GPU i % (GPUs) (CUDA_VISIBLE_DEVICES lists that GPU first and then the others, so the two-GPU tests still see two);
each writes DIR/shard-K-of-N.json (every test's outcome, duration, skip reason) and .log, and DIR/meta.json says
where it ran. The whole suite (~560 tests, ~16 minutes on one H200) does not fit one 10-minute GPU run; in four parts
two at a time on two GPUs, each run takes about a quarter of it. `record` merges the parts of one N (all of them
must be there: a partial run is not a full run) and appends date, commit, GPU, passed, failed, skipped with their
reasons, and the failures.
"""

import argparse
import collections
import datetime
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, append_results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# Packages of the test extra that GPU tests import inside a test (not at collection): a machine without one errors
# in those tests minutes into a run (gguf, 2026-11-28), so `run` refuses to start without them.
GPU_TEST_PACKAGES = {"diffusers": "every comparison with stock", "peft": "the LoRA tests",
                     "gguf": "the GGUF single files (test_single_file.py)",
                     # the FP8-attention extras: without them those tests skip or fail (2026-11-28, a run that
                     # had installed FA4 alone)
                     "cudnn": "FP8 attention's cuDNN kernel (pip install '.[fp8-attention]')",
                     "flash_attn_interface": "FP8 attention's FA3 kernel (pip install '.[fp8-attention-fa3]')"}


def missing_packages(packages: dict) -> list[str]:
    return [f"{name} ({why})" for name, why in packages.items() if importlib.util.find_spec(name) is None]


def run(args) -> int:
    import torch

    missing = [] if args.tiny else missing_packages(GPU_TEST_PACKAGES)
    if missing:
        print(f"gpu_tests.py run: not installed here: {', '.join(missing)}; install them and run again",
              file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    gpus = list(range(torch.cuda.device_count())) or [None]
    meta = dict(gpu=torch.cuda.get_device_name() if gpus[0] is not None else "cpu", gpus=len(gpus) if gpus[0]
                is not None else 0, torch=torch.__version__, commit=os.environ.get("BENCH_COMMIT"),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                pytest_args=args.pytest_args)
    (args.out / "meta.json").write_text(json.dumps(meta))
    select = ["tests/test_package.py"] if args.tiny else ["-m", "gpu", "tests"]
    procs = []
    for i, k in enumerate(args.shards):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if gpus[0] is not None:
            home = gpus[i % len(gpus)]
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in [home] + [g for g in gpus if g != home])
        name = f"shard-{k}-of-{args.of}"
        log = open(args.out / f"{name}.log", "w")
        command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *select,
                   f"--gpu-shard={k}/{args.of}", f"--report-json={args.out / name}.json", *args.pytest_args]
        procs.append((name, subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT),
                      time.perf_counter()))
    worst = 0
    for name, proc, t0 in procs:
        code = proc.wait()
        print(f"{name}: exit {code} after {time.perf_counter() - t0:.0f} s", flush=True)
        worst = max(worst, code if code != 5 else 0)  # 5: no test in this part
    return worst


def record(args) -> dict:
    """Merge the reports of one full run (DIRs: the parts may have come back in several) and append its row."""
    reports, meta = {}, None
    for folder in args.dirs:
        for path in sorted(folder.glob("shard-*-of-*.json")):
            reports[path.stem] = json.loads(path.read_text())
        if (folder / "meta.json").exists():
            meta = json.loads((folder / "meta.json").read_text())
    totals = {int(name.rsplit("-", 1)[1]) for name in reports}
    if len(totals) != 1:
        raise SystemExit(f"reports of {sorted(totals) or 'no'} part counts in {args.dirs}: one full run at a time")
    n = totals.pop()
    missing = sorted(set(range(1, n + 1)) - {int(name.split("-")[1]) for name in reports})
    if missing:
        raise SystemExit(f"parts {missing} of {n} have no report: not a full run")
    tests = {nodeid: t for report in reports.values() for nodeid, t in report["tests"].items()}
    counts = collections.Counter(t["outcome"] for t in tests.values())
    reasons = collections.Counter(t.get("reason", "") for t in tests.values() if t["outcome"] == "skipped")
    row = dict(bench="gpu_tests", date=(meta or {}).get("date"), commit=(meta or {}).get("commit"),
               gpu=(meta or {}).get("gpu"), gpus=(meta or {}).get("gpus"), torch=(meta or {}).get("torch"), parts=n,
               pytest_args=(meta or {}).get("pytest_args"), note=args.note,
               passed=counts["passed"], failed=counts["failed"] + counts["error"], skipped=counts["skipped"],
               skipped_reasons=dict(reasons), test_seconds=round(sum(t["duration_s"] for t in tests.values()), 1),
               failures={nodeid: t.get("message", "")[-400:] for nodeid, t in tests.items()
                         if t["outcome"] in ("failed", "error")})
    print(json.dumps(row, indent=1))
    if not args.dry_run:
        append_results("gpu_tests", [row])
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("--of", type=int, default=4, help="parts of the suite (N)")
    r.add_argument("--shards", default=None, help="which parts to run now, comma-separated (default: all N)")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--tiny", action="store_true", help="CPU: the parts of tests/test_package.py (logic check)")
    r.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    rec = sub.add_parser("record")
    rec.add_argument("dirs", type=Path, nargs="+")
    rec.add_argument("--dry-run", action="store_true", help=f"print the row, append nothing to {RESULTS.name}/")
    rec.add_argument("--note", default=None, help="what the row should say beside the counts (how it was run)")
    args = parser.parse_args()
    if args.command == "run":
        args.shards = [int(k) for k in args.shards.split(",")] if args.shards else list(range(1, args.of + 1))
        if any(not 1 <= k <= args.of for k in args.shards):
            parser.error(f"--shards {args.shards}: each part must be in 1..{args.of}")
        sys.exit(run(args))
    record(args)


if __name__ == "__main__":
    main()
