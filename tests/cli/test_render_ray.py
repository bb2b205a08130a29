"""render --engine ray on a real Ray cluster this module starts (`ray start --head --block` on loopback, two CPUs, its
own temporary folder), the tiny model on the CPU: the local render's images and manifest, exactly once when a
worker or the driver is killed mid-run, and bad input refused in one line."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import BASELINE, TINY, images, manifest, pixels

from qwen_image_fast.command import main

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # bench_ray's start_cluster

RENDERER_PROCESS = "MapBatches(GatedRenderer)"  # in the title Ray gives an actor process of the render stage
SLOW = [*BASELINE, "--steps", "16"]  # ~0.3 s an image: slow enough to kill a run in the middle


@pytest.fixture(scope="module")
def cluster():
    """The head node's address (benchmarks/bench_ray.py's start_cluster, two CPUs and no GPU); the cluster stops with
    the `ray start --block` process group. Token authentication (Ray's default from 2.59) with a token of this
    module's, which the renders below inherit from os.environ (restored after)."""
    from bench_ray import start_cluster

    temp, saved = Path(tempfile.mkdtemp(prefix="/tmp/qif-ray-")), dict(os.environ)  # short: Ray's socket paths
    address, head = start_cluster(temp, "--num-cpus", "2", "--num-gpus", "0")
    yield address
    os.killpg(head.pid, signal.SIGKILL)
    head.wait()
    shutil.rmtree(temp, ignore_errors=True)
    os.environ.clear()
    os.environ.update(saved)


def render(*args) -> list[str]:
    return [sys.executable, "-m", "qwen_image_fast", "render", *args]


def prompts_file(tmp_path: Path, n: int) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"prompt {i}", "id": f"p{i}"}) + "\n" for i in range(n)))
    return path


def renderer_pids() -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and RENDERER_PROCESS in (proc / "cmdline").read_bytes().decode(errors="replace"):
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def wait_for_images(process, out_dir: Path, n: int):
    deadline = time.monotonic() + 120
    while len(images(out_dir)) < n:
        assert process.poll() is None, f"the render exited ({process.returncode}) before {n} images"
        assert time.monotonic() < deadline, f"fewer than {n} images after 120 s"
        time.sleep(0.05)


def check_exactly_once(out_dir: Path, n: int):
    lines = manifest(out_dir)
    assert sorted(line["file"] for line in lines) == sorted(f"p{i}-{line_seed(i)}.png" for i in range(n))
    assert len({line["file"] for line in lines}) == n
    assert sorted(path.name for path in images(out_dir)) == sorted(line["file"] for line in lines)
    assert not list(out_dir.glob(".tmp-*"))


def line_seed(i: int) -> int:
    import zlib

    return zlib.crc32(f"p{i}".encode())  # --seed 0 + crc32(id)


