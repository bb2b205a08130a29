"""What an image records and how it is written: its settings (embedded in the file, and in its manifest line),
atomic writes, the output folder.

Output folder layout:
    {stem}.{png,jpg,webp}      one image per prompt, settings embedded (read back with read_settings)
    manifest.jsonl             one JSON line per image; with several processes, merged from the shards
    manifest.rank{R}.jsonl     the lines written by rank R (several processes only)
    .tmp-*                     a file being written; a kill leaves at most these, removed by the next run

Settings (embedded and in the manifest): what was asked for (settings_of: prompt, seed, size, steps, cfg, model,
preset, scheduler, enhancer; resume compares these) and `applied`, what the pipeline call that made the image ran
(pipe.applied after that call; not compared).
"""

import json
import os
from pathlib import Path

from PIL import Image
from PIL.PngImagePlugin import PngInfo

from .jobs import Job
from .models import Labels

FORMATS = {"png": "PNG", "jpg": "JPEG", "webp": "WEBP"}
QUALITY = 95  # what render writes JPEG / WebP at
EXIF_IMAGE_DESCRIPTION = 0x010E
PNG_DESCRIPTION = "Description"  # PNG's standard keyword, the counterpart of EXIF ImageDescription
TEMP_PREFIX = ".tmp-"


def settings_of(job: Job, labels: Labels) -> dict:
    """What was asked for, embedded in an image and recorded in its manifest line: resume compares these.
    `enhancer` is always there (None without --enhance), so a run with another enhancer, or none, differs; `options`
    (what --no-<name>, --attention, --cfg-fraction changed from the preset) only when there are some."""
    settings = dict(prompt=job.prompt, negative_prompt=job.negative_prompt, seed=job.seed, width=job.width,
                    height=job.height, steps=job.steps, cfg=job.cfg, model=labels.model, preset=labels.preset,
                    scheduler=labels.scheduler, enhancer=labels.enhancer)
    if job.sigmas is not None:  # only then: a folder rendered before --sigmas existed resumes as it was
        settings["sigmas"] = list(job.sigmas)
    if job.images:  # what the image-conditioned pipelines were given (content hashes: resume compares those)
        settings |= dict(images=[image.record() for image in job.images],
                         mask=None if job.mask is None else job.mask.record(), strength=job.strength)
    return (settings | ({"options": labels.options} if labels.options else {})
            | ({"loras": [lora.record() for lora in labels.loras]} if labels.loras else {})
            | ({"note": labels.note} if labels.note else {})
            | ({"enhancer_note": labels.enhancer_note} if labels.enhancer_note else {}))


def image_settings(settings: dict, enhanced: str | None, applied: list[str],
                   blocks_computed: float | None = None) -> dict:
    """What an image records: settings, enhanced_prompt right after prompt (when there is one), applied, and with a
    step cache the fraction of the transformer's blocks its call computed (pipe.blocks_computed)."""
    if enhanced is not None:
        settings = {"prompt": settings["prompt"], "enhanced_prompt": enhanced,
                    **{k: v for k, v in settings.items() if k != "prompt"}}
    cached = {} if blocks_computed is None else {"blocks_computed": round(blocks_computed, 4)}
    return {**settings, "applied": list(applied), **cached}


def to_json(value, ensure_ascii: bool = False) -> str:
    """Strict JSON: a NaN or infinity raises instead of writing what JSON readers reject."""
    return json.dumps(value, ensure_ascii=ensure_ascii, allow_nan=False)


def fsync_folder(folder: Path):
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, write):
    """write(file) into a temporary file next to `path`, fsync, then rename it to `path`."""
    temp = path.with_name(TEMP_PREFIX + path.name)
    try:
        with open(temp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    fsync_folder(path.parent)


def save_image(image: Image.Image, path: Path, fmt: str, settings: dict):
    """The image in `fmt` (a key of FORMATS) at `path`, written atomically, its settings embedded (write_image)."""
    write_atomic(path, lambda f: write_image(image, f, FORMATS[fmt], settings))


def png_texts(settings: dict) -> dict[str, str]:
    """A PNG's text chunks for its settings (keyword -> text): one iTXt "Description" holding them as JSON."""
    return {PNG_DESCRIPTION: to_json(settings)}


def write_image(image: Image.Image, f, pil_format: str, settings: dict, quality: int = QUALITY):
    """The image to the file object f in PIL's `pil_format` with the settings as one JSON object: PNG in an iTXt
    "Description" chunk (UTF-8), JPEG/WebP in EXIF ImageDescription (ASCII-escaped). The same JSON in every format,
    so read_settings gives the same types. quality: JPEG / WebP's."""
    if pil_format == "PNG":
        info = PngInfo()
        for keyword, text in png_texts(settings).items():
            info.add_itxt(keyword, text)
        image.save(f, format="PNG", pnginfo=info)
    else:
        exif = Image.Exif()
        exif[EXIF_IMAGE_DESCRIPTION] = to_json(settings, ensure_ascii=True)
        image.save(f, format=pil_format, exif=exif, quality=quality)


def read_settings(path: str | Path) -> dict:
    """The settings embedded by save_image, as the JSON object they were written as (the same Python types for PNG,
    JPEG and WebP). {} if there are none. OSError if the file is not a readable image."""
    with Image.open(path) as image:
        if image.format == "PNG":
            description = image.text.get(PNG_DESCRIPTION)
        else:
            description = image.getexif().get(EXIF_IMAGE_DESCRIPTION)
    try:
        settings = json.loads(description) if description else {}
    except json.JSONDecodeError:
        return {}
    return settings if isinstance(settings, dict) else {}


def remove_stale_temp_files(out_dir: Path, jobs: list[Job]):
    """Temporary files a killed run left for these jobs (a job belongs to one rank: no other rank's file)."""
    for job in jobs:
        for temp in out_dir.glob(f"{TEMP_PREFIX}{job.stem}.*"):
            temp.unlink(missing_ok=True)


def missing_folders(out_dir: str | Path) -> list[Path]:
    """The folders that creating out_dir will create, deepest first."""
    path, missing = Path(out_dir).absolute(), []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def remove_empty_folders(folders: list[Path]):
    """Undo prepare_out_dir after a run that wrote nothing (folders from missing_folders, deepest first)."""
    for folder in folders:
        try:
            folder.rmdir()  # only when empty
        except OSError:
            return


def prepare_out_dir(out_dir: str | Path, option: str = "--out") -> Path:
    out_dir = Path(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / f"{TEMP_PREFIX}probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"{option} {out_dir}: not a writable folder ({e.strerror or e})") from e
    return out_dir
