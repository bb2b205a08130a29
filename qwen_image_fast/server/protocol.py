"""OpenAI's Images API as this server takes it: the fields of /v1/images/generations (JSON) and /v1/images/edits
(multipart), checked into an ImageRequest, and the error object every refusal carries.

OpenAI's fields: prompt, model, n, size, response_format (b64_json only: the server keeps no files), output_format
(png, jpeg, webp), output_compression (jpeg / webp quality, 0..100), background ("auto" or "opaque": the images
have no alpha), quality ("auto" only), and for edits image (one or several files, `image` or `image[]`) and mask.
The diffusion fields, with SGLang's and vLLM-Omni's names: negative_prompt, num_inference_steps, true_cfg_scale,
guidance_scale (only where the transformer embeds guidance: stock diffusers ignores it elsewhere), seed (random
when not given, and returned), width and height (instead of size), and LoRAs: `loras` [{"name", "weight"}] (several at once), or vLLM-Omni's single `lora`
{"name", "scale"}; step_cache false runs a request without the server's --cache rule. With true_cfg_scale > 1 and no negative_prompt the request runs CFG with render's default
negative prompt (Qwen-Image-2512's recommended one), as the CLI does. A field this server cannot honour (stream, partial_images, style, moderation, a quality level,
transparency, an unknown name) is refused with 400 naming it, never accepted and ignored, and so is a prompt past
the text encoder's max_sequence_length tokens (diffusers would drop the rest without a word).
"""

import io
import json
import math
import re
from dataclasses import dataclass, field

from PIL import Image

from ..cli.jobs import lone_surrogate

OUTPUT_FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}
MAX_N = 10  # OpenAI's range for n
MAX_PROMPT_CHARS = 32000  # OpenAI's limit for its GPT image models
MAX_STEPS = 200
MAX_CFG = 20.0
MAX_SEED = 2**64 - 1
MAX_INPUT_IMAGES = 16  # OpenAI's edits limit
MAX_INPUT_PIXELS = 4096 * 4096
SIZE = re.compile(r"^(\d{1,5})x(\d{1,5})$")
GENERATION_FIELDS = {"prompt", "model", "n", "size", "response_format", "output_format", "output_compression",
                     "background", "quality", "negative_prompt", "num_inference_steps", "true_cfg_scale",
                     "guidance_scale", "seed", "width", "height", "loras", "lora", "step_cache"}
EDIT_FIELDS = GENERATION_FIELDS | {"image", "image[]", "mask"}
# OpenAI fields that name something this server does not do: the reason for each refusal
NOT_SERVED = {
    "stream": "streaming partial images is not served: leave stream out",
    "partial_images": "partial images are not served: leave partial_images out",
    "style": "style is DALL-E 3's; describe the style in the prompt",
    "moderation": "this server runs no moderation: leave moderation out",
    "input_fidelity": "input_fidelity is GPT image's; leave it out",
    "user": "user (an end-user id for abuse monitoring) is not recorded here: leave it out",
}


class ApiError(Exception):
    """An HTTP error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code="invalid_value")


@dataclass(frozen=True)
class Served:
    """What the loaded model takes: its name, its pipeline class and endpoint, sizes, defaults, its LoRAs."""

    model: str
    pipeline: str
    endpoint: str  # "generations" or "edits"
    default_size: tuple[int, int] | None  # None: the edit pipeline sizes from the input image
    max_side: int
    default_steps: int
    default_cfg: float
    default_negative: str
    min_steps: int
    guidance_embeds: bool
    images: tuple[int, int | None] = (0, 0)  # fewest and most input images
    mask: bool = False  # takes a mask (inpainting)
    loras: tuple[str, ...] = ()  # adapter names loaded at start
    lora_dir: str | None = None
    step_cache: bool = False  # the server runs a step cache (--cache), which a request may turn off
    rgba: bool = False  # renders RGBA images (Qwen-Image-2.1): no JPEG, no background but the model's
    size_refused: bool = False  # the pipeline sizes its output from the input image alone
    count_tokens: object = None  # str -> the text encoder's token count (None: not checked)
    max_prompt_tokens: int = 512  # diffusers' max_sequence_length: the encoder's output past it is dropped
    prompt_limit: str = "the text encoder reads at most {limit} (diffusers would drop the rest)"  # why, for the 400
    max_steps: int = MAX_STEPS  # or a memory budget's planned steps
    max_pixels: int | None = None  # a memory budget's planned width x height (None: max_side alone)


@dataclass(frozen=True)
class ImageRequest:
    """One request's n images, checked. loras: ((name, weight), ...) sorted by name; images: the uploaded files."""

    prompt: str
    negative_prompt: str | None  # None: no CFG (true_cfg_scale <= 1)
    n: int
    width: int | None
    height: int | None
    steps: int
    cfg: float
    seed: int
    seed_given: bool
    output_format: str
    output_compression: int
    guidance_scale: float | None = None
    loras: tuple[tuple[str, float], ...] = ()
    step_cache: bool = True  # False: without the server's step cache
    images: tuple[bytes, ...] = field(default=(), repr=False)
    mask: bytes | None = field(default=None, repr=False)

    def batch_key(self) -> tuple:
        """Requests with equal keys share one pipeline call: one call takes one size, step count, CFG scale (and
        whether there is a negative prompt), guidance, LoRA set at its weights, and step cache on or off. A request
        with input images runs alone, one image a call (the edit pipelines take one prompt a call)."""
        return (self.width, self.height, self.steps, self.cfg, self.negative_prompt is None, self.guidance_scale,
                self.loras, self.step_cache, id(self) if self.images else None)


