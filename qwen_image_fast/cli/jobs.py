"""Prompts -> jobs, one image each: a prompt file (.txt, .jsonl) or the prompts given as arguments -> entries ->
jobs, with the command's defaults (render_defaults: size, steps, cfg, seed, negative prompt, input images) under each
line's own settings, per-prompt seeds, and the split of the jobs over processes (shard).
"""

import json
import math
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from .inputs import QWEN21_PIPELINE, InputImage, read_input_image, sizes_from_image, valid_strength

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
REAL_STEPS, REAL_CFG = 50, 4.0
LIGHTNING_STEPS, LIGHTNING_CFG = 8, 1.0
# Qwen-Image-2.1's pipeline defaults: 40 steps, no CFG (guidance distilled in), 1024x1024 (output_resolution) or
# sized from the last input image; it renders multiples of 32 pixels (calculate_dimensions).
QWEN21_STEPS, QWEN21_CFG, QWEN21_SIDE, QWEN21_MULTIPLE = 40, 1.0, 1024, 32
# One step gives NaN images: Qwen's scheduler stretches 1 - sigma by its last value (shift_terminal), 0 at 1 step.
MIN_STEPS = 2
# torch.Generator.manual_seed takes -2**63 .. 2**64 - 1 and wraps negatives (-1 is 2**64 - 1): only 0 .. 2**64 - 1,
# so that two different seeds never give the same image under two names.
MAX_SEED = 2**64 - 1
JSONL_FIELDS = {"prompt", "negative_prompt", "seed", "width", "height", "steps", "cfg", "id", "images", "mask",
                "strength"}
ID_CHARACTERS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")
PROMPT_FILE_SUFFIXES = {".txt", "", ".jsonl", ".parquet"}  # what read_prompt_file reads (text: one prompt a line)


@dataclass(frozen=True)
class Defaults:
    """Settings for every prompt that its JSONL line does not override. width/height None: the pipeline sizes the
    output from the input image (the edit pipelines, Qwen-Image-2.1); text_size: then the size of a job without
    input images (Qwen-Image-2.1's)."""

    negative_prompt: str
    seed: int
    width: int | None
    height: int | None
    steps: int
    cfg: float
    images: tuple[InputImage, ...] = ()
    mask: InputImage | None = None
    strength: float | None = None
    text_size: tuple[int, int] | None = None
    negative_prompt_given: bool = False  # --negative-prompt on the command line (else the default one)
    sigmas: tuple[float, ...] | None = None  # --sigmas: every job's schedule (its steps are their count)


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
    sigmas: tuple[float, ...] | None = None  # the schedule the pipeline samples on (sigmas=), one per step

    @property
    def stem(self) -> str:
        return f"{self.id if self.id is not None else f'{self.index:05d}'}-{self.seed}"


def read_prompt_file(path: str | Path) -> list[dict]:
    """A .jsonl file (objects with "prompt" and optional JSONL_FIELDS), a .parquet file (read_parquet_prompts) or a
    text file (one prompt a line; blank lines and lines starting with # skipped) -> entries {"line": n, "prompt":
    ..., ...}. ValueError names the line. A URI (s3://, gs://, hdfs://, file://...) is read through pyarrow's
    filesystems (the `ray` extra)."""
    name = str(path)
    suffix = PurePosixPath(name.split("://", 1)[-1]).suffix.lower()
    if suffix not in PROMPT_FILE_SUFFIXES:  # a .csv read as text would render its header as a prompt
        raise ValueError(f"--prompts {name}: a {suffix} file, which render does not read; allowed: .txt (or no "
                         "suffix: one prompt a line), .jsonl (one JSON object a line) and .parquet (a prompt column "
                         "and the JSONL fields as columns)")
    if suffix == ".parquet":
        return read_parquet_prompts(name)
    try:
        data = read_uri(name) if is_uri(name) else Path(name).read_bytes()
        lines = data.decode("utf-8-sig").splitlines()  # -sig: a byte-order mark is not the prompt's
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--prompts {name}: cannot read it ({e})") from e
    jsonl = suffix == ".jsonl"
    entries = []
    for number, line in enumerate(lines, start=1):
        if not line.strip() or (not jsonl and line.lstrip().startswith("#")):
            continue
        if not jsonl and looks_like_json_object(line):
            raise ValueError(f"--prompts {name}, line {number}: a JSON object in a text prompt file, which would be "
                             "taken as the prompt itself: name the file .jsonl to read its fields")
        entries.append(parse_jsonl_line(name, number, line) if jsonl else {"line": number, "prompt": line.strip()})
    if not entries:
        raise ValueError(f"--prompts {name}: no prompts in it (blank lines and # comments are skipped)")
    return entries


def is_uri(name: str) -> bool:
    return "://" in name


def read_uri(uri: str) -> bytes:
    """The bytes at `uri`, through the filesystem pyarrow opens for its scheme (OSError when it cannot)."""
    try:
        import pyarrow.fs
    except ImportError:
        raise ValueError(f"--prompts {uri}: reading a URI needs pyarrow: pip install 'qwen-image-fast[ray]'") \
            from None
    try:
        filesystem, path = pyarrow.fs.FileSystem.from_uri(uri)
        with filesystem.open_input_stream(path) as stream:
            return stream.read()
    except pyarrow.ArrowException as e:  # an unknown scheme, a filesystem pyarrow was built without
        raise OSError(str(e)) from None


