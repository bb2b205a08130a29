"""The model: --model and --enhance checked before anything loads (a local checkpoint folder, or a hub id that is
cached when the hub is offline), --model auto resolved, the checkpoint's pipeline class and attention heads read from
its config files, what produces the images (Labels: model, preset, config, enhancer, LoRAs), and the pipeline loaded.
"""

import contextlib
from dataclasses import dataclass
from pathlib import Path

from ..pipelines.core.config import FastConfig
from ..pipelines.core.hub import HUB_ID
from .loras import Lora

REAL_MODEL_ID = "Qwen/Qwen-Image-2512"
# Also in tiny.py and pipelines/qwen35/enhance.py, which import torch and diffusers; test_cli checks they agree.
TINY_MODEL_ID = "tiny-random"
TINY_ENHANCER_ID = "tiny-random"
DEFAULT_ENHANCER_ID = "Qwen/Qwen3.5-4B"
# "baseline" renders with diffusers' own QwenImagePipeline, untouched; every other preset with QwenImageFastPipeline.
STOCK_PRESET = "baseline"
TINY_NOTE = "noise from random weights (tiny-random test model), not a rendering of the prompt"
TEST_SIZE_NOTE = "from a test-size model (transformer width {width}), not a full-size rendering of the prompt"
# With a test-size model the edit pipelines' input images are shrunk (pipelines/tiny.py small_condition_images).
SHRUNK_INPUTS_NOTE = "; its input images resized to 1/{divisor} of the area diffusers resizes them to"
TINY_ENHANCER_NOTE = "gibberish from random weights (tiny-random Qwen3.5), not a rewriting of the prompt"


class LoadError(ValueError):
    """The model or the prompt enhancer could not be loaded (not cached, not a checkpoint, ...): bad input."""


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

    @property
    def options(self) -> dict:
        """The options the command changed from its preset, recorded with each image (resume compares them);
        scheduler is recorded on its own, and memory / parallel give the same images bit for bit."""
        changed = self.config.differences(FastConfig.preset(self.preset))
        if "cache" in changed:  # as applied labels it (no preset has one)
            changed["cache"] = self.config.cache.label()
        return {name: value for name, value in changed.items()
                if name not in ("scheduler", "memory", "parallel", "ulysses_degree")}


def hub_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def check_checkpoint(option: str, name: str, marker: str):
    """A local folder must hold `marker` (model_index.json for a diffusers pipeline, config.json for a transformers
    model); anything else must look like a hub id, and be cached when the hub is offline (HF_HUB_OFFLINE=1)."""
    path = Path(name).expanduser()
    if path.exists():
        if not (path / marker).is_file():
            raise ValueError(f"{option} {name}: a local {'folder' if path.is_dir() else 'file'} without "
                             f"{marker}, not a checkpoint")
        return
    if not HUB_ID.match(name):
        raise ValueError(f"{option} {name}: no such local folder, and not a hub id (owner/name)")
    if hub_offline() and not cached_locally(name, marker):
        raise ValueError(f"{option} {name}: not in the local Hugging Face cache, and HF_HUB_OFFLINE=1 forbids "
                         "downloading it")


def check_model(model: str):
    if model not in (TINY_MODEL_ID, "auto") and not Path(model).expanduser().is_file():
        check_checkpoint("--model", model, "model_index.json")


FILE_SUFFIXES = (".safetensors", ".sft", ".gguf")


