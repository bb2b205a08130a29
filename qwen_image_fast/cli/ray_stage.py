"""Rendering on a Ray cluster: a Ray Data stage (Renderer) and the driver behind `render --engine ray`.

Renderer is a callable class for `Dataset.map_batches`: each actor loads the pipeline once (one GPU each, as Ray
assigns it) and renders its batches of rows into the output folder, each image written atomically (a temporary
file renamed into place) with its settings embedded, as the local `render` writes it; it returns one manifest record
per row. The driver (render_on_ray) is the manifest's only writer: it appends each record as it arrives and merges
at the end, so a record is never written twice.

Exactly once, whatever fails:
- an actor killed mid-batch: Ray Data restarts it and retries the batch (Ray Data's actors run with max_restarts=-1
  and max_task_retries=-1); a retried row's image is written again under its own temporary name and renamed over the
  same file, holding the same pixels (the seed fixes them);
- before rendering a row, an actor looks for its image: a file there whose embedded settings are this row's is
  not rendered again, only recorded (a batch retried after some of its images were written, or a driver restarted
  after images whose records it never received);
- a driver killed and started again: the manifest says what is done; the rest is rendered, or recorded as above.

Rows: what the driver sends (one "job" column, a job's fields as JSON), or a user's own dataset whose columns are
the JSONL fields (prompt required; id, seed, width, height, steps, cfg, negative_prompt, images, mask, strength)
and "index" (the row's position, from which a seed is derived when neither seed nor id is given), with the
defaults of the spec's command line for the rest.
"""

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .inputs import InputImage
from .devices import cap_memory
from .jobs import Defaults, Job, make_jobs, parse_jsonl_line
from .manifest import differing_settings, recorded_settings
from .models import Labels, SingleFiles, load_pipeline
from .output import prepare_out_dir
from .parser import build_parser
from .render_plan import RenderPlan, check_ray_engine, check_render, shrunk_inputs
from .run import batches_of, call_facts, run_batch, save_rendered

# The environment an actor needs as the driver has it (the Triton interpreter on a CPU, the hub offline).
FORWARDED_ENV = ("TRITON_INTERPRET", "HF_HUB_OFFLINE", "OMP_NUM_THREADS")


@dataclass(frozen=True)
class RenderSpec:
    """What every actor renders with: the checks of `render` already passed on the driver. device: "cuda" (the GPU
    Ray gives the actor) or "cpu"; shrunk: a test-size model's input-image divisor (None otherwise); defaults: the
    command line's, for rows that are not the driver's jobs."""

    model: str
    files: SingleFiles | None
    labels: Labels
    device: str
    fmt: str
    out_dir: str
    batch_size: int
    defaults: Defaults
    shrunk: int | None = None
    max_memory: float | None = None  # --max-memory: GiB each actor's process may use on its GPU (cap_memory)

    def loads(self) -> tuple:
        """What an actor's pipeline is loaded from (the rest says where and how its rows are rendered)."""
        return self.model, self.files, self.labels, self.device, self.max_memory

    @classmethod
    def of(cls, plan: RenderPlan, args, out_dir: Path) -> "RenderSpec":
        """The spec of a checked render (check_render's plan, its arguments) into out_dir, made."""
        return cls(model=plan.model, files=plan.files, labels=plan.labels, device=plan.device.type, fmt=args.format,
                   out_dir=str(out_dir), batch_size=args.batch_size, defaults=plan.defaults, shrunk=plan.shrunk,
                   max_memory=args.max_memory)


def job_json(job: Job) -> str:
    """A job as the driver's rows carry it (input images as their path, hash and size)."""
    return json.dumps(asdict(job))


def job_from_json(text: str) -> Job:
    fields = json.loads(text)
    fields["images"] = tuple(InputImage(i["path"], i["sha256"], tuple(i["size"])) for i in fields["images"])
    mask = fields["mask"]
    fields["mask"] = None if mask is None else InputImage(mask["path"], mask["sha256"], tuple(mask["size"]))
    fields["sigmas"] = None if fields["sigmas"] is None else tuple(fields["sigmas"])
    return Job(**fields)