def text(value, param: str, limit: int = MAX_PROMPT_CHARS) -> str:
    if not isinstance(value, str):
        raise bad(param, f"must be a string, got {type(value).__name__}")
    if not value.strip():
        raise bad(param, "must not be empty")
    if len(value) > limit:
        raise bad(param, f"{len(value)} characters; at most {limit}")
    where = lone_surrogate(value)
    if where:
        raise bad(param, f"holds a lone surrogate, {where} (not valid Unicode text)")
    return value


def within_tokens(value: str, param: str, served: Served) -> str:
    """A prompt the text encoder reads whole: diffusers drops what is past max_sequence_length without a word."""
    if served.count_tokens is not None:
        tokens = served.count_tokens(value)
        if tokens > served.max_prompt_tokens:
            raise bad(param, f"{tokens} tokens; {served.prompt_limit.format(limit=served.max_prompt_tokens)}: "
                             "shorten it")
    return value


def integer(value, param: str, low: int, high: int) -> int:
    if isinstance(value, str) and re.fullmatch(r"-?\d+", value.strip()):  # multipart fields arrive as text
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise bad(param, f"must be an integer, got {value!r}")
    if not low <= value <= high:
        raise bad(param, f"must be in {low}..{high}, got {value}")
    return value


def number(value, param: str, low: float, high: float) -> float:
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise bad(param, f"must be a number, got {value!r}") from None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise bad(param, f"must be a finite number, got {value!r}")
    if not low <= value <= high:
        raise bad(param, f"must be in {low:g}..{high:g}, got {value:g}")
    return float(value)


def size_of(body: dict, served: Served) -> tuple[int | None, int | None]:
    """size "WxH" / "auto", or width and height: a multiple of 16 on each side, up to the model's largest."""
    size, width, height = body.get("size"), body.get("width"), body.get("height")
    if size is not None and (width is not None or height is not None):
        raise bad("size", "give size or width and height, not both")
    if size is not None and size != "auto":
        if not isinstance(size, str) or not SIZE.match(size):
            raise bad("size", f"must be 'WIDTHxHEIGHT' (e.g. '1024x1024') or 'auto', got {size!r}")
        width, height = map(int, SIZE.match(size).groups())
    elif width is None and height is None:
        return served.default_size or (None, None)
    elif width is None or height is None:
        raise bad("width" if width is None else "height", "give width and height together")
    for param, value in (("width", width), ("height", height)):
        value = integer(value, "size" if size else param, 16, served.max_side)
        if value % 16:
            raise bad("size" if size else param, f"{value} is not a multiple of 16 (the model's patches)")
    if served.max_pixels is not None and int(width) * int(height) > served.max_pixels:
        side = int(served.max_pixels ** 0.5)
        raise bad("size" if size else "width", f"{width}x{height} is more than the {served.max_pixels} pixels this "
                                              f"server's --max-memory budget is planned for ({side}x{side})")
    return int(width), int(height)


