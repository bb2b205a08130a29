"""The inputs of image-conditioned checkpoints (edit, img2img, inpainting): --image and --mask files read, decoded
and hashed before any model loads (InputImage), and what each pipeline class takes (check_pipeline_inputs).
"""

import hashlib
import io
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from PIL import Image

from ..pipelines.core.optimizations import QWEN21_ALSO_RUNS, refused_by_image_conditioned
from .option_names import option_of


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
        # PIL names the in-memory buffer it was given ("cannot identify image file <_io.BytesIO object at 0x...>")
        why = "not a format PIL reads" if isinstance(e, Image.UnidentifiedImageError) else str(e)
        raise ValueError(f"{what} {path}: not a readable image ({why})") from e
    return InputImage(path=str(path), sha256=hashlib.sha256(data).hexdigest(), size=size)


def valid_strength(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 1


class PipelineInputs(NamedTuple):
    """What `render` gives one pipeline class it drives."""

    fewest: int  # input images
    most: int | None  # None: any number
    mask: str  # "required" / "forbidden"
    strength: bool  # --strength allowed
    size_from_image: str | None  # the output sized from the input image, --width/--height "optional" / "refused";
    # None: the text-to-image size defaults
    image_mode: str = "RGB"  # what the input images are decoded to (the pipeline converts them to it anyway)


QWEN21_PIPELINE = "QwenImage21Pipeline"
PIPELINE_INPUTS = {
    "QwenImagePipeline": PipelineInputs(0, 0, "forbidden", False, None),
    "QwenImageImg2ImgPipeline": PipelineInputs(1, 1, "forbidden", True, None),
    "QwenImageInpaintPipeline": PipelineInputs(1, 1, "required", True, None),
    "QwenImageEditPipeline": PipelineInputs(1, 1, "forbidden", False, "optional"),
    "QwenImageEditPlusPipeline": PipelineInputs(1, None, "forbidden", False, "optional"),
    "QwenImageEditInpaintPipeline": PipelineInputs(1, 1, "required", True, "refused"),
    # text-to-image, or conditioned on any number of RGBA images (sized from the last one unless told)
    QWEN21_PIPELINE: PipelineInputs(0, None, "forbidden", False, "optional", "RGBA"),
}


def sizes_from_image(pipeline: str) -> bool:
    """Whether the pipeline class sizes its output from the input image when no size is given."""
    return pipeline in PIPELINE_INPUTS and PIPELINE_INPUTS[pipeline].size_from_image is not None


def image_mode(pipe) -> str:
    """The mode the input images of a loaded pipeline (stock or fast) are decoded to."""
    stock = getattr(type(pipe), "stock_class", type(pipe))
    return PIPELINE_INPUTS[stock.__name__].image_mode if stock.__name__ in PIPELINE_INPUTS else "RGB"


def check_pipeline_options(pipeline: str, model: str, config, lightning: bool, fmt: str):
    """ValueError for a command option the pipeline class of `model` cannot honour (before anything loads)."""
    refused = ([] if pipeline == "QwenImagePipeline" else
               refused_by_image_conditioned(config, QWEN21_ALSO_RUNS if pipeline == QWEN21_PIPELINE else ()))
    if refused:  # what the pipeline's own refusal would say after loading, said before
        flags = ", ".join(f"{option_of(opt)} {getattr(config, opt.field)}" for opt in refused)
        raise ValueError(f"{flags}: for text-to-image checkpoints only; {model} is a {pipeline} checkpoint, which "
                         "runs diffusers' own sampling loop: leave them out")
    if pipeline != QWEN21_PIPELINE:
        return
    if lightning:
        raise ValueError(f"--lightning samples for Qwen-Image-2512's Lightning LoRAs; {model} is a Qwen-Image-2.1 "
                         "checkpoint (40 steps, guidance distilled in): leave --lightning out")
    if fmt == "jpg":
        raise ValueError(f"--format jpg: {model} renders RGBA images, and JPEG has no alpha channel: use --format "
                         "png or webp")
    if config.fp8_attention == "cudnn":
        raise ValueError(f"--fp8-attention cudnn: {model} is a Qwen-Image-2.1 checkpoint, whose FP8 attention merges "
                         "two calls by their log-sum-exps, which cuDNN's FP8 SDPA does not return: use "
                         "--fp8-attention fa3 or auto")


def check_pipeline_inputs(jobs: list, pipeline: str, model: str, size_given: bool):
    """ValueError for inputs (jobs.Job) the pipeline class of `model` would not take, or take and ignore."""
    if pipeline not in PIPELINE_INPUTS:
        raise ValueError(f"--model {model} is a {pipeline} checkpoint; render drives "
                         f"{', '.join(PIPELINE_INPUTS)} (the others through the Python API: optimize(pipe))")
    fewest, most, mask, strength, size_from_image, _ = PIPELINE_INPUTS[pipeline]
    if size_given and size_from_image == "refused":
        raise ValueError(f"--width/--height/--aspect: {pipeline} ({model}) sizes its output from the input image")
    for job in jobs:
        where = f"prompt {job.index + 1}"
        if most == 0 and job.images:
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