def read_parquet_prompts(path: str) -> list[dict]:
    """A Parquet file (pyarrow, with the `ray` extra): a "prompt" column and any of the JSONL fields as columns, one
    row a prompt; a row's null is a field it does not give. Each row checked as a JSONL line is ("row N")."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"--prompts {path}: reading Parquet needs pyarrow: pip install 'qwen-image-fast[ray]'") \
            from None
    try:
        table = pq.read_table(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"--prompts {path}: not a readable Parquet file ({e})") from None
    if "prompt" not in table.column_names:
        raise ValueError(f"--prompts {path}: no \"prompt\" column (its columns: {', '.join(table.column_names)})")
    entries = [parse_jsonl_line(path, number, json.dumps({k: v for k, v in row.items() if v is not None}), "row")
               for number, row in enumerate(table.to_pylist(), start=1)]
    if not entries:
        raise ValueError(f"--prompts {path}: no rows in it")
    return entries


def lone_surrogate(text: str) -> str | None:
    """Where `text` holds a lone UTF-16 surrogate (a JSON "\\ud800" escape, or argv bytes that are not UTF-8), which no
    tokenizer takes: "U+D800 at character 2"; else None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"U+{ord(text[e.start]):04X} at character {e.start}"
    return None


def looks_like_json_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except json.JSONDecodeError:
        return False


def command_line_entries(prompts: list[str]) -> list[dict]:
    """Prompts given as arguments -> entries; an empty or blank one is rejected, as in a JSONL file."""
    for number, prompt in enumerate(prompts, start=1):
        if not prompt.strip():
            raise ValueError(f"prompt {number} is {'empty' if not prompt else 'only whitespace'}: give a non-empty "
                             "prompt")
        if lone_surrogate(prompt):
            raise ValueError(f"prompt {number} holds a lone surrogate ({lone_surrogate(prompt)}), which is not text: "
                             "give it as UTF-8")
    return [{"prompt": prompt} for prompt in prompts]


def parse_jsonl_line(path: str | Path, number: int, line: str, unit: str = "line") -> dict:
    def bad(why):
        return ValueError(f"--prompts {path}, {unit} {number}: {why}")

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
    for name in ("prompt", "negative_prompt"):
        if name in entry and lone_surrogate(entry[name]):
            raise bad(f'"{name}" holds a lone surrogate ({lone_surrogate(entry[name])}), which is not text (a '
                      '"\\ud800"-style escape without its pair): write the character itself, or both halves')
    for name in ("seed", "width", "height", "steps"):
        if name in entry and (not isinstance(entry[name], int) or isinstance(entry[name], bool)):
            raise bad(f'"{name}" must be an integer, got {entry[name]!r}')
    for name in ("width", "height"):
        if name in entry and (entry[name] < 16 or entry[name] % 16):
            raise bad(f'"{name}" must be a positive multiple of 16, got {entry[name]}')
    if ("width" in entry) != ("height" in entry):  # as --width and --height on the command line
        raise bad(f'"{"width" if "width" in entry else "height"}" without "{"height" if "width" in entry else "width"}"'
                  ': give both, or neither (the default size)')
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
        if not entry["id"] or not set(entry["id"]) <= ID_CHARACTERS or entry["id"].startswith("."):
            raise bad(f'"id" {entry["id"]!r} must be non-empty, use only letters, digits, ".", "_", "-" and not '
                      "start with \".\" (it names the file; hidden names are the tool's temporary files)")
    return {unit: number, **entry}


def derive_seed(base: int, index: int, id: str | None) -> int:
    """base + index; with an id, base + crc32(id): reordering a JSONL file keeps each image."""
    return base + (zlib.crc32(id.encode()) if id is not None else index)