def lora_list(body: dict, served: Served) -> tuple[tuple[str, float], ...]:
    """loras [{"name", "weight"}] or lora {"name", "scale"} -> ((name, weight), ...) by name. Names: those loaded at
    start, or a .safetensors file's path inside --lora-dir without its suffix (never a path outside it)."""
    if body.get("loras") is not None and body.get("lora") is not None:
        raise bad("loras", "give loras (a list) or lora (one), not both")
    param = "loras" if body.get("loras") is not None else "lora"
    items = body.get(param)
    if items is None:
        return ()
    if isinstance(items, str):  # a multipart field: JSON text
        try:
            items = json.loads(items)
        except json.JSONDecodeError:
            raise bad(param, f"must be JSON, got {items[:80]!r}") from None
    items = [items] if param == "lora" else items
    if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
        raise bad(param, 'must be a list of {"name": NAME, "weight": W}' if param == "loras" else
                  'must be {"name": NAME, "scale": W}')
    chosen = {}
    for item in items:
        unknown = set(item) - {"name", "weight", "scale"}
        if unknown:
            raise bad(param, f"unknown key {sorted(unknown)[0]!r}; an adapter takes name and weight (or scale)")
        if "weight" in item and "scale" in item:
            raise bad(param, "give weight or scale, not both")
        name = item.get("name")
        if not isinstance(name, str) or not name:
            raise bad(param, f"each adapter needs a name, got {name!r}")
        weight = number(item.get("weight", item.get("scale", 1.0)), param, -10.0, 10.0)
        if name in chosen:
            raise bad(param, f"{name!r} is named twice")
        if name not in served.loras and not lora_dir_name(name, served):
            known = ", ".join(served.loras) or "none"
            where = f", or a file's name in the LoRA folder" if served.lora_dir else ""
            raise bad(param, f"unknown adapter {name!r}; loaded: {known}{where}")
        chosen[name] = weight
    return tuple(sorted(chosen.items()))


def lora_dir_name(name: str, served: Served) -> bool:
    """Whether `name` is a .safetensors file inside --lora-dir (a relative path without the suffix)."""
    from pathlib import Path

    if served.lora_dir is None or name.startswith(("/", "\\")) or ".." in Path(name).parts:
        return False
    root = Path(served.lora_dir).resolve()
    path = (root / f"{name}.safetensors").resolve()
    return path.is_relative_to(root) and path.is_file()


