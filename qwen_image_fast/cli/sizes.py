"""What a checkpoint can render, read from its config files before anything loads (ModelShape): whether it is a
test-size model (tiny sizes and steps by default), the largest image its rotary table reaches, a lower bound of the
memory an image size needs, and on a CPU about how long a step takes.
"""

import os
from dataclasses import dataclass

from .models import TINY_MODEL_ID

# A transformer narrower than this is a test model (the tiny one: 48; Qwen-Image: 3072): it renders at TINY_SIZE
# and TINY_STEPS unless told otherwise, its edit pipelines shrink their condition images (pipelines/tiny.py).
TEST_SIZE_WIDTH = 512
# diffusers' QwenEmbedRope tables 4096 positions each way; with scale_rope an image of h x w patches uses
# h/2 and w/2 of them, and the text's positions follow the image's (up to 1024 text tokens): 6144 tokens a side.
ROPE_POSITIONS, TEXT_POSITIONS = 4096, 1024
# Qwen-Image-2.1's QwenImage21Rope centres an image on zero with 1024 negative positions: 2048 tokens a side.
QWEN21_NEGATIVE_POSITIONS = 1024
# Seconds per step on a CPU, measured with the tiny model, 2 cores, CFG on: fast presets (Triton's interpreter) at
# 256², 512² and 1664x928 ~0.3 s + 0.85 ms a token; the stock pipeline at 128² and 256² ~0.25 s + 1.3 ms a token.
CPU_STEP_SECONDS = {"fast": (0.3, 0.85e-3), "baseline": (0.25, 1.3e-3)}
SLOW_STEP_SECONDS = 10  # a CPU step estimated above this: warn before rendering
# The pipeline classes that resize their input images to a fixed area (shrunk for a test-size model).
SHRINKS_INPUTS = ("QwenImageEditPipeline", "QwenImageEditPlusPipeline", "QwenImageEditInpaintPipeline",
                  "QwenImage21Pipeline")


