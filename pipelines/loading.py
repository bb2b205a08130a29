"""Entry points: optimize(pipe), a fast pipeline from a diffusers one you have, and from_pretrained(path), the fast
pipeline of whatever a checkpoint holds (picked from its model_index.json, as diffusers' DiffusionPipeline does),
over every model family (the leaves qwen_image/ and qwen_image21/, the qwen35/ prompt enhancer)."""

from .core.config import FastConfig
from .core.pipeline.base import init_arguments, load_dtype, model_index
from .core.prompt_enhancer import resolve_enhancer
from .qwen_image.family import IMAGE_CONDITIONED
from .qwen_image.single_files import text_encoder_from_file, vae_from_file
from .qwen_image.text_to_image import QwenImageFastPipeline
from .qwen_image21.pipeline import FastQwenImage21Pipeline

FAST_CLASSES = {cls.stock_class: cls for cls in (QwenImageFastPipeline, *IMAGE_CONDITIONED, FastQwenImage21Pipeline)}
# model_index.json's _class_name -> the fast class: the stock name, or the fast one (a folder a fast pipeline saved)
BY_CLASS_NAME = {name: cls for cls in FAST_CLASSES.values() for name in (cls.stock_class.__name__, cls.__name__)}


def memory_plan(pipeline: str):
    """What a memory budget (FastConfig(max_memory_gib=...)) is planned for (core/runtime/memory.MemoryPlan), by
    pipeline class name: Qwen-Image-2.1's, else the 2512 text-to-image pipeline's."""
    from .core.runtime.memory import PLAN
    from .qwen_image21.memory import PLAN as QWEN21_PLAN

    return QWEN21_PLAN if pipeline == FastQwenImage21Pipeline.stock_class.__name__ else PLAN


def supported() -> str:
    return ", ".join(stock.__name__ for stock in FAST_CLASSES)


def is_fast_pipeline(pipe) -> bool:
    """Whether `pipe` is one of this project's fast pipelines (the 2512 family's or Qwen-Image-2.1's)."""
    return isinstance(pipe, tuple(FAST_CLASSES.values()))


def optimize(pipe, config: FastConfig | str | None = None, device=None, enhance_prompt=None):
    """The fast pipeline of a diffusers Qwen-Image pipeline (one of FAST_CLASSES' keys: QwenImagePipeline, or an
    image-conditioned one, which keeps its own __call__), built around the same components: the transformer
    converted (config: a FastConfig, a preset name or None = "fast"), on `device` (default: where the transformer
    is; build from a CPU pipeline straight onto the GPU to never hold two BF16 copies there), the VAE made the one
    that decodes in 2D. `pipe` itself keeps its class and takes the converted components too, so its stock weights
    are not kept twice. enhance_prompt (text-to-image only): rewrite each prompt with a local Qwen3.5 before
    encoding it (core/prompt_enhancer.py resolve_enhancer). Any other pipeline: TypeError naming the
    supported ones."""
    config = FastConfig.coerce(config)
    if is_fast_pipeline(pipe):
        raise ValueError("this pipeline is already optimized; call optimize() on a fresh diffusers pipeline")
    fast_class = FAST_CLASSES.get(type(pipe))
    if fast_class is None:
        raise TypeError(f"optimize() takes one of diffusers' {supported()}; got {type(pipe).__name__} (its stock "
                        "pipeline runs as is)")
    if fast_class is QwenImageFastPipeline:
        fast = fast_class._build(init_arguments(pipe), config, device,
                                 enhancer=resolve_enhancer(enhance_prompt, device))
    elif enhance_prompt is not None and enhance_prompt is not False:
        raise ValueError(f"enhance_prompt is supported by the text-to-image QwenImageFastPipeline only, not by "
                         f"{type(pipe).__name__}")
    else:
        fast = fast_class._build(init_arguments(pipe), config, device)
    pipe.register_modules(transformer=fast.transformer, vae=fast.vae)
    return fast


def pipeline_class_name(path_or_id) -> str:
    """The `_class_name` of a checkpoint's model_index.json (a local folder, or a hub id: read from the hub)."""
    return model_index(path_or_id)["_class_name"]


def from_pretrained(path_or_id, fast_config: FastConfig | str | None = None, device=None, **kwargs):
    """The fast pipeline for whatever a checkpoint holds: QwenImageFastPipeline for a text-to-image one, the fast
    class of an image-conditioned one (e.g. Qwen/Qwen-Image-Edit-2511 -> FastQwenImageEditPlusPipeline), either
    stock or saved by a fast pipeline. Another pipeline class: TypeError naming those supported."""
    name = pipeline_class_name(path_or_id)
    if name not in BY_CLASS_NAME:
        raise TypeError(f"{path_or_id} is a {name} checkpoint; qwen-image-fast accelerates {supported()}")
    return BY_CLASS_NAME[name].from_pretrained(path_or_id, fast_config=fast_config, device=device, **kwargs)


def from_single_files(base, transformer=None, text_encoder=None, vae=None, fast_config: FastConfig | str | None = None,
                      device=None, **kwargs):
    """The fast pipeline of `base` (a diffusers folder or hub id: its configs, tokenizer and scheduler; the weights
    of a component not given here) with components from single files, as diffusers' from_single_file reads a file
    with config=: transformer (FastQwenImageTransformer.from_single_file's formats: ComfyUI or diffusers
    safetensors in BF16 / FP16 / FP8 / scaled FP8, GGUF), text_encoder and vae (qwen_image/single_files.py; the
    2512 family's, not Qwen-Image-2.1's). dtype / torch_dtype as the pipelines' from_pretrained takes them (default
    float32, diffusers' own). A file that is not the component named gets a one-line error, before the others
    load."""
    name = pipeline_class_name(base)
    if name not in BY_CLASS_NAME:
        raise TypeError(f"{base} is a {name} checkpoint; qwen-image-fast accelerates {supported()}")
    cls = BY_CLASS_NAME[name]
    config = FastConfig.coerce(fast_config)
    if (text_encoder or vae) and cls is FastQwenImage21Pipeline:
        raise ValueError("text_encoder= and vae= files are read for the Qwen-Image-2512 family; Qwen-Image-2.1's "
                         "come from base (its diffusers folder or hub id)")
    if transformer is not None:
        if not config.fused_transformer:
            raise ValueError("a transformer file loads into the fast transformer: fast_config must keep "
                             "fused_transformer=True")
        kwargs["transformer"] = cls.fast_transformer_class.from_single_file(
            transformer, config=base, subfolder="transformer", torch_dtype=load_dtype(kwargs, "transformer"),
            device="cpu" if config.memory == "low" else device, fast_config=config.transformer_config())
    if text_encoder is not None:
        kwargs["text_encoder"] = text_encoder_from_file(text_encoder, base, load_dtype(kwargs, "text_encoder"))
    if vae is not None:
        kwargs["vae"] = vae_from_file(vae, base, load_dtype(kwargs, "vae"))
    return cls.from_pretrained(base, fast_config=config, device=device, **kwargs)
