"""Rendering prompts to files: prompt loading, per-prompt seeds, model loading, crash-safe output, the manifest,
resume and sharding over several processes.

Output folder layout:
    {stem}.{png,jpg,webp}      one image per prompt, settings embedded (read back with read_settings)
    manifest.jsonl             one JSON line per image; with several processes, merged from the shards
    manifest.rank{R}.jsonl     the lines written by rank R (several processes only)
    .tmp-*                     a file being written; a kill leaves at most these, removed by the next run

Crash safety: an image is written to a temporary file, fsynced and renamed into place; only then is its manifest
line appended (and fsynced). An image is done when its manifest line has the same settings and its file exists.
An image file of the same name with other settings is never overwritten silently: find_conflict names it, and the
command line refuses to run (--no-resume overwrites on purpose).

Settings (embedded and in the manifest): what was asked for (settings_of: prompt, seed, size, steps, cfg, model,
preset, scheduler, enhancer; resume compares these) and `applied`, what the pipeline call that made the image ran
(pipe.applied after that call; not compared).

LoRAs (--lora, repeatable): each is checked before any model loads (a safetensors file holding LoRA tensors, on
disk or in the local Hugging Face cache) and hashed; `loras` ([{path, scale, sha256}], in the given order) is one
of the settings resume compares, by content and scale (not by path), so another LoRA set or strength is other work.
With the fast preset the LoRAs are fused: merged into the BF16 weights before they are quantized (an upstream
checkpoint), or folded into the FP8 weights (a fast checkpoint). --lightning: the Lightning LoRAs' few-step sampler
(lightning_scheduler; the recorded scheduler is "lightning"), 8 steps and no CFG unless given.

Prompt enhancement (--enhance): each batch's prompts are rewritten by a local Qwen3.5 just before the batch renders;
the rewrite is recorded as `enhanced_prompt` next to `prompt` (embedded and in the manifest), and `enhancer` (which
model rewrote it) is one of the settings resume compares. Resume matches the original prompt, never the rewrite.

Importing this module is light (no torch, diffusers or triton): the command line imports it to build its parser.
"""

import contextlib
import fcntl
import hashlib
import io
import json
import math
import os
import re
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple
from pathlib import Path

from PIL import Image
from PIL.PngImagePlugin import PngInfo
from tqdm import tqdm

from .config import FastConfig

REAL_MODEL_ID = "Qwen/Qwen-Image-2512"
# Also in tiny.py and pipelines/qwen35/enhance.py, which import torch and diffusers; test_cli checks they agree.
TINY_MODEL_ID = "tiny-random"
TINY_ENHANCER_ID = "tiny-random"
DEFAULT_ENHANCER_ID = "Qwen/Qwen3.5-4B"
# Qwen-Image-2512's recommended negative prompt (QwenLM/Qwen-Image README).
NEGATIVE_PROMPT = "低分辨率，低画质，肢体畸形，手指畸形，画面过饱和，蜡像感，人脸无细节，过度光滑，画面具有AI感。构图混乱。文字模糊，扭曲。"
# The official sizes of Qwen-Image-2512, as (width, height).
ASPECTS = {
    "1:1": (1328, 1328),
    "16:9": (1664, 928),
    "9:16": (928, 1664),
    "4:3": (1472, 1104),
    "3:4": (1104, 1472),
    "3:2": (1584, 1056),
    "2:3": (1056, 1584),
}
TINY_SIZE, TINY_STEPS = 64, 2
# One step gives NaN images: Qwen's scheduler stretches 1 - sigma by its last value (shift_terminal), 0 at 1 step.
MIN_STEPS = 2
# torch.Generator.manual_seed takes -2**63 .. 2**64 - 1 and wraps negatives (-1 is 2**64 - 1): only 0 .. 2**64 - 1,
# so that two different seeds never give the same image under two names.
MAX_SEED = 2**64 - 1
# "baseline" renders with diffusers' own QwenImagePipeline, untouched; every other preset with QwenImageFastPipeline.
STOCK_PRESET = "baseline"
TINY_NOTE = "noise from random weights (tiny-random test model), not a rendering of the prompt"
TINY_ENHANCER_NOTE = "gibberish from random weights (tiny-random Qwen3.5), not a rewriting of the prompt"

FORMATS = {"png": "PNG", "jpg": "JPEG", "webp": "WEBP"}
EXIF_IMAGE_DESCRIPTION = 0x010E
PNG_DESCRIPTION = "Description"  # PNG's standard keyword, the counterpart of EXIF ImageDescription
TEMP_PREFIX = ".tmp-"
MANIFEST = "manifest.jsonl"
MANIFEST_LOCK = ".manifest.lock"
JSONL_FIELDS = {"prompt", "negative_prompt", "seed", "width", "height", "steps", "cfg", "id", "images", "mask",
                "strength"}
ID_CHARACTERS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


class LoadError(ValueError):
    """The model or the prompt enhancer could not be loaded (not cached, not a checkpoint, ...): bad input."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during render_jobs, after `written` images of this run were finished (they are kept)."""

    def __init__(self, written: int):
        super().__init__(written)
        self.written = written