@dataclass(frozen=True)
class SingleFiles:
    """--model FILE: the transformer from the file, the text encoder and VAE from --text-encoder / --vae files or
    from --base, which gives the configs, tokenizer and scheduler (pipelines/loading.py from_single_files)."""

    transformer: str
    base: str
    text_encoder: str | None = None
    vae: str | None = None

    @property
    def label(self) -> str:
        """What the images record as their model."""
        parts = [f"base {self.base}"] + [f"{name} {path}" for name, path in (("text encoder", self.text_encoder),
                                                                            ("vae", self.vae)) if path]
        return f"{self.transformer} ({', '.join(parts)})"

    def plan(self, config: FastConfig, pipeline: str):
        """What loading the transformer file will keep, dequantize or requantize (core/single_file/fast_state.py
        Loaded), from the headers: no tensor is read."""
        from ..pipelines.loading import BY_CLASS_NAME

        model_class = next(cls for cls in BY_CLASS_NAME.values()
                           if cls.stock_class.__name__ == pipeline).fast_transformer_class
        return model_class.plan_single_file(self.transformer, config=self.base, subfolder="transformer",
                                            fast_config=config.transformer_config())

    def check(self, config: FastConfig, pipeline: str):
        """Every file readable, the transformer's a transformer this pipeline takes with base's config (its keys
        and shapes), the others' headers readable: CheckpointFileError (a ValueError) in one line otherwise."""
        from ..pipelines.core.single_file.formats import CheckpointFile

        self.plan(config, pipeline)
        for path in (self.text_encoder, self.vae):
            if path:
                CheckpointFile(path)

    def describe(self, loaded) -> list[str]:
        """For --dry-run: each file, and what loading does with what it stores."""
        from ..pipelines.core.single_file.formats import CheckpointFile

        lines = [f"transformer file {CheckpointFile(self.transformer).describe()}"]
        lines += [f"  {line}" for line in loaded.describe()] or ["  every tensor kept as the file stores it"]
        for name, path in (("text encoder", self.text_encoder), ("vae", self.vae)):
            if path:
                file = CheckpointFile(path)
                quantized = sorted(s for s in file.sources() if s.startswith(("fp8", "gguf_q")))
                lines.append(f"{name} file {file.describe()}" + (
                    f"\n  dequantized from {', '.join(quantized)} to BF16" if quantized else ""))
        return lines


def single_files(args) -> SingleFiles | None:
    """--model FILE and its companions, checked (render's and serve's); None for a checkpoint folder or hub id
    (which take none of --base, --text-encoder, --vae)."""
    path = Path(args.model).expanduser()
    companions = [option for option, value in (("--base", args.base), ("--text-encoder", args.text_encoder),
                                               ("--vae", args.vae)) if value is not None]
    if not path.is_file():
        if companions:
            raise ValueError(f"{companions[0]} goes with a --model file (a transformer .safetensors or .gguf); "
                             f"--model {args.model} is a checkpoint with its own components")
        return None
    if args.preset == STOCK_PRESET:
        raise ValueError(f"--preset {STOCK_PRESET} runs diffusers' own pipeline from a checkpoint folder; a --model "
                         "file loads into the fast pipeline (another --preset)")
    if path.suffix not in FILE_SUFFIXES:
        raise ValueError(f"--model {args.model}: a file, but not {', '.join(FILE_SUFFIXES)}: give a checkpoint "
                         "folder, a hub id, or a transformer .safetensors / .gguf file")
    for option, value in (("--text-encoder", args.text_encoder), ("--vae", args.vae)):
        if value is not None and not Path(value).expanduser().is_file():
            raise ValueError(f"{option} {value}: no such file")
    base = args.base or REAL_MODEL_ID
    check_checkpoint("--base", base, "model_index.json")
    return SingleFiles(str(path), base, args.text_encoder, args.vae)


def check_enhancer(enhance: str | None):
    """--enhance's value must name a model: `render --enhance "a red fox"` would otherwise take the prompt for one."""
    if enhance is None or enhance == TINY_ENHANCER_ID:
        return
    if not Path(enhance).expanduser().exists() and not HUB_ID.match(enhance):
        raise ValueError(f"--enhance {enhance!r}: neither a local folder nor a hub id (owner/name); to rewrite with "
                         f"the default model, put the prompts before --enhance or write --enhance={DEFAULT_ENHANCER_ID}")
    check_checkpoint("--enhance", enhance, "config.json")


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
    """The diffusers pipeline class of a checkpoint, from its model_index.json (a fast pipeline's folder names its
    fast class: the diffusers class it extends); tiny-random: QwenImagePipeline."""
    if model == TINY_MODEL_ID:
        return "QwenImagePipeline"
    from ..pipelines.loading import BY_CLASS_NAME, pipeline_class_name as from_model_index

    name = from_model_index(model)
    return BY_CLASS_NAME[name].stock_class.__name__ if name in BY_CLASS_NAME else name


def pipeline_class(model: str) -> str:
    """The pipeline class the checkpoint's model_index.json names; ValueError when it cannot be read."""
    try:
        return pipeline_class_name(model)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"--model {model}: cannot read its model_index.json ({e})") from e


