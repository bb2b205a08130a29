"""manifest.jsonl (one JSON line per image; with several processes a shard per rank, merged) and resume.

Crash safety: an image is written to a temporary file, fsynced and renamed into place; only then is its manifest
line appended (and fsynced). An image is done when its manifest line has the same settings and its file exists.
An image file of the same name with other settings is never overwritten silently: find_conflict names it, and the
command line refuses to run (--no-resume overwrites on purpose).
"""

import fcntl
import json
import os
from pathlib import Path

from .jobs import Job
from .models import Labels
from .output import read_settings, remove_stale_temp_files, settings_of, to_json, write_atomic

MANIFEST = "manifest.jsonl"
MANIFEST_LOCK = ".manifest.lock"


def manifest_path(out_dir: Path, rank: int, world_size: int) -> Path:
    return out_dir / (MANIFEST if world_size == 1 else f"manifest.rank{rank}.jsonl")


def drop_partial_last_line(path: Path):
    """A kill during an append can leave a last line without its newline: cut it, so the next line starts clean."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with open(path, "r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)


def append_line(path: Path, record: dict):
    with open(path, "a", encoding="utf-8") as f:
        f.write(to_json(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_lines(path: Path) -> list[dict]:
    """A manifest file's lines that name a file and a time; unreadable ones skipped (a kill mid-append can cut the
    last one, inside a character too); [] when there is no such file."""
    if not path.exists():
        return []
    lines = []
    for line in path.read_bytes().splitlines():
        try:
            record = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            continue
        if isinstance(record, dict) and "file" in record and "time" in record:
            lines.append(record)
    return lines


def read_records(out_dir: Path) -> dict[str, dict]:
    """{file name: its latest manifest line} over manifest.jsonl and the rank shards; unreadable lines skipped."""
    records = {}
    for path in [out_dir / MANIFEST, *sorted(out_dir.glob("manifest.rank*.jsonl"))]:
        for record in read_lines(path):
            name, when = record["file"], record["time"]
            if name not in records or when >= records[name]["time"]:
                records[name] = record
    return records


def merge_manifests(out_dir: Path):
    """Rewrite manifest.jsonl as the union of itself and the shards: one line per image on disk, sorted by file.

    Every rank calls this when it finishes. Merges run one at a time (an exclusive lock on a file, released by the
    kernel even on kill -9) and each keeps everything the previous one wrote, so whichever rank finishes last
    leaves the complete manifest: no barrier, no torch.distributed."""
    with open(out_dir / MANIFEST_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        records = [r for name, r in sorted(read_records(out_dir).items()) if (out_dir / name).exists()]
        text = "".join(to_json(r) + "\n" for r in records)
        write_atomic(out_dir / MANIFEST, lambda f: f.write(text.encode("utf-8")))


# The settings compared by what they are rather than as written: files by content, an empty set as none.
BY_CONTENT = ("images", "mask", "loras", "options")
# Settings recorded only when asked for (output.settings_of), so that folders made before they existed resume.
WHEN_GIVEN = ("sigmas",)


def content_identity(key: str, value):
    """A setting as resume and compare compare it: input images and masks by content (sha256), LoRAs by content and
    scale (not where their files are), no LoRAs or options as None; any other setting as it is."""
    if key == "images" and isinstance(value, list):
        return [r.get("sha256") if isinstance(r, dict) else r for r in value]
    if key == "mask" and isinstance(value, dict):
        return value.get("sha256")
    if key == "loras":
        return [(r.get("sha256"), r.get("scale")) if isinstance(r, dict) else r for r in value] if value else None
    if key == "options":
        return value or None
    return value


def differing_settings(job: Job, recorded: dict, labels: Labels) -> list[str]:
    """The settings of `job` that `recorded` (a manifest line or embedded settings) does not have. The ones by
    content (LoRAs, input images, masks: sha256, not where their files are) are compared whenever either side has
    them: an image made with an input image is not a text-only job's, nor one made without it an edit's."""
    wanted = settings_of(job, labels)
    differing = [key for key, value in wanted.items() if key not in BY_CONTENT and recorded.get(key) != value]
    # recorded only when given: an image made on a --sigmas schedule is not one of the default schedule's
    differing += [key for key in WHEN_GIVEN if key in recorded and key not in wanted]
    differing += [key for key in BY_CONTENT if (key in wanted or key in recorded)
                  and content_identity(key, wanted.get(key)) != content_identity(key, recorded.get(key))]
    return differing


def is_done(job: Job, records: dict[str, dict], out_dir: Path, fmt: str, labels: Labels) -> bool:
    name = f"{job.stem}.{fmt}"
    record = records.get(name)
    return record is not None and (out_dir / name).exists() and not differing_settings(job, record, labels)


def pending_jobs(jobs: list[Job], out_dir: Path, fmt: str, labels: Labels, resume: bool) -> list[Job]:
    """The jobs left to render in out_dir (all of them without resume), once the temporary files a killed run left
    for them are removed."""
    remove_stale_temp_files(out_dir, jobs)
    records = read_records(out_dir) if resume else {}
    return [job for job in jobs if not is_done(job, records, out_dir, fmt, labels)]


def recorded_settings(path: Path, records: dict[str, dict]) -> dict:
    """An image's settings: its manifest line (records: read_records of its folder), else those embedded in the
    file; {} when it has neither or cannot be read."""
    if path.name in records:
        return records[path.name]
    try:
        return read_settings(path)
    except (OSError, SyntaxError, ValueError):
        return {}


def find_conflict(jobs: list[Job], out_dir: Path, fmt: str, labels: Labels) -> str | None:
    """A job whose file already exists in out_dir with other settings (its manifest line's, else its embedded
    ones; a file with neither is someone else's), which rendering would overwrite: a one-line description, or
    None when there is no such job."""
    if not out_dir.is_dir():
        return None
    records = read_records(out_dir)
    for job in jobs:
        path = out_dir / f"{job.stem}.{fmt}"
        if not path.exists():
            continue
        recorded = recorded_settings(path, records)
        differing = differing_settings(job, recorded, labels)
        if differing and not recorded:
            return f"{path} exists and was not made by this tool (no settings in it)"
        if differing:
            wanted = settings_of(job, labels)
            changes = "; ".join(f"{key} {short(recorded.get(key))}, now {short(wanted.get(key))}" for key in differing)
            return f"{path} exists, made with other settings ({changes})"
    return None


def short(value, limit: int = 30) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