@dataclass(frozen=True)
class InputImage:
    """An input image (--image, --mask): the path as given, its content's sha256 and its size (width, height)."""

    path: str
    sha256: str
    size: tuple[int, int]

    def record(self) -> dict:
        return {"path": self.path, "sha256": self.sha256}

    def load(self, mode: str) -> Image.Image:
        """The image, decoded from the file read now; ValueError if its content is no longer what was hashed (the
        image would record an input it was not made from)."""
        data = Path(self.path).read_bytes()
        if hashlib.sha256(data).hexdigest() != self.sha256:
            raise ValueError(f"{self.path} changed since it was read (sha256 {self.sha256[:12]}...); run again")
        with Image.open(io.BytesIO(data)) as image:
            return image.convert(mode)


@dataclass(frozen=True)
class Defaults:
    """Settings for every prompt that its JSONL line does not override. width/height None: the pipeline sizes the
    output from the input image (the edit pipelines)."""

    negative_prompt: str
    seed: int
    width: int | None
    height: int | None
    steps: int
    cfg: float
    images: tuple[InputImage, ...] = ()
    mask: InputImage | None = None
    strength: float | None = None


@dataclass(frozen=True)
class Job:
    """One image to render. index: position in the whole prompt list (before sharding)."""

    index: int
    id: str | None
    prompt: str
    negative_prompt: str | None  # None when cfg <= 1 (no classifier-free guidance)
    seed: int
    width: int | None
    height: int | None
    steps: int
    cfg: float
    images: tuple[InputImage, ...] = ()
    mask: InputImage | None = None
    strength: float | None = None

    @property
    def stem(self) -> str:
        return f"{self.id if self.id is not None else f'{self.index:05d}'}-{self.seed}"


@dataclass(frozen=True)
class Lora:
    """One --lora: the path or ID/file as given, the file on this machine, its strength and its content's sha256."""

    source: str
    file: Path
    scale: float
    sha256: str

    def record(self) -> dict:
        return {"path": self.source, "scale": self.scale, "sha256": self.sha256}


@dataclass(frozen=True)
class Labels:
    """What produces the images, recorded with each of them. preset: a FastConfig preset name (STOCK_PRESET: the
    stock pipeline); config: the one FastConfig of the command. note: set for the tiny random model. enhancer: the
    prompt enhancer's checkpoint (None: prompts rendered as given); enhancer_note: set for the tiny random one."""

    model: str
    preset: str
    config: FastConfig
    note: str | None
    enhancer: str | None = None
    enhancer_note: str | None = None
    loras: tuple[Lora, ...] = ()
    lightning: bool = False

    @property
    def scheduler(self) -> str:
        return "lightning" if self.lightning else self.config.scheduler


@dataclass
class Summary:
    written: int = 0
    skipped: int = 0
    failed: int = 0
    seconds: float = 0.0  # wall time of the written images, prompt enhancement included
    enhance_seconds: float = 0.0  # the part of it spent rewriting prompts
    applied: tuple[str, ...] = ()  # pipe.applied after the last call: what it ran (empty: stock or nothing rendered)

    @property
    def seconds_per_image(self) -> float | None:
        return self.seconds / self.written if self.written else None


# ---- prompts -> jobs