def test_24_prompts_on_two_workers_are_the_local_renders_from_parquet(cluster, tmp_path):
    """Prompts from Parquet; the local render from the same prompts as JSONL: the same files, pixels and settings,
    and `compare` pairs them all. The stock pipeline (0.03 s an image; the fast preset's kernels under the
    interpreter take 1 s: they run through the stage in the test below)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = prompts_file(tmp_path, 24)
    parquet = tmp_path / "prompts.parquet"
    pq.write_table(pa.Table.from_pylist([json.loads(line) for line in jsonl.read_text().splitlines()]), parquet)
    # relative paths: the actors, which check the command's options themselves, do so in its working directory
    done = subprocess.run(render(*BASELINE, "--engine", "ray", "--ray-address", cluster, "--workers", "2", "--prompts",
                                 "prompts.parquet", "--out", "ray"), capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "24 written, 0 skipped (already done), 0 failed" in done.stdout
    startup = re.search(r"Ray startup: checks done at ([\d.]+) s; Ray imported at ([\d.]+) s and cluster connected "
                        r"at ([\d.]+) s \(begun at ([\d.]+) s\); 2 actor\(s\) began at ([\d.]+)-([\d.]+) s and had the "
                        r"pipeline at ([\d.]+)-([\d.]+) s .*; first image recorded at ([\d.]+) s", done.stdout)
    checked, imported, connected, begun, began, _, loaded, _, first = (float(x) for x in startup.groups())
    # the connection runs beside the checks (begun before they are done); the actors' times, carried by a record,
    # kept out of the manifest
    assert 0 <= begun < checked and begun < imported < connected <= began <= loaded <= first, startup.group(0)
    assert main(["render", *BASELINE, "--prompts", str(jsonl), "--out", str(tmp_path / "local")]) == 0
    check_exactly_once(tmp_path / "ray", 24)
    ours, local = manifest(tmp_path / "ray"), {line["file"]: line for line in manifest(tmp_path / "local")}
    assert {line["worker"] for line in ours} and len({line["worker"] for line in ours}) == 2  # both actors rendered
    drop = {"seconds", "time", "worker", "rank"}
    for line in ours:
        assert {k: v for k, v in line.items() if k not in drop} == {k: v for k, v in local[line["file"]].items()
                                                                     if k not in drop}
        assert np.array_equal(pixels(tmp_path / "ray" / line["file"]), pixels(tmp_path / "local" / line["file"]))
    assert main(["compare", str(tmp_path / "ray"), str(tmp_path / "local"), "--out", str(tmp_path / "report")]) == 0


def test_a_worker_killed_mid_run_leaves_every_image_once(cluster, tmp_path):
    out_dir = tmp_path / "out"
    process = subprocess.Popen(render(*SLOW, "--engine", "ray", "--ray-address", cluster, "--workers", "2",
                                      "--prompts", str(prompts_file(tmp_path, 24)), "--out", str(out_dir)),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_for_images(process, out_dir, 4)
    pids = renderer_pids()
    assert pids, "no actor process of the render stage found"
    os.kill(pids[0], signal.SIGKILL)
    assert len(images(out_dir)) < 24, "the render finished before a worker was killed"
    output = process.communicate(timeout=300)[0]
    assert process.returncode == 0, output[-3000:]
    check_exactly_once(out_dir, 24)


def test_a_driver_stopped_twice_renders_each_image_once_and_a_run_without_workers_takes_one_actor(cluster, tmp_path):
    """Three runs of one command (one module's cluster; each run pays Ray's startup, so they share a test):
    - SIGTERM to the driver mid-run: one line and exit 143, as the local render (Ray's core worker in the driver
      puts its crash handler on SIGTERM, a stack dump before the previous handler; the command puts its own back);
      the manifest records only images that are there;
    - the same command again, its driver killed (SIGKILL) after some more images;
    - again without --workers, on this cluster without GPUs: one actor renders only the rest, none a second time."""
    out_dir, prompts = tmp_path / "out", prompts_file(tmp_path, 24)
    command = render(*SLOW, "--engine", "ray", "--ray-address", cluster, "--prompts", str(prompts), "--out",
                     str(out_dir))
    two_workers = [*command, "--workers", "2"]
    process = subprocess.Popen(two_workers, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for_images(process, out_dir, 4)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 143, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("terminated (SIGTERM); the images recorded so far are kept in"), err
    assert "SIGTERM received" not in err, err[-3000:]  # Ray's crash handler's stack dump
    assert {line["file"] for line in manifest(out_dir)} <= {path.name for path in images(out_dir)}
    terminated = len(images(out_dir))
    assert terminated < 24

    process = subprocess.Popen(two_workers, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_images(process, out_dir, terminated + 4)
    process.kill()
    process.wait()
    time.sleep(1)  # its actors die with it (they may finish the image they were writing)
    before = {path.name: path.stat().st_mtime_ns for path in images(out_dir)}
    assert terminated + 4 <= len(before) < 24

    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = next(line for line in done.stdout.splitlines() if "written," in line)
    written, skipped = int(summary.split()[0]), int(summary.split()[2])
    assert written == 24 - len(before) and skipped == len(before), summary
    assert {name: (out_dir / name).stat().st_mtime_ns for name in before} == before  # none rendered again
    check_exactly_once(out_dir, 24)
    last_run = [line for line in manifest(out_dir) if line["file"] not in before]
    assert len({line["worker"] for line in last_run}) == 1, last_run


def test_a_check_that_fails_after_the_stage_started_leaves_nothing(cluster, tmp_path):
    """The stage starts when the cluster is connected, beside the command's checks; a bad line found by those
    checks still exits 2 with it as stderr's last line (before it, usage, and at most Ray's C++ core worker's note
    on the actor it created: its Python logs below WARNING are kept out), with no output folder and no image (the
    actors wait at the gate until the checks are done, and stop with the command)."""
    prompts = prompts_file(tmp_path, 3)
    prompts.write_text(prompts.read_text() + json.dumps({"prompt": "x", "negative_prompt": "y", "cfg": 1}) + "\n")
    done = subprocess.run(render(*BASELINE, "--engine", "ray", "--ray-address", cluster, "--prompts", str(prompts),
                                 "--out", str(tmp_path / "out")), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "line 4: a negative_prompt with cfg 1" in done.stderr.strip().splitlines()[-1], done.stderr[-3000:]
    # Ray Data's INFO lines (the dataset's start, plan, progress) and ray.init's warning from a thread stay out
    assert "INFO" not in done.stderr and "SIGTERM handler" not in done.stderr, done.stderr[-3000:]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, message", [
    (["--ray-address", "127.0.0.1:1"], "--ray-address 127.0.0.1:1: no Ray head node reachable there"),
    (["--workers", "0"], "--workers: must be >= 1"),
    (["--parallel", "cfg"], "--engine ray does not take --parallel"),
])
def test_bad_input_exits_2_in_one_line(args, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["render", *BASELINE, "--engine", "ray", *args, "--out", str(tmp_path / "out"), "a cat"])
    assert exit_info.value.code == 2 and not (tmp_path / "out").exists()
    assert message in capsys.readouterr().err.strip().splitlines()[-1]


def test_dry_run_names_the_engine(tmp_path, capsys):
    assert main(["render", *TINY, "--engine", "ray", "--workers", "3", "--dry-run", "--out", str(tmp_path / "out"),
                 "a cat"]) == 0
    assert "engine ray: a local cluster, 3 actor(s) on cpu, each running the plan above" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()


def test_the_spec_carries_every_option_an_actor_needs(tmp_path):
    """render_spec keeps what the actors apply themselves: the memory cap (cap_memory on their GPU), the format,
    the batch size, the checked defaults."""
    from qwen_image_fast.ray import render_spec

    spec = render_spec([*BASELINE, "--max-memory", "60", "--format", "webp", "--batch-size", "3", "--seed", "7",
                        "--out", str(tmp_path / "out")])
    assert (spec.max_memory, spec.fmt, spec.batch_size, spec.defaults.seed) == (60.0, "webp", 3, 7)
    assert (tmp_path / "out").is_dir()


def test_a_parquet_file_without_a_prompt_column_exits_2(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a cat"]}), tmp_path / "p.parquet")
    with pytest.raises(SystemExit) as exit_info:
        main(["render", *BASELINE, "--engine", "ray", "--prompts", str(tmp_path / "p.parquet"), "--out",
              str(tmp_path / "out")])
    assert exit_info.value.code == 2 and not (tmp_path / "out").exists()
    assert 'no "prompt" column (its columns: text)' in capsys.readouterr().err.strip().splitlines()[-1]


def test_a_parquet_row_s_bad_value_is_named_by_its_row(tmp_path, capsys):
    """A Parquet file's rows are checked as JSONL lines are, and named "row N" (not "line N") in the message."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["a cat", "a dog"], "negative_prompt": [None, "blurry"], "cfg": [4.0, 1.0]}),
                   tmp_path / "p.parquet")
    with pytest.raises(SystemExit) as exit_info:
        main(["render", *BASELINE, "--prompts", str(tmp_path / "p.parquet"), "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2 and not (tmp_path / "out").exists()
    assert "row 2: a negative_prompt with cfg 1" in capsys.readouterr().err.strip().splitlines()[-1]


def test_prompts_are_read_from_any_filesystem_pyarrow_opens(tmp_path, capsys):
    """--prompts URI (s3://, gs://, hdfs://, ...) goes through pyarrow's filesystems: a file:// URI (the one this
    machine can test for real) reads as the local path does, for each format; a scheme pyarrow cannot open exits
    2 in one line."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from qwen_image_fast.cli.jobs import read_prompt_file

    (tmp_path / "p.txt").write_text("a cat\n# skipped\na dog\n")
    (tmp_path / "p.jsonl").write_text('{"prompt": "a cat", "seed": 3}\n{"prompt": "a dog", "id": "dog"}\n')
    pq.write_table(pa.table({"prompt": ["a cat", "a dog"], "seed": [3, None]}), tmp_path / "p.parquet")
    for name in ("p.txt", "p.jsonl", "p.parquet"):
        local = read_prompt_file(tmp_path / name)
        assert read_prompt_file(f"file://{tmp_path / name}") == local and len(local) == 2
    assert main(["render", *BASELINE, "--prompts", f"file://{tmp_path / 'p.jsonl'}", "--out", str(tmp_path / "out"),
                 "--dry-run"]) == 0
    assert "2 image(s)" in capsys.readouterr().out
    for uri, why in ((f"nosuch://{tmp_path / 'p.txt'}", "cannot read it"),
                     (f"file://{tmp_path / 'missing.jsonl'}", "cannot read it"),
                     (f"nosuch://{tmp_path / 'p.parquet'}", "not a readable Parquet file")):
        with pytest.raises(SystemExit) as exit_info:
            main(["render", *BASELINE, "--prompts", uri, "--out", str(tmp_path / "out")])
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert exit_info.value.code == 2 and f"--prompts {uri}: {why}" in line, line
    assert not (tmp_path / "out").exists()


# A user's own Ray Data script (run as its own process: Ray reads its token settings once per process, and another
# test of this worker may have imported ray before the cluster's token was in the environment)
USER_PIPELINE = """
import json, sys
import ray
from qwen_image_fast.ray import Renderer, render_spec

address, options, rows = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
spec = render_spec(options)
ray.init(address=address, logging_level="ERROR", log_to_driver=False)
records = ray.data.from_items(rows).map_batches(Renderer, fn_constructor_kwargs={"spec": spec}, batch_size=2,
                                                compute=ray.data.ActorPoolStrategy(size=1), num_cpus=1).take_all()
print(json.dumps([r["record"] for r in records]))
"""


def test_the_stage_in_a_users_own_ray_data_pipeline(cluster, tmp_path):
    """Renderer in a Dataset of the user's own columns (the JSONL fields and "index"), its spec from render's
    options, the fast preset (its Triton kernels under the interpreter): the images the local render makes of the
    same prompts, and one record per row."""
    rows = [{"prompt": f"prompt {i}", "id": f"p{i}", "index": i, "steps": 2 + i % 2} for i in range(4)]
    done = subprocess.run([sys.executable, "-c", USER_PIPELINE, cluster,
                           json.dumps([*TINY, "--out", str(tmp_path / "ray")]), json.dumps(rows)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    records = json.loads(done.stdout.strip().splitlines()[-1])
    records = sorted((json.loads(r) for r in records), key=lambda r: r["index"])
    assert [r["file"] for r in records] == [f"p{i}-{line_seed(i)}.png" for i in range(4)]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("".join(json.dumps({k: v for k, v in row.items() if k != "index"}) + "\n" for row in rows))
    assert main(["render", *TINY, "--prompts", str(jsonl), "--out", str(tmp_path / "local")]) == 0
    for record in records:
        assert "fp8" in record["applied"] and record["preset"] == "fast"
        assert record["steps"] == 2 + record["index"] % 2
        assert np.array_equal(pixels(tmp_path / "ray" / record["file"]), pixels(tmp_path / "local" / record["file"]))


class FailsOn:
    """The stage's pipeline, raising for one prompt (a call that fails as an out-of-memory one would), counting
    the calls that reach it."""

    def __init__(self, pipe, prompt: str):
        self.pipe, self.prompt, self.calls = pipe, prompt, 0

    def __call__(self, **kwargs):
        self.calls += 1
        if self.prompt in kwargs["prompt"]:
            raise RuntimeError(f"no memory for {self.prompt!r}")
        return self.pipe(**kwargs)

    def __getattr__(self, name):
        return getattr(self.pipe, name)


def test_the_stage_reports_a_failed_call_renders_the_rest_and_never_twice(tmp_path):
    """The stage in this process (no cluster): a row whose pipeline call fails gets a `failed` record and the
    others render; called again with the same rows (a retried batch), the finished image is recorded from its file,
    not rendered again."""
    from qwen_image_fast.ray import Renderer, render_spec

    stage = Renderer(render_spec([*BASELINE, "--out", str(tmp_path / "out")]))
    stage.pipe = FailsOn(stage.pipe, "boom")
    batch = {"prompt": np.array(["a cat", "boom"], dtype=object), "index": np.array([0, 1])}
    first = [json.loads(r) for r in stage(batch)["record"]]
    assert [r.get("failed") for r in sorted(first, key=lambda r: r["index"])] == [None, "RuntimeError: no memory for "
                                                                                        "'boom'"]
    assert stage.pipe.calls == 2 and [p.name for p in images(tmp_path / "out")] == ["00000-0.png"]
    again = {r["index"]: r for r in (json.loads(r) for r in stage(batch)["record"])}
    assert again[0]["found"] and again[0]["prompt"] == "a cat" and "failed" in again[1]
    assert stage.pipe.calls == 3  # only the failed row was tried again


def test_the_startup_line_times_each_actor_s_own_load():
    """The fastest load is an actor's own (its start to its pipeline), not the earliest start against the earliest
    load of two different actors."""
    from qwen_image_fast.cli.ray_engine import startup_line

    actors = [{"worker": 1, "init": 101.0, "loaded": 110.0}, {"worker": 2, "init": 102.0, "loaded": 104.0}]
    connection = dict(began=100.1, imported=100.3, connected=100.5, checked=100.4)
    assert startup_line(100.0, connection, actors, 111.0) == (
        "Ray startup: checks done at 0.4 s; Ray imported at 0.3 s and cluster connected at 0.5 s (begun at 0.1 s); "
        "2 actor(s) began at 1.0-2.0 s and had the pipeline at 4.0-10.0 s (loading 2.0 s at the fastest); first "
        "image recorded at 11.0 s")


def test_a_gpu_actor_uses_its_share_of_the_node_s_cores():
    """Ray starts an actor that asks for no CPU with OMP_NUM_THREADS=1 (torch on one thread), where the local render
    uses every core: a GPU actor takes its node's cores divided among the node's GPUs, unless the driver forwarded
    OMP_NUM_THREADS (then the user's value stands)."""
    from qwen_image_fast.cli.ray_stage import gpu_actor_threads

    assert gpu_actor_threads({}, node_cpus=32, node_gpus=2) == 16
    assert gpu_actor_threads({}, node_cpus=16, node_gpus=1) == 16
    assert gpu_actor_threads({}, node_cpus=4, node_gpus=8) == 1
    assert gpu_actor_threads({"OMP_NUM_THREADS": "3"}, node_cpus=32, node_gpus=2) is None


def test_the_actors_count_and_device_refusals():
    """actor_count's decision from the cluster's GPU count (the module's cluster has none, and this machine cannot
    refuse --device cuda later than render's own checks do)."""
    from qwen_image_fast.cli.ray_engine import actor_count

    assert actor_count(3, gpu=True, workers=None, device_given=False) == 3
    assert actor_count(3, gpu=True, workers=2, device_given=False) == 2
    assert actor_count(0, gpu=False, workers=None, device_given=False) == 1
    assert actor_count(2, gpu=False, workers=None, device_given=True) == 1
    with pytest.raises(ValueError, match="the cluster has no GPU for the actors"):
        actor_count(0, gpu=True, workers=None, device_given=False)
    with pytest.raises(ValueError, match="this process has no GPU, so render's checks chose the CPU, but the cluster "
                                         "has 2 GPU"):
        actor_count(2, gpu=False, workers=None, device_given=False)


def test_the_actors_device_is_chosen_without_torch_and_held_to_render_s_checks():
    """launch_stage chooses the actors' device before render's checks have (actors_on_gpus: --device's kind, else
    the cluster's GPUs), so that torch's import is not ahead of the actors' start; render's choice is then held to
    it (check_actors_device): a process without a GPU on a cluster with GPUs, or the reverse, is refused as before."""
    from qwen_image_fast.cli.ray_engine import actors_on_gpus, check_actors_device

    assert actors_on_gpus(2, None) and not actors_on_gpus(0, None)
    assert actors_on_gpus(0, "cuda:1") and not actors_on_gpus(2, "cpu")
    check_actors_device(2, False, "cuda")
    check_actors_device(0, False, "cpu")
    check_actors_device(2, True, "cpu")
    with pytest.raises(ValueError, match="this process has no GPU, so render's checks chose the CPU"):
        check_actors_device(2, False, "cpu")
    with pytest.raises(ValueError, match="the cluster has no GPU for the actors"):
        check_actors_device(0, False, "cuda")