def uploaded_image(data: bytes, param: str) -> tuple[int, int]:
    """An upload that PIL decodes, within MAX_INPUT_PIXELS: its (width, height)."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            if image.width * image.height > MAX_INPUT_PIXELS:
                raise bad(param, f"{image.width}x{image.height} is more than {MAX_INPUT_PIXELS} pixels")
            image.load()
            return image.size
    except ApiError:
        raise
    except Exception as e:
        raise bad(param, f"not an image PIL reads ({type(e).__name__})") from None


def parse_request(body: dict, served: Served, endpoint: str, files: dict | None = None) -> ImageRequest:
    """A generations JSON body (endpoint "generations") or an edits form (its text fields in body, its files in
    files: image, mask) -> ImageRequest; ApiError 400 naming the first field that is wrong."""
    if endpoint != served.endpoint:
        other = "/v1/images/generations (text to image)" if served.endpoint == "generations" else \
            "/v1/images/edits (an input image and an instruction)"
        raise ApiError(400, f"{served.model} is a {served.pipeline} model: it serves {other}, not "
                            f"/v1/images/{endpoint}", param=None, code="wrong_endpoint")
    allowed = GENERATION_FIELDS if endpoint == "generations" else EDIT_FIELDS
    for name in body:
        if name in NOT_SERVED:
            raise bad(name, NOT_SERVED[name])
        if name not in allowed:
            raise bad(name, f"unknown field; this endpoint takes {', '.join(sorted(allowed))}")
    if "prompt" not in body:
        raise ApiError(400, "prompt: required", param="prompt", code="missing_required_parameter")
    prompt = within_tokens(text(body["prompt"], "prompt"), "prompt", served)
    model = body.get("model")
    if model is not None and model != served.model:
        raise bad("model", f"this server serves {served.model!r}, not {model!r}")
    n = integer(body.get("n", 1), "n", 1, MAX_N)
    if body.get("response_format", "b64_json") != "b64_json":
        raise bad("response_format", f"{body['response_format']!r}: this server answers b64_json only (it keeps "
                                     "no files to link to)")
    fmt = body.get("output_format", "png")
    if fmt not in OUTPUT_FORMATS:
        raise bad("output_format", f"{fmt!r}; allowed: {', '.join(OUTPUT_FORMATS)}")
    compression = integer(body.get("output_compression", 100), "output_compression", 0, 100)
    if fmt == "png" and compression != 100:
        raise bad("output_compression", "PNG is lossless: output_compression is for jpeg and webp")
    if served.rgba and fmt == "jpeg":
        raise bad("output_format", f"{served.pipeline} renders RGBA images, and JPEG has no alpha channel: use png or "
                                   "webp")
    backgrounds = ("auto",) if served.rgba else ("auto", "opaque")
    if body.get("background", "auto") not in backgrounds:
        raise bad("background", f"{body['background']!r}: " + (
            f"{served.pipeline} renders RGBA images as the model makes them; allowed: auto" if served.rgba else
            "the images are opaque; allowed: auto, opaque"))
    if body.get("quality", "auto") != "auto":
        raise bad("quality", f"{body['quality']!r}: this server has no quality levels (allowed: auto); set "
                             "num_inference_steps instead")
    if served.size_refused and any(body.get(name) is not None for name in ("size", "width", "height")):
        name = next(name for name in ("size", "width", "height") if body.get(name) is not None)
        raise bad(name, f"{served.pipeline} sizes its output from the input image: leave {name} out")
    width, height = size_of(body, served)
    steps = integer(body.get("num_inference_steps", served.default_steps), "num_inference_steps",
                    served.min_steps, served.max_steps)
    cfg = number(body.get("true_cfg_scale", served.default_cfg), "true_cfg_scale", 0.0, MAX_CFG)
    negative = body.get("negative_prompt")
    if negative is not None:
        negative = within_tokens(text(negative, "negative_prompt"), "negative_prompt", served)
        if cfg <= 1:
            raise bad("negative_prompt", f"runs only with classifier-free guidance: true_cfg_scale is {cfg:g}, "
                                         "give one > 1 or leave negative_prompt out")
    elif cfg > 1:
        negative = served.default_negative  # as render's default (stock diffusers would skip CFG without one)
    else:
        negative = None
    guidance = body.get("guidance_scale")
    if guidance is not None:
        if not served.guidance_embeds:
            raise bad("guidance_scale", f"{served.model} has no guidance embedding (diffusers would ignore it); "
                                        "use true_cfg_scale")
        guidance = number(guidance, "guidance_scale", 0.0, MAX_CFG)
    seed_given = body.get("seed") is not None
    if seed_given:
        seed = integer(body["seed"], "seed", 0, MAX_SEED - (n - 1))
    else:
        import secrets

        seed = secrets.randbelow(2**63)
    step_cache = body.get("step_cache", True)
    if not isinstance(step_cache, bool):
        raise bad("step_cache", f"must be true or false, got {step_cache!r}")
    if step_cache and "step_cache" in body and not served.step_cache:
        raise bad("step_cache", "this server runs no step cache (start it with --cache RULE)")
    images, mask = (), None
    if endpoint == "edits":
        images = tuple((files or {}).get("image", ()))
        fewest, most = served.images
        if len(images) < fewest:
            raise ApiError(400, f"image: required ({fewest} or more files as image or image[])", param="image",
                           code="missing_required_parameter")
        if most is not None and len(images) > most or len(images) > MAX_INPUT_IMAGES:
            raise bad("image", f"{len(images)} files; {served.pipeline} takes at most "
                               f"{min(most or MAX_INPUT_IMAGES, MAX_INPUT_IMAGES)}")
        sizes = [uploaded_image(data, "image") for data in images]
        masks = (files or {}).get("mask", ())
        if len(masks) > 1:
            raise bad("mask", "one mask file at most")
        if masks:
            if not served.mask:
                raise bad("mask", f"{served.pipeline} takes no mask (an inpainting model does)")
            mask = masks[0]
            mask_size = uploaded_image(mask, "mask")
            if mask_size != sizes[0]:
                raise bad("mask", f"{mask_size[0]}x{mask_size[1]}: it must be the first image's size, "
                                  f"{sizes[0][0]}x{sizes[0][1]}")
        elif served.mask:
            raise ApiError(400, "mask: required by this inpainting model", param="mask",
                           code="missing_required_parameter")
    return ImageRequest(prompt=prompt, negative_prompt=negative, n=n, width=width, height=height, steps=steps,
                        cfg=cfg, seed=seed, seed_given=seed_given, output_format=fmt, output_compression=compression,
                        guidance_scale=guidance, loras=lora_list(body, served), step_cache=step_cache,
                        images=images, mask=mask)