def read_prompt_file(path: str | Path) -> list[dict]:
    """A .jsonl file (objects with "prompt" and optional JSONL_FIELDS) or a text file (one prompt a line; blank
    lines and lines starting with # skipped) -> entries {"line": n, "prompt": ..., ...}. ValueError names the line."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--prompts {path}: cannot read it ({e})") from e
    entries = []
    for number, line in enumerate(lines, start=1):
        if not line.strip() or (path.suffix != ".jsonl" and line.lstrip().startswith("#")):
            continue
        entries.append(parse_jsonl_line(path, number, line) if path.suffix == ".jsonl" else
                       {"line": number, "prompt": line.strip()})
    if not entries:
        raise ValueError(f"--prompts {path}: no prompts in it (blank lines and # comments are skipped)")
    return entries


def command_line_entries(prompts: list[str]) -> list[dict]:
    """Prompts given as arguments -> entries; an empty or blank one is rejected, as in a JSONL file."""
    for number, prompt in enumerate(prompts, start=1):
        if not prompt.strip():
            raise ValueError(f"prompt {number} is {'empty' if not prompt else 'only whitespace'}: give a non-empty "
                             "prompt")
    return [{"prompt": prompt} for prompt in prompts]


def parse_jsonl_line(path: Path, number: int, line: str) -> dict:
    def bad(why):
        return ValueError(f"--prompts {path}, line {number}: {why}")

    try:
        entry = json.loads(line)
    except json.JSONDecodeError as e:
        raise bad(f"not valid JSON ({e.msg})") from e
    if not isinstance(entry, dict):
        raise bad(f"expected a JSON object, got {type(entry).__name__}")
    unknown = sorted(set(entry) - JSONL_FIELDS)
    if unknown:
        raise bad(f"unknown field(s) {', '.join(unknown)}; allowed: {', '.join(sorted(JSONL_FIELDS))}")
    if not isinstance(entry.get("prompt"), str) or not entry["prompt"].strip():
        raise bad('"prompt" must be a non-empty string')
    if "negative_prompt" in entry and not isinstance(entry["negative_prompt"], str):
        raise bad('"negative_prompt" must be a string')
    for name in ("seed", "width", "height", "steps"):
        if name in entry and (not isinstance(entry[name], int) or isinstance(entry[name], bool)):
            raise bad(f'"{name}" must be an integer, got {entry[name]!r}')
    for name in ("width", "height"):
        if name in entry and (entry[name] < 16 or entry[name] % 16):
            raise bad(f'"{name}" must be a positive multiple of 16, got {entry[name]}')
    if "steps" in entry and entry["steps"] < MIN_STEPS:
        raise bad(f'"steps" must be >= {MIN_STEPS}, got {entry["steps"]}')
    if "seed" in entry and not 0 <= entry["seed"] <= MAX_SEED:
        raise bad(f'"seed" must be in 0..{MAX_SEED} (2**64 - 1), got {entry["seed"]}')
    if "cfg" in entry and (not isinstance(entry["cfg"], (int, float)) or isinstance(entry["cfg"], bool)
                           or not math.isfinite(entry["cfg"])):
        raise bad(f'"cfg" must be a finite number, got {entry["cfg"]!r}')
    if "images" in entry:
        images = [entry["images"]] if isinstance(entry["images"], str) else entry["images"]
        if not isinstance(images, list) or not images or not all(isinstance(i, str) and i for i in images):
            raise bad(f'"images" must be a path or a non-empty list of paths, got {entry["images"]!r}')
        entry["images"] = images
    if "mask" in entry and (not isinstance(entry["mask"], str) or not entry["mask"]):
        raise bad(f'"mask" must be a path, got {entry["mask"]!r}')
    if "strength" in entry and not valid_strength(entry["strength"]):
        raise bad(f'"strength" must be a number in (0, 1], got {entry["strength"]!r}')
    if "id" in entry:
        entry["id"] = str(entry["id"])
        if not entry["id"] or not set(entry["id"]) <= ID_CHARACTERS:
            raise bad(f'"id" {entry["id"]!r} must be non-empty and use only letters, digits, ".", "_", "-" '
                      "(it names the file)")
    return {"line": number, **entry}


def valid_strength(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 1


def read_input_image(path: str, what: str) -> InputImage:
    """An input image file, opened and decoded once (a truncated or non-image file fails here, before any model
    loads), with its content's sha256. ValueError naming `what` (e.g. "--image") and the path."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{what} {path}: cannot read it ({e.strerror or e})") from e
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            size = image.size
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise ValueError(f"{what} {path}: not a readable image ({e})") from e
    return InputImage(path=str(path), sha256=hashlib.sha256(data).hexdigest(), size=size)


def derive_seed(base: int, index: int, id: str | None) -> int:
    """base + index; with an id, base + crc32(id): reordering a JSONL file keeps each image."""
    return base + (zlib.crc32(id.encode()) if id is not None else index)


def make_jobs(entries: list[dict], defaults: Defaults) -> list[Job]:
    """Entries (read_prompt_file, or command_line_entries) -> jobs. ValueError when two would write the same file,
    or a derived seed leaves 0..MAX_SEED."""
    jobs, seen, read = [], {}, {}

    def input_image(path: str, what: str) -> InputImage:
        if (path, what) not in read:
            read[path, what] = read_input_image(path, what)
        return read[path, what]

    for index, entry in enumerate(entries):
        where = f"line {entry['line']}" if "line" in entry else f"prompt {index + 1}"
        images = (tuple(input_image(path, f"{where}: images") for path in entry["images"]) if "images" in entry
                  else defaults.images)
        mask = input_image(entry["mask"], f"{where}: mask") if "mask" in entry else defaults.mask
        cfg = float(entry.get("cfg", defaults.cfg))
        seed = entry.get("seed", derive_seed(defaults.seed, index, entry.get("id")))
        if not 0 <= seed <= MAX_SEED:
            how = f"crc32 of its id {entry['id']!r}" if entry.get("id") is not None else f"its index {index}"
            raise ValueError(f"{where}: its seed {seed} (--seed {defaults.seed} + {how}) is beyond {MAX_SEED} "
                             "(2**64 - 1), the largest torch.Generator seed; use a smaller --seed")
        job = Job(
            index=index,
            id=entry.get("id"),
            prompt=entry["prompt"],
            negative_prompt=entry.get("negative_prompt", defaults.negative_prompt) if cfg > 1 else None,
            seed=seed,
            width=entry.get("width", defaults.width),
            height=entry.get("height", defaults.height),
            steps=entry.get("steps", defaults.steps),
            cfg=cfg,
            images=images,
            mask=mask,
            strength=entry.get("strength", defaults.strength),
        )
        if job.stem in seen:
            raise ValueError(f"{where} and {seen[job.stem]} would both write {job.stem}.*; give them different "
                             "ids or seeds")
        seen[job.stem] = where
        jobs.append(job)
    return jobs


class PipelineInputs(NamedTuple):
    """What `render` gives one pipeline class it drives."""

    fewest: int  # input images
    most: int | None  # None: any number
    mask: str  # "required" / "forbidden"
    strength: bool  # --strength allowed
    size_from_image: str | None  # the output sized from the input image, --width/--height "optional" / "refused";
    # None: the text-to-image size defaults