def present(value) -> bool:
    """A column's value in a row that has it (Arrow / pandas fill a missing one with None or NaN)."""
    return value is not None and not (isinstance(value, float) and math.isnan(value))


def plain(value):
    """A numpy scalar or array (Ray Data's numpy batches) as the Python value JSONL would give."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return value


def jobs_of(batch: dict, defaults: Defaults) -> list[Job]:
    """A batch's rows (column -> values) -> jobs: the driver's "job" column, or JSONL-field columns with "index"."""
    rows = [{k: plain(v[i]) for k, v in batch.items()} for i in range(len(next(iter(batch.values()))))]
    if "job" in batch:
        return [job_from_json(row["job"]) for row in rows]
    if "index" not in batch:
        raise ValueError("a row without an \"index\" column (its position in the whole list: image names and derived "
                         "seeds come from it)")
    jobs = []
    for row in rows:
        entry = {k: v for k, v in row.items() if present(v)}
        index = int(entry.pop("index"))
        entry = parse_jsonl_line(Path("(a Ray Data row)"), index, json.dumps(entry), "index")
        jobs.append(make_jobs([entry], defaults, first_index=index)[0])
    return jobs


def checked_spec(options: list[str], make_out_dir: bool) -> RenderSpec:
    """The spec of `render`'s options (e.g. ["--model", "Qwen/Qwen-Image-2512", "--steps", "50", "--out", "DIR"]):
    checked as the command checks them (against a stand-in prompt: the rows bring the real ones), the output folder
    made if make_out_dir. The rows' device is this process's (cuda where it has a GPU). ValueError names a refused
    option."""
    try:
        args = build_parser().parse_args(["render", *options, "--engine", "ray"])
    except SystemExit:
        raise ValueError(f"render options {options}: refused (argparse's message above)") from None
    check_ray_engine(args)
    plan = check_render(args, [{"prompt": "(the rows' prompts)"}])
    return RenderSpec.of(plan, args, prepare_out_dir(args.out) if make_out_dir else Path(args.out))


def render_spec(options: list[str]) -> RenderSpec:
    """checked_spec with the output folder made: what a user's own pipeline gives Renderer."""
    return checked_spec(options, make_out_dir=True)