@dataclass(frozen=True)
class ModelShape:
    width: int  # the transformer's heads x head_dim
    layers: int
    patch: int  # latent pixels a token covers, a side
    vae_scale: int  # image pixels a latent pixel covers, a side: 2 ** len(temperal_downsample)
    vae_channels: int  # the VAE decoder's channels at full resolution (base_dim)
    dtype_bytes: int  # 4 for the tiny model (fp32), 2 for real weights (bf16)
    side_tokens: int = 2 * (ROPE_POSITIONS - TEXT_POSITIONS)  # the most tokens a side the rotary table reaches
    size_multiple: int = 16  # what the pipeline rounds a size down to (with a warning): render refuses the rest

    @classmethod
    def of(cls, model: str, pipeline: str = "QwenImagePipeline") -> "ModelShape | None":
        """From the checkpoint's transformer and VAE config.json; None when they cannot be read without loading."""
        qwen21 = pipeline == "QwenImage21Pipeline"
        if model == TINY_MODEL_ID:
            from ..pipelines.tiny import TINY_TRANSFORMER, TINY_VAE

            transformer, vae = TINY_TRANSFORMER, TINY_VAE
        else:
            import diffusers

            transformer_class, vae_class = (("QwenImage21Transformer2DModel", "AutoencoderKLQwenImage21") if qwen21
                                            else ("QwenImageTransformer2DModel", "AutoencoderKLQwenImage"))
            try:
                transformer = getattr(diffusers, transformer_class).load_config(model, subfolder="transformer")
                vae = getattr(diffusers, vae_class).load_config(model, subfolder="vae")
            except (OSError, ValueError):
                return None
        try:
            common = dict(width=transformer["num_attention_heads"] * transformer["attention_head_dim"],
                          layers=transformer["num_layers"], dtype_bytes=4 if model == TINY_MODEL_ID else 2)
            if qwen21:  # unpatched tokens of 16x16 pixels (the VAE's fixed 16x), sizes in multiples of 32
                return cls(**common, patch=transformer.get("patch_size", 1), vae_scale=16,
                           vae_channels=vae.get("decoder_base_dim") or vae.get("base_dim", 96),
                           side_tokens=2 * QWEN21_NEGATIVE_POSITIONS, size_multiple=32)
            return cls(**common, patch=transformer.get("patch_size", 2),
                       vae_scale=2 ** len(vae.get("temperal_downsample", [False, True, True])),
                       vae_channels=vae.get("base_dim", 96))
        except (KeyError, TypeError):
            return None

    @property
    def test_size(self) -> bool:
        return self.width < TEST_SIZE_WIDTH

    @property
    def pixels_per_token(self) -> int:
        return self.vae_scale * self.patch

    def tokens(self, width: int, height: int) -> int:
        return (width // self.pixels_per_token) * (height // self.pixels_per_token)

    def largest_side(self) -> int:
        """The longest side, in pixels, whose rotary positions (and the text's after them) the table holds."""
        return self.side_tokens * self.pixels_per_token

    def memory_lower_bound(self, width: int, height: int) -> int:
        """Bytes an image of this size needs at least: the VAE decoder's last stage holds its input and output at
        full resolution, and the transformer the image stream's hidden states and their Q, K, V."""
        vae = 2 * width * height * self.vae_channels * self.dtype_bytes
        transformer = 4 * self.tokens(width, height) * self.width * self.dtype_bytes
        return max(vae, transformer)

    def cpu_step_seconds(self, width: int, height: int, preset: str) -> float:
        """About how long a step takes on a CPU (CPU_STEP_SECONDS; a full-size model: scaled by its FLOPs a token)."""
        fixed, per_token = CPU_STEP_SECONDS["baseline" if preset == "baseline" else "fast"]
        from ..pipelines.tiny import TINY_TRANSFORMER

        tiny_width = TINY_TRANSFORMER["num_attention_heads"] * TINY_TRANSFORMER["attention_head_dim"]
        scale = max(1.0, (self.width / tiny_width) ** 2 * self.layers / TINY_TRANSFORMER["num_layers"])
        return fixed + per_token * scale * self.tokens(width, height)


def memory_available(device, max_memory_gib: float | None) -> int:
    """Bytes the process may use: --max-memory, else the GPU's memory or the machine's RAM."""
    if max_memory_gib is not None:
        return int(max_memory_gib * 2**30)
    if device.type == "cuda":
        import torch

        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_sizes(jobs, shape: ModelShape | None, model: str, device, max_memory_gib: float | None):
    """ValueError for a job whose size the model's rotary table does not reach, that the pipeline would round down,
    or that needs more memory than there is (a lower bound): before any folder or file is written."""
    if shape is None:
        return
    available, side = memory_available(device, max_memory_gib), shape.largest_side()
    for job in jobs:
        if job.width is None:  # sized by the pipeline from its input image
            continue
        where = f"prompt {job.index + 1}: {job.width}x{job.height}"
        if job.width % shape.size_multiple or job.height % shape.size_multiple:
            m = shape.size_multiple
            raise ValueError(f"{where}: {model} renders sizes in multiples of {m} pixels (its pipeline would render "
                             f"{job.width // m * m}x{job.height // m * m}); give multiples of {m}")
        if max(job.width, job.height) > side:
            raise ValueError(f"{where}: {model}'s rotary position table reaches {side} pixels a side "
                             f"({shape.side_tokens} tokens of {shape.pixels_per_token} pixels); give a smaller "
                             "--width/--height")
        needed = shape.memory_lower_bound(job.width, job.height)
        if needed > available:
            raise ValueError(f"{where}: needs at least {needed / 2**30:.1f} GiB ({model}'s VAE decode and "
                             f"transformer at this size), {device} has {available / 2**30:.1f} GiB; give a smaller "
                             "--width/--height")


def cpu_time_warning(jobs, shape: ModelShape | None, preset: str) -> str | None:
    """A warning line when a step on the CPU would take more than SLOW_STEP_SECONDS, with the estimate."""
    if shape is None:
        return None
    sized = [job for job in jobs if job.width is not None]
    if not sized:
        return None
    job = max(sized, key=lambda j: j.width * j.height)
    seconds = shape.cpu_step_seconds(job.width, job.height, preset)
    if seconds <= SLOW_STEP_SECONDS:
        return None
    hint = "; a test-size model renders 64x64 unless told otherwise" if shape.test_size else ""
    return (f"warning: {job.width}x{job.height} on the CPU: about {format_duration(seconds)} a step, "
            f"{format_duration(seconds * job.steps)} for {job.steps} steps before the VAE decode (measured on 2 "
            f"cores with the tiny model, scaled by size){hint}")


def format_duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    hours = seconds / 3600
    return f"{hours:.0f} h" if hours < 48 else f"{hours / 24:.0f} days" if hours < 24 * 365 else "years"