PIPELINE_INPUTS = {
    "QwenImagePipeline": PipelineInputs(0, 0, "forbidden", False, None),
    "QwenImageImg2ImgPipeline": PipelineInputs(1, 1, "forbidden", True, None),
    "QwenImageInpaintPipeline": PipelineInputs(1, 1, "required", True, None),
    "QwenImageEditPipeline": PipelineInputs(1, 1, "forbidden", False, "optional"),
    "QwenImageEditPlusPipeline": PipelineInputs(1, None, "forbidden", False, "optional"),
    "QwenImageEditInpaintPipeline": PipelineInputs(1, 1, "required", True, "refused"),
}


def sizes_from_image(pipeline: str) -> bool:
    """Whether the pipeline class sizes its output from the input image when no size is given."""
    return pipeline in PIPELINE_INPUTS and PIPELINE_INPUTS[pipeline].size_from_image is not None


def check_pipeline_inputs(jobs: list[Job], pipeline: str, model: str, size_given: bool):
    """ValueError for inputs the pipeline class of `model` would not take, or take and ignore."""
    if pipeline not in PIPELINE_INPUTS:
        raise ValueError(f"--model {model} is a {pipeline} checkpoint; render drives "
                         f"{', '.join(PIPELINE_INPUTS)} (the others through the Python API: optimize(pipe))")
    fewest, most, mask, strength, size_from_image = PIPELINE_INPUTS[pipeline]
    if size_given and size_from_image == "refused":
        raise ValueError(f"--width/--height/--aspect: {pipeline} ({model}) sizes its output from the input image")
    for job in jobs:
        where = f"prompt {job.index + 1}"
        if fewest == 0 and job.images:
            raise ValueError(f"{where}: --image given, but {model} is a text-to-image model ({pipeline}); give an "
                             "edit, img2img or inpainting checkpoint with --model")
        if len(job.images) < fewest:
            raise ValueError(f"{where}: {pipeline} ({model}) needs an input image: give --image PATH")
        if most is not None and len(job.images) > most:
            raise ValueError(f"{where}: {pipeline} ({model}) takes {most} input image, got {len(job.images)}")
        if mask == "required" and job.mask is None:
            raise ValueError(f"{where}: {pipeline} ({model}) inpaints: give --mask PATH")
        if mask == "forbidden" and job.mask is not None:
            raise ValueError(f"{where}: --mask given, but {pipeline} ({model}) takes no mask")
        if job.mask is not None and job.mask.size != job.images[0].size:
            raise ValueError(f"{where}: the mask {job.mask.path} is {job.mask.size[0]}x{job.mask.size[1]}, the "
                             f"image {job.images[0].path} {job.images[0].size[0]}x{job.images[0].size[1]}: they must "
                             "be the same size")
        if job.strength is not None and not strength:
            raise ValueError(f"{where}: --strength given, but {pipeline} ({model}) takes none (img2img and "
                             "inpainting pipelines do)")


def shard(jobs: list[Job], rank: int, world_size: int) -> list[Job]:
    """The jobs of one process: prompt i goes to rank i % world_size."""
    return [job for job in jobs if job.index % world_size == rank]


# ---- model


def cached_locally(repo_id: str, filename: str = "model_index.json") -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, filename), str)


def resolve_model(model: str, device) -> tuple[str, str]:
    """"auto" -> the real model when it is in the local Hugging Face cache and a GPU is there, else tiny-random.
    Returns (model, why it was chosen)."""
    if model != "auto":
        return model, "as asked"
    if not cached_locally(REAL_MODEL_ID):
        return TINY_MODEL_ID, f"--model auto: {REAL_MODEL_ID} is not in the local Hugging Face cache"
    if device.type != "cuda":
        return TINY_MODEL_ID, f"--model auto: {REAL_MODEL_ID} is cached but there is no GPU (device {device})"
    return REAL_MODEL_ID, f"--model auto: {REAL_MODEL_ID} found in the local Hugging Face cache"


def pipeline_class_name(model: str) -> str:
    """The pipeline class a checkpoint names in its model_index.json (tiny-random: QwenImagePipeline)."""
    if model == TINY_MODEL_ID:
        return "QwenImagePipeline"
    from .family import pipeline_class_name as from_model_index

    name = from_model_index(model)
    return "QwenImagePipeline" if name == "QwenImageFastPipeline" else name


def check_scheduler(preset: str, scheduler: str):
    if preset == STOCK_PRESET and scheduler != "euler":
        raise ValueError(f"--preset {STOCK_PRESET} runs the stock diffusers pipeline, which samples with Euler only; "
                         f"--scheduler {scheduler} needs another preset")


def labels_for(model: str, preset: str, config: FastConfig, enhancer: str | None = None,
               loras: tuple[Lora, ...] = (), lightning: bool = False) -> Labels:
    check_scheduler(preset, config.scheduler)
    if lightning and config.scheduler != "euler":
        raise ValueError(f"--lightning samples with the Euler schedule the Lightning LoRAs were distilled for; "
                         f"--scheduler {config.scheduler} cannot go with it")
    return Labels(model=model, preset=preset, config=config, note=TINY_NOTE if model == TINY_MODEL_ID else None,
                  enhancer=enhancer, enhancer_note=TINY_ENHANCER_NOTE if enhancer == TINY_ENHANCER_ID else None,
                  loras=tuple(loras), lightning=lightning)