def transformer_heads(model: str) -> int | None:
    """The attention heads of a checkpoint's transformer, from its config alone (None when it cannot be read
    without loading: the pipeline checks again once loaded)."""
    if model == TINY_MODEL_ID:
        from ..pipelines.tiny import TINY_HEADS

        return TINY_HEADS
    from ..pipelines.qwen_image.text_to_image import checkpoint_heads

    return checkpoint_heads(model)


def labels_for(model: str, preset: str, config: FastConfig, enhancer: str | None = None,
               loras: tuple[Lora, ...] = (), lightning: bool = False, test_width: int | None = None,
               shrunk_inputs: int | None = None) -> Labels:
    """test_width: the transformer width of a test-size checkpoint (cli/sizes.py), None for a full-size one;
    shrunk_inputs: the divisor of the input images' area when they are shrunk (a test-size edit model)."""
    note = TINY_NOTE if model == TINY_MODEL_ID else None if test_width is None else TEST_SIZE_NOTE.format(
        width=test_width)
    if note is not None and shrunk_inputs:
        note += SHRUNK_INPUTS_NOTE.format(divisor=shrunk_inputs)
    if lightning and config.scheduler != "euler":
        raise ValueError(f"--lightning samples with the Euler schedule the Lightning LoRAs were distilled for; "
                         f"--scheduler {config.scheduler} cannot go with it")
    return Labels(model=model, preset=preset, config=config, note=note,
                  enhancer=enhancer, enhancer_note=TINY_ENHANCER_NOTE if enhancer == TINY_ENHANCER_ID else None,
                  loras=tuple(loras), lightning=lightning)


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
                  lightning: bool = False, stock=None, files: SingleFiles | None = None):
    """STOCK_PRESET: diffusers' own QwenImagePipeline, untouched, so that comparisons are against code this project
    did not write (it samples with the checkpoint's Euler scheduler only; LoRAs load as diffusers loads them, not
    fused). Any other preset: QwenImageFastPipeline with `config`; LoRAs are fused, on the BF16 stock pipeline
    before it is converted (one FP8 rounding of the merged weights) unless the checkpoint is a fast one (FP8
    already: folded into those weights). Real weights load in BF16; tiny-random is built in FP32.
    lightning: the Lightning LoRAs' scheduler replaces the checkpoint's. stock: a stock pipeline already built (a
    benchmark's random full-size one) in place of loading `model`. files: --model FILE's (the fast pipeline from
    them; LoRAs folded into its FP8 weights, as for a fast checkpoint)."""
    import diffusers
    import torch

    from ..pipelines.core.pipeline.base import is_fast_checkpoint, load_stock
    from ..pipelines.loading import from_pretrained, from_single_files, is_fast_pipeline, optimize
    from ..pipelines.qwen_image.samplers import lightning_scheduler

    name = type(stock).__name__ if stock is not None else pipeline_class_name(files.base if files else model)
    if stock is not None:
        pipe = stock
    elif files is not None:
        pipe = from_single_files(files.base, transformer=files.transformer, text_encoder=files.text_encoder,
                                 vae=files.vae, fast_config=config, device=device, dtype=torch.bfloat16)
    elif model == TINY_MODEL_ID:
        from ..pipelines.tiny import tiny_pipeline

        pipe = tiny_pipeline(getattr(diffusers, name))
    elif preset == STOCK_PRESET or (loras and not is_fast_checkpoint(model)):
        pipe = load_stock(getattr(diffusers, name), model, dtype=torch.bfloat16)  # the class model_index.json names
    else:
        pipe = from_pretrained(model, fast_config=config, device=device, dtype=torch.bfloat16)
    if loras:
        add_loras(pipe, loras)
        if preset != STOCK_PRESET:
            pipe.fuse_lora()
            if not is_fast_pipeline(pipe):
                pipe.unload_lora_weights()  # the merged weights stay; optimize() quantizes them once
    if preset != STOCK_PRESET and not is_fast_pipeline(pipe):
        pipe = optimize(pipe, config, device=device)
    if lightning:
        pipe.scheduler = lightning_scheduler()
    if config.memory == "fast":  # memory="low" placed the components itself
        pipe = pipe.to(device)
    pipe.set_progress_bar_config(disable=True)  # our own bars count images and steps
    return pipe