def make_jobs(entries: list[dict], defaults: Defaults, first_index: int = 0) -> list[Job]:
    """Entries (read_prompt_file, or command_line_entries) -> jobs, the first at index `first_index` (a Ray stage's
    rows are a part of the whole list). ValueError when two would write the same file, or a derived seed leaves
    0..MAX_SEED."""
    jobs, seen, read = [], {}, {}

    def input_image(path: str, what: str) -> InputImage:
        if (path, what) not in read:
            read[path, what] = read_input_image(path, what)
        return read[path, what]

    for index, entry in enumerate(entries, start=first_index):
        where = next((f"{unit} {entry[unit]}" for unit in ("line", "row") if unit in entry), f"prompt {index + 1}")
        images = (tuple(input_image(path, f"{where}: images") for path in entry["images"]) if "images" in entry
                  else defaults.images)
        mask = input_image(entry["mask"], f"{where}: mask") if "mask" in entry else defaults.mask
        cfg = float(entry.get("cfg", defaults.cfg))
        if "negative_prompt" in entry and cfg <= 1:
            raise ValueError(f"{where}: a negative_prompt with cfg {cfg:g}, which runs no classifier-free guidance "
                             "(the negative prompt would be unused): give a cfg > 1, or no negative_prompt")
        width, height = entry.get("width", defaults.width), entry.get("height", defaults.height)
        if width is None and not images and defaults.text_size is not None:
            width, height = defaults.text_size
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
            width=width,
            height=height,
            steps=entry.get("steps", defaults.steps),
            cfg=cfg,
            images=images,
            mask=mask,
            strength=entry.get("strength", defaults.strength),
            sigmas=defaults.sigmas,
        )
        if job.sigmas is not None and job.steps != len(job.sigmas):
            raise ValueError(f'{where}: "steps" {job.steps}, but --sigmas gives {len(job.sigmas)} (one per step): '
                             'leave "steps" out, or give --sigmas for that many steps')
        if job.stem in seen:
            raise ValueError(f"{where} and {seen[job.stem]} would both write {job.stem}.*; give them different "
                             "ids or seeds")
        seen[job.stem] = where
        jobs.append(job)
    if defaults.negative_prompt_given and jobs and all(job.cfg <= 1 for job in jobs):
        raise ValueError(f"--negative-prompt given, but every prompt runs with cfg <= 1 ({jobs[0].cfg:g}): no "
                         "classifier-free guidance, the negative prompt would be unused; give --cfg > 1, or leave "
                         "--negative-prompt out")
    return jobs


def tiny_aspect(width: int, height: int) -> tuple[int, int]:
    """An official size scaled to a test model's: the same aspect at about TINY_SIZE² pixels, multiples of 16."""
    real = ASPECTS["1:1"][0]
    return tuple(max(16, 16 * round(side * TINY_SIZE / real / 16)) for side in (width, height))


def area_aspect(width: int, height: int, side: int, multiple: int) -> tuple[int, int]:
    """The aspect of width x height at about side² pixels, each side rounded to a multiple of `multiple`
    (QwenImage21Pipeline's calculate_dimensions)."""
    ratio = width / height
    wide = math.sqrt(side * side * ratio)
    return max(multiple, multiple * round(wide / multiple)), max(multiple, multiple * round(wide / ratio / multiple))


def render_defaults(args, tiny: bool, pipeline: str = "QwenImagePipeline") -> Defaults:
    """pipeline: the class the checkpoint names; an edit pipeline sizes its output from the input image unless
    --aspect / --width / --height say otherwise, Qwen-Image-2.1 too (QWEN21_SIDE² without one, and its own step
    and cfg defaults). tiny: a test-size model (cli/sizes.py), whose defaults are TINY_SIZE and TINY_STEPS and whose
    --aspect sizes are scaled down to about TINY_SIZE²."""
    if args.aspect and (args.width or args.height):
        raise ValueError("give --aspect or --width/--height, not both")
    if (args.width is None) != (args.height is None):
        raise ValueError("give --width and --height together")
    qwen21 = pipeline == QWEN21_PIPELINE
    if args.aspect and qwen21:
        width, height = area_aspect(*ASPECTS[args.aspect], TINY_SIZE if tiny else QWEN21_SIDE, QWEN21_MULTIPLE)
    elif args.aspect:
        width, height = tiny_aspect(*ASPECTS[args.aspect]) if tiny else ASPECTS[args.aspect]
    elif args.width:
        width, height = args.width, args.height
    elif sizes_from_image(pipeline):
        width, height = None, None
    else:
        width, height = (TINY_SIZE, TINY_SIZE) if tiny else ASPECTS["1:1"]
    text_size = ((TINY_SIZE, TINY_SIZE) if tiny else (QWEN21_SIDE, QWEN21_SIDE)) if qwen21 and width is None else None
    if args.sigmas is not None and args.steps is not None and args.steps != len(args.sigmas):
        raise ValueError(f"--steps {args.steps} with --sigmas of {len(args.sigmas)} values (one per step): give "
                         "one or the other")
    steps = (len(args.sigmas) if args.sigmas is not None else args.steps or
             (TINY_STEPS if tiny else LIGHTNING_STEPS if args.lightning else QWEN21_STEPS if qwen21 else REAL_STEPS))
    cfg = (args.cfg if args.cfg is not None else LIGHTNING_CFG if args.lightning else QWEN21_CFG if qwen21
           else REAL_CFG)
    images = tuple(read_input_image(path, "--image") for path in args.image)
    mask = read_input_image(args.mask, "--mask") if args.mask is not None else None
    negative = args.negative_prompt if args.negative_prompt is not None else NEGATIVE_PROMPT
    return Defaults(negative_prompt=negative, negative_prompt_given=args.negative_prompt is not None, seed=args.seed,
                    width=width, height=height, steps=steps, cfg=cfg, images=images, mask=mask,
                    strength=args.strength, text_size=text_size, sigmas=args.sigmas)


def shard(jobs: list[Job], rank: int, world_size: int) -> list[Job]:
    """The jobs of one process: prompt i goes to rank i % world_size."""
    return [job for job in jobs if job.index % world_size == rank]