HUB_FILE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+/[\w./-]+\.safetensors$")  # OWNER/NAME/[FOLDER/]FILE
LORA_KEY_PARTS = ("lora_A", "lora_B", "lora_down", "lora_up", "lora.down", "lora.up", "lokr_")


def resolve_lora(source: str, scale: float) -> Lora:
    """--lora SOURCE[:SCALE] -> a Lora: a local .safetensors file, or OWNER/NAME/FILE.safetensors from the hub (the
    local cache under HF_HUB_OFFLINE=1), whose tensors include LoRA factors. ValueError naming it otherwise."""
    path = Path(source).expanduser()
    if path.is_dir():
        raise ValueError(f"--lora {source}: a folder; name the LoRA file in it ({source}/FILE.safetensors)")
    if path.exists():
        file = path
    else:
        parts = source.split("/")
        if not HUB_FILE.match(source):
            raise ValueError(f"--lora {source}: no such file, and not a file in a hub repo "
                             "(OWNER/NAME/FILE.safetensors)")
        from huggingface_hub import hf_hub_download

        repo, filename = "/".join(parts[:2]), "/".join(parts[2:])
        try:
            file = Path(hf_hub_download(repo, filename))
        except Exception as e:  # not cached offline, no such repo or file, no network
            raise ValueError(f"--lora {source}: cannot get {filename} from the hub repo {repo} "
                             f"({type(e).__name__})") from None
    keys = safetensors_keys(file, source)
    if not any(part in key for key in keys for part in LORA_KEY_PARTS):
        raise ValueError(f"--lora {source}: not a LoRA (none of its {len(keys)} tensors is a LoRA factor: "
                         f"lora_A / lora_B / lora_down / lora_up; e.g. {sorted(keys)[:2]})")
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    return Lora(source=source, file=file, scale=scale, sha256=digest.hexdigest())