def gpu_actor_threads(forwarded: dict, node_cpus: int, node_gpus: int) -> int | None:
    """torch's CPU threads in a GPU actor: None (leave them) where the driver forwarded OMP_NUM_THREADS, else the
    node's cores shared among its GPUs' actors. Ray starts an actor that asks for no CPU with OMP_NUM_THREADS=1,
    while the local render's torch uses every core (the host side of the model load, the images' encoding)."""
    if "OMP_NUM_THREADS" in forwarded:
        return None
    return max(1, node_cpus // max(1, node_gpus))


def node_cpus_and_gpus(ray) -> tuple[int, int]:
    """This actor's node: its CPUs (the ones this process may run on) and its GPUs, as Ray counts them."""
    node = ray.get_runtime_context().get_node_id()
    resources = next(n["Resources"] for n in ray.nodes() if n["NodeID"] == node)
    return len(os.sched_getaffinity(0)), int(resources.get("GPU", 1))


class Renderer:
    """A Ray Data stage: `ds.map_batches(Renderer, fn_constructor_kwargs={"spec": spec}, num_gpus=1,
    compute=ray.data.ActorPoolStrategy(size=N), batch_size=B)`. Loads the pipeline once per actor; each call renders
    the batch's rows (the ones whose image is not already there with the same settings) and returns {"record": [a
    manifest record as JSON, one per row]}; a row whose pipeline call failed gets {"file", "index", "failed": why}.
    An actor's first record also carries "startup": when it began and had its pipeline (render_on_ray reports them
    and keeps them out of the manifest)."""

    def __init__(self, spec: RenderSpec):
        started = time.time()
        import torch

        self.spec, self.out_dir = spec, Path(spec.out_dir)
        if spec.device != "cpu":
            import ray

            threads = gpu_actor_threads(ray.get_runtime_context().runtime_env.env_vars(), *node_cpus_and_gpus(ray))
            if threads is not None:
                torch.set_num_threads(threads)
        cap_memory(spec.max_memory, torch.device(spec.device))  # as the local render caps its process
        labels = spec.labels
        self.pipe = load_pipeline(spec.model, labels.preset, labels.config, spec.device, labels.loras,
                                  labels.lightning, files=spec.files)
        # when this actor began and had its pipeline (epoch seconds), sent once with its first record ("startup")
        self.startup = {"worker": os.getpid(), "init": started, "loaded": time.time()}

    def done_record(self, job: Job) -> dict | None:
        """The record of a job whose image is already there with this job's settings (embedded), else None."""
        name = f"{job.stem}.{self.spec.fmt}"
        embedded = recorded_settings(self.out_dir / name, {})  # {} without the file
        if not embedded or differing_settings(job, embedded, self.spec.labels):
            return None
        return dict(file=name, id=job.id, index=job.index, **embedded, time=time.time(), found=True)

    def __call__(self, batch: dict) -> dict:
        spec, records, todo = self.spec, [], []
        for job in jobs_of(batch, spec.defaults):
            record = self.done_record(job)
            if record is None:
                todo.append(job)
            else:
                records.append(record)
        for group in batches_of(todo, spec.batch_size):
            start = time.perf_counter()
            try:
                with shrunk_inputs(spec.shrunk):
                    images = run_batch(self.pipe, group, on_step=None)
            except Exception as e:  # reported by the driver, counted as failed; the other rows go on
                records += [dict(file=f"{job.stem}.{spec.fmt}", index=job.index, failed=f"{type(e).__name__}: {e}")
                            for job in group]
                continue
            applied, computed = call_facts(self.pipe, spec.labels)
            seconds = round((time.perf_counter() - start) / len(group), 3)
            for job, image in zip(group, images):
                record = save_rendered(job, image, self.out_dir, spec.fmt, spec.labels, applied, computed)
                records.append({**record, "seconds": seconds, "worker": os.getpid(), "time": time.time()})
        if records and self.startup is not None:
            records[0] = {**records[0], "startup": self.startup}  # the driver's, never in the manifest
            self.startup = None
        return {"record": [json.dumps(record, ensure_ascii=False) for record in records]}


class GatedRenderer(Renderer):
    """The stage of `render --engine ray`, started as soon as the cluster is connected, while the command still
    checks its options and its prompts: each actor checks the command's options itself (as render_spec does, from
    the command's working directory, without making the output folder) and loads its pipeline at once. Its rows are
    the prompts' indexes (column "id"); a batch asks `gate` (ray_engine.py) for the jobs of its indexes, which
    waits until the command has finished its checks and knows which jobs are pending: it returns the command's spec
    and, per index, the job (as JSON) or None (done already: no record). An actor whose own checks loaded something
    else than the command's spec says (another node's files or GPU) refuses to render."""

    def __init__(self, options: list[str], cwd: str, gate):
        began = time.time()
        os.chdir(cwd)  # the command's relative paths (--model ./checkpoint, --out out/)
        super().__init__(checked_spec(options, make_out_dir=False))
        self.startup["init"] = began  # its checks are part of its startup
        self.gate, self.opened = gate, False

    def __call__(self, batch: dict) -> dict:
        import ray

        spec, jobs = ray.get(self.gate.take.remote([int(i) for i in batch["id"]]))
        if not self.opened:
            if spec.loads() != self.spec.loads():
                raise ValueError(f"this actor's checks of the command's options (pid {os.getpid()}) loaded "
                                 f"{self.spec.loads()}, the command's checks {spec.loads()}: run the command where "
                                 "the actors' nodes have the same model files and GPUs")
            self.spec, self.out_dir, self.opened = spec, Path(spec.out_dir), True
        rows = [job for job in jobs if job is not None]
        return super().__call__({"job": rows}) if rows else {"record": []}