def safetensors_keys(file: Path, source: str) -> list[str]:
    """The tensor names in a safetensors file's header (8-byte little-endian length, then JSON), without torch."""
    try:
        with open(file, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if not 2 <= length <= 100_000_000:
                raise ValueError
            header = json.loads(f.read(length))
        if not isinstance(header, dict):
            raise ValueError
    except (OSError, ValueError, UnicodeDecodeError):
        raise ValueError(f"--lora {source}: not a safetensors file") from None
    return [key for key in header if key != "__metadata__"]


@contextlib.contextmanager
def held_diffusers_logs():
    """diffusers' log records of the block, shown after it only if it succeeds."""
    import logging

    library = logging.getLogger("diffusers")
    held = []

    class Hold(logging.Handler):
        def emit(self, record):
            held.append(record)

    handlers, library.handlers = library.handlers, [Hold()]
    try:
        yield
    finally:
        library.handlers = handlers
    for record in held:  # not reached when the block raised
        library.handle(record)


def add_loras(pipe, loras: tuple[Lora, ...]):
    """Load each LoRA as adapter lora{i} and activate them all at their scales. LoadError naming a LoRA that fails
    to load or targets no layer of the transformer."""
    names = []
    for i, lora in enumerate(loras):
        name = f"lora{i}"
        with held_diffusers_logs():  # a failure's log lines repeat the error, which is said once, here
            try:
                pipe.load_lora_weights(str(lora.file), adapter_name=name)
            except Exception as e:
                raise LoadError(f"--lora {lora.source}: cannot load it ({type(e).__name__}: {e})") from e
            if name not in pipe.get_list_adapters().get("transformer", []):
                raise LoadError(f"--lora {lora.source}: targets no layer of this model's transformer (none of its "
                                "keys names one of Qwen-Image's modules)")
        names.append(name)
    pipe.set_adapters(names, [lora.scale for lora in loras])


def load_pipeline(model: str, preset: str, config: FastConfig, device, loras: tuple[Lora, ...] = (),
                  lightning: bool = False):
    """STOCK_PRESET: diffusers' own QwenImagePipeline, untouched, so that comparisons are against code this project
    did not write (it samples with the checkpoint's Euler scheduler only; LoRAs load as diffusers loads them, not
    fused). Any other preset: QwenImageFastPipeline with `config`; LoRAs are fused, on the BF16 stock pipeline
    before it is converted (one FP8 rounding of the merged weights) unless the checkpoint is a fast one (FP8
    already: folded into those weights). Real weights load in BF16; tiny-random is built in FP32.
    lightning: the Lightning LoRAs' scheduler replaces the checkpoint's."""
    import diffusers
    import torch

    from .family import load_stock
    from .pipeline import QwenImageFastPipeline, is_fast_checkpoint, optimize
    from .samplers import lightning_scheduler

    check_scheduler(preset, config.scheduler)
    name = pipeline_class_name(model)
    if model == TINY_MODEL_ID:
        from .tiny import tiny_pipeline

        pipe = tiny_pipeline()
    elif preset == STOCK_PRESET or (loras and not is_fast_checkpoint(model)) or name != "QwenImagePipeline":
        pipe = load_stock(getattr(diffusers, name), model)  # in BF16; the class model_index.json names
    else:
        pipe = QwenImageFastPipeline.from_pretrained(model, dtype=torch.bfloat16, fast_config=config, device=device)
    if loras:
        add_loras(pipe, loras)
        if preset != STOCK_PRESET:
            pipe.fuse_lora()
            if not isinstance(pipe, QwenImageFastPipeline):
                pipe.unload_lora_weights()  # the merged weights stay; optimize() quantizes them once
    if preset != STOCK_PRESET and not isinstance(pipe, QwenImageFastPipeline):
        pipe = optimize(pipe, config, device=device)  # an image-conditioned pipeline: its fast class (family.py)
    if lightning:
        pipe.scheduler = lightning_scheduler()
    if config.memory == "fast":  # memory="low" placed the components itself
        pipe = pipe.to(device)
    pipe.set_progress_bar_config(disable=True)  # our own bars count images and steps
    return pipe


# ---- files


def settings_of(job: Job, labels: Labels) -> dict:
    """What was asked for, embedded in an image and recorded in its manifest line: resume compares these.
    `enhancer` is always there (None without --enhance), so a run with another enhancer, or none, differs."""
    settings = dict(prompt=job.prompt, negative_prompt=job.negative_prompt, seed=job.seed, width=job.width,
                    height=job.height, steps=job.steps, cfg=job.cfg, model=labels.model, preset=labels.preset,
                    scheduler=labels.scheduler, enhancer=labels.enhancer)
    if job.images:  # what the image-conditioned pipelines were given (content hashes: resume compares those)
        settings |= dict(images=[image.record() for image in job.images],
                         mask=None if job.mask is None else job.mask.record(), strength=job.strength)
    return (settings | ({"loras": [lora.record() for lora in labels.loras]} if labels.loras else {})
            | ({"note": labels.note} if labels.note else {})
            | ({"enhancer_note": labels.enhancer_note} if labels.enhancer_note else {}))


def image_settings(settings: dict, enhanced: str | None, applied: list[str]) -> dict:
    """What an image records: settings, enhanced_prompt right after prompt (when there is one), and applied."""
    if enhanced is not None:
        settings = {"prompt": settings["prompt"], "enhanced_prompt": enhanced,
                    **{k: v for k, v in settings.items() if k != "prompt"}}
    return {**settings, "applied": list(applied)}


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
    """The settings as one JSON object: PNG in an iTXt "Description" chunk (UTF-8), JPEG/WebP in EXIF
    ImageDescription (ASCII-escaped). The same JSON in every format, so read_settings gives the same types."""
    if fmt == "png":
        info = PngInfo()
        info.add_itxt(PNG_DESCRIPTION, to_json(settings))
        write_atomic(path, lambda f: image.save(f, format="PNG", pnginfo=info))
    else:
        exif = Image.Exif()
        exif[EXIF_IMAGE_DESCRIPTION] = to_json(settings, ensure_ascii=True)
        write_atomic(path, lambda f: image.save(f, format=FORMATS[fmt], exif=exif, quality=95))


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


def prepare_out_dir(out_dir: str | Path) -> Path:
    out_dir = Path(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / f"{TEMP_PREFIX}probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"--out {out_dir}: not a writable folder ({e.strerror or e})") from e
    return out_dir


# ---- manifest


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


def read_records(out_dir: Path) -> dict[str, dict]:
    """{file name: its latest manifest line} over manifest.jsonl and the rank shards; unreadable lines skipped."""
    records = {}
    for path in [out_dir / MANIFEST, *sorted(out_dir.glob("manifest.rank*.jsonl"))]:
        if not path.exists():
            continue
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
                name, when = record["file"], record["time"]
            except (json.JSONDecodeError, TypeError, KeyError):
                continue
            if name not in records or when >= records[name]["time"]:
                records[name] = record
    return records


def transformer_heads(model: str) -> int | None:
    """The attention heads of a checkpoint's transformer, from its config alone (None when it cannot be read
    without loading: the pipeline checks again once loaded)."""
    if model == TINY_MODEL_ID:
        from .tiny import TINY_HEADS

        return TINY_HEADS
    from .pipeline import checkpoint_heads

    return checkpoint_heads(model)


def start_mesh(device, shape):
    """With --parallel: the default process group (NCCL on CUDA, gloo on the CPU) and the mesh of `shape` (a
    parallel.MeshShape) on it. Its image groups render one image together: the leader of each decides what is
    left to render and writes images and manifest lines; the others take part in every call and write nothing."""
    import torch
    import torch.distributed as dist

    from .pipelines.qwen_image.parallel import ParallelMesh

    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                device_id=device if device.type == "cuda" else None)
    return ParallelMesh(shape)


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


# ---- rendering


def lora_identity(records) -> list | None:
    """What makes two LoRA sets the same work: each file's content and scale, in order (not where the file is)."""
    return None if not records else [(r.get("sha256"), r.get("scale")) for r in records]


def differing_settings(job: Job, recorded: dict, labels: Labels) -> list[str]:
    """The settings of `job` that `recorded` (a manifest line or embedded settings) does not have. `loras` is
    compared whenever either side has it (images made without LoRAs, before the setting existed, record none);
    LoRAs, input images and masks by content (sha256), not by where their files are."""
    wanted = settings_of(job, labels)
    by_content = {"images": lambda records: None if records is None else [r.get("sha256") for r in records],
                  "mask": lambda record: None if record is None else record.get("sha256"), "loras": lora_identity}
    differing = [key for key, value in wanted.items() if key not in by_content and recorded.get(key) != value]
    differing += [key for key, identity in by_content.items()
                  if (key in wanted or key == "loras") and identity(wanted.get(key)) != identity(recorded.get(key))]
    return differing


def is_done(job: Job, records: dict[str, dict], out_dir: Path, fmt: str, labels: Labels) -> bool:
    name = f"{job.stem}.{fmt}"
    record = records.get(name)
    return record is not None and (out_dir / name).exists() and not differing_settings(job, record, labels)


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
        recorded = records.get(path.name)
        if recorded is None:
            try:
                recorded = read_settings(path)
            except (OSError, SyntaxError, ValueError):
                recorded = {}
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


def batch_key(job: Job) -> tuple:
    """Jobs with equal keys can share one pipeline call; one with input images runs alone (Edit-2509/2511's
    pipeline takes one prompt a call)."""
    return job.width, job.height, job.steps, job.cfg, job.negative_prompt is None, job.index if job.images else None


def batches_of(jobs: list[Job], batch_size: int) -> list[list[Job]]:
    """Consecutive jobs with the same batch_key, at most batch_size a batch."""
    batches = []
    for job in jobs:
        if batches and len(batches[-1]) < batch_size and batch_key(batches[-1][0]) == batch_key(job):
            batches[-1].append(job)
        else:
            batches.append([job])
    return batches


ENCODE_AHEAD_IMAGES = 16  # memory="low": images whose prompts one text-encoder turn encodes (their embeddings,
# ~2 MB each, wait on the GPU until rendered)


def encode_ahead(pipe, batches: list[list[Job]], first: int) -> tuple[dict[int, dict], int]:
    """FastConfig.memory="low": the prompts and negative prompts of the text-to-image batches from `first` on,
    ENCODE_AHEAD_IMAGES images' worth, encoded before they are rendered (one text-encoder turn on the GPU for all of
    them, not one per call), as their own calls would encode them (one encode_prompt of the batch's list each).
    Returns (batch index -> run_batch's text arguments, the index of the first batch not covered); a batch whose
    encoding fails is left out (its own call encodes it, and reports the error)."""
    encoded, images, i = {}, 0, first
    while i < len(batches) and images < ENCODE_AHEAD_IMAGES:
        batch = batches[i]
        i, images = i + 1, images + len(batch)
        if batch[0].images:
            continue
        try:
            embeds, mask = pipe.encode_prompt([job.prompt for job in batch], device=pipe._execution_device)
            text = dict(prompt_embeds=embeds, prompt_embeds_mask=mask)
            if batch[0].negative_prompt is not None:
                embeds, mask = pipe.encode_prompt([job.negative_prompt for job in batch],
                                                  device=pipe._execution_device)
                text |= dict(negative_prompt_embeds=embeds, negative_prompt_embeds_mask=mask)
        except Exception:
            continue
        encoded[i - 1] = text
    return encoded, i


def run_batch(pipe, batch: list[Job], on_step, prompts: list[str] | None = None,
              encoded: dict | None = None) -> list[Image.Image]:
    """One pipeline call (prompts: what to render instead of the jobs' own, e.g. their rewrites; encoded: the jobs'
    prompts already encoded, encode_ahead). One CPU generator per image: the same seed gives the same latents at any
    batch size and on any device."""
    import torch

    first = batch[0]
    inputs = {}
    if encoded is not None:
        text = dict(encoded)
    else:
        text = dict(prompt=prompts or [job.prompt for job in batch],
                    negative_prompt=None if first.negative_prompt is None else [job.negative_prompt for job in batch])
    if first.images:  # a batch of one (batch_key)
        images = [image.load("RGB") for image in first.images]
        inputs["image"] = images if len(images) > 1 else images[0]  # EditPlus takes one as [one]
        inputs |= {"mask_image": first.mask.load("L")} if first.mask is not None else {}
        inputs |= {"strength": first.strength} if first.strength is not None else {}
    inputs |= {"width": first.width, "height": first.height} if first.width is not None else {}
    return pipe(
        **text,
        true_cfg_scale=first.cfg,
        num_inference_steps=first.steps,
        generator=[torch.Generator("cpu").manual_seed(job.seed) for job in batch],
        callback_on_step_end=on_step,
        **inputs,
    ).images


def render_jobs(load_pipe: Callable, jobs: list[Job], out_dir: Path, labels: Labels, *, fmt: str = "png",
                resume: bool = True, batch_size: int = 1, rank: int = 0, world_size: int = 1,
                load_enhancer: Callable | None = None, group=None) -> Summary:
    """Render this rank's jobs into out_dir (prepare_out_dir first), skipping finished ones when resuming, then
    merge the manifest. load_pipe() and load_enhancer() (needed when labels.enhancer is set) are called only if
    something is left to render. A failed batch (enhancement or rendering) is reported and counted; the others go
    on. Each image records pipe.applied as it is after the call that made it. Ctrl-C raises Interrupted(written)
    after merging the manifest (when this run wrote something); finished images are kept, no partial file is left.
    group: with --parallel, the ParallelMesh (start_mesh); rank / world_size number the image groups, only each
    group's leader reads the folder, rewrites prompts and writes, and the others follow its decisions."""
    if labels.enhancer is not None and load_enhancer is None:
        raise ValueError(f"labels.enhancer={labels.enhancer!r} needs load_enhancer")
    leader = group is None or group.is_image_leader
    pending = []
    if leader:
        remove_stale_temp_files(out_dir, jobs)
        records = read_records(out_dir) if resume else {}
        pending = [job for job in jobs if not is_done(job, records, out_dir, fmt, labels)]
    if group is not None:
        wanted = set(group.share([job.index for job in pending]))
        pending = [job for job in jobs if job.index in wanted]
    summary = Summary(skipped=len(jobs) - len(pending))
    enhancer = load_enhancer() if pending and labels.enhancer is not None and leader else None
    pipe = load_pipe() if pending else None
    shard_path = manifest_path(out_dir, rank, world_size)
    if leader:
        drop_partial_last_line(shard_path)
    batches = batches_of(pending, batch_size)
    prefix = f"rank {rank}: " if world_size > 1 else ""
    ahead = labels.enhancer is None and getattr(pipe, "text_encoder_takes_turns", False)
    encoded, encoded_until = {}, 0

    try:
        with tqdm(total=len(pending), desc=f"{prefix}images", unit="img", position=0) as images_bar, \
                tqdm(total=sum(batch[0].steps for batch in batches), desc=f"{prefix}steps", unit="step",
                     position=1, leave=False) as steps_bar:

            def on_step(pipe, step, timestep, callback_kwargs):
                steps_bar.update()
                return {}

            for index, batch in enumerate(batches):
                if ahead and index >= encoded_until:
                    encode_start = time.perf_counter()
                    encoded, encoded_until = encode_ahead(pipe, batches, index)
                    summary.seconds += time.perf_counter() - encode_start  # counted in s/image
                start = time.perf_counter()
                enhanced, enhance_seconds = [None] * len(batch), 0.0
                try:
                    if enhancer is not None:
                        enhanced = enhancer.enhance([job.prompt for job in batch])
                        enhance_seconds = time.perf_counter() - start
                    if group is not None and labels.enhancer is not None:  # the leader's rewrites
                        enhanced = group.share(enhanced)
                    images = run_batch(pipe, batch, on_step, prompts=None if labels.enhancer is None else enhanced,
                                       encoded=encoded.get(index))
                except Exception as e:  # e.g. out of memory at one size: report it and render the rest
                    summary.failed += len(batch)
                    tqdm.write(f"{prefix}failed: {', '.join(job.stem for job in batch)}: {type(e).__name__}: {e}")
                    continue
                summary.applied = tuple(getattr(pipe, "applied", ()))  # what this call ran
                seconds = (time.perf_counter() - start) / len(batch)
                timing = {"seconds": round(seconds, 3)}
                if enhancer is not None:
                    timing["enhance_seconds"] = round(enhance_seconds / len(batch), 3)
                for job, image, rewrite in zip(batch, images, enhanced):
                    if not leader:
                        continue
                    name = f"{job.stem}.{fmt}"
                    settings = image_settings(settings_of(job, labels), rewrite, summary.applied)
                    save_image(image, out_dir / name, fmt, settings)
                    append_line(shard_path, dict(file=name, id=job.id, index=job.index, **settings, **timing,
                                                 rank=rank, time=time.time()))
                    summary.written += 1
                    images_bar.update()
                summary.enhance_seconds += enhance_seconds
                summary.seconds += time.perf_counter() - start
    except KeyboardInterrupt:
        if summary.written:
            merge_manifests(out_dir)
        raise Interrupted(summary.written) from None
    if leader:
        merge_manifests(out_dir)
    return summary


def format_summary(summary: Summary, labels: Labels, out_dir: Path, rank: int = 0, world_size: int = 1) -> str:
    prefix = f"rank {rank}/{world_size}: " if world_size > 1 else ""
    per_image = f"{summary.seconds_per_image:.2f} s/image" if summary.written else "no image rendered"
    if summary.written and labels.enhancer is not None:
        per_image += f" ({summary.enhance_seconds / summary.written:.2f} s of it rewriting the prompt)"
    lines = [f"{prefix}{summary.written} written, {summary.skipped} skipped (already done), {summary.failed} failed; "
             f"{per_image}; {out_dir / MANIFEST}"]
    if labels.note:
        lines.append(f"{prefix}note: these images are {labels.note}")
    if labels.enhancer_note:
        lines.append(f"{prefix}note: the enhanced prompts are {labels.enhancer_note}")
    return "\n".join(lines)
