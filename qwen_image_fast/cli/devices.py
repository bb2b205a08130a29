"""Where the command runs: its processes (RANK, WORLD_SIZE, LOCAL_RANK as torchrun / accelerate launch set them),
--device, Triton on the CPU, --max-memory, and --parallel (one image over several processes: its mesh is checked
before any model loads and started after).
"""

import os

from ..pipelines.core.config import PRESETS, QWEN_IMAGE_2512_SHAPE, STREAMING_MIN_GIB
from .models import STOCK_PRESET, Labels, transformer_heads


def distributed_env() -> tuple[int, int, int | None]:
    """(RANK, WORLD_SIZE, LOCAL_RANK) as set by torchrun / accelerate launch; (0, 1, None) otherwise."""
    try:
        rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        local_rank = int(os.environ["LOCAL_RANK"]) if "LOCAL_RANK" in os.environ else None
    except ValueError as e:
        raise ValueError(f"RANK / WORLD_SIZE / LOCAL_RANK must be integers ({e})") from e
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} with WORLD_SIZE={world_size}: need 0 <= RANK < WORLD_SIZE")
    return rank, world_size, local_rank


def resolve_device(name: str | None, rank: int, local_rank: int | None):
    """--device (None: cuda if available, else cpu) -> a torch.device; plain "cuda" -> GPU LOCAL_RANK (else RANK
    modulo the GPU count). ValueError for a device that is not here."""
    import torch

    try:
        device = torch.device(name if name is not None else "cuda" if torch.cuda.is_available() else "cpu")
    except RuntimeError:
        raise ValueError(f"--device {name}: not a device; use cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"--device {name}: only cpu and cuda are supported")
    if not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available here (torch {torch.__version__}, "
                         f"{'a CPU-only build' if torch.version.cuda is None else 'no GPU found'}); use --device cpu")
    count = torch.cuda.device_count()
    index = device.index if device.index is not None else (local_rank if local_rank is not None else rank % count)
    if index >= count:
        raise ValueError(f"--device {name}: GPU {index} asked for, {count} here")
    return torch.device("cuda", index)


def check_kernels_on(device, config):
    """--attention / --fp8-attention naming a kernel that runs on a CUDA GPU alone, refused on another device before
    any model loads (the model's own check comes after loading has begun, and names the model, not the option)."""
    if device.type == "cuda":
        return
    for option, value, allowed in (("--attention", config.attention, "auto or sdpa"),
                                   ("--fp8-attention", config.fp8_attention, "off or auto")):
        if value in ("fa4", "cudnn", "fa3"):
            raise ValueError(f"{option} {value} runs on a CUDA GPU, and this run's device is {device}: use {option} "
                             f"{allowed} there")


def check_triton_on_cpu(device, labels: Labels, enhance: str | None = None):
    """The fused transformer's and the prompt enhancer's Triton kernels run on the CPU only under Triton's
    interpreter, which must be on before triton is first imported."""
    if device.type != "cpu" or os.environ.get("TRITON_INTERPRET") == "1":
        return
    if labels.preset != STOCK_PRESET and labels.config.fused_transformer:
        raise ValueError(f"--preset {labels.preset} on the CPU runs its Triton kernels in Triton's interpreter: start "
                         "the command with TRITON_INTERPRET=1 (it must be set before Python starts), or use "
                         f"--preset {STOCK_PRESET}")
    if enhance is not None:
        raise ValueError("--enhance on the CPU runs the Qwen3.5 model's Triton kernels in Triton's interpreter: start "
                         "the command with TRITON_INTERPRET=1 (it must be set before Python starts)")


# GiB, measured on an H200 (benchmarks/RESULTS.md, "Running in 24 GiB"). What the fast pipeline of a
# Qwen-Image-2512-size model needs on a GPU: its peak (42.5 GiB reserved at 1328^2) and the CUDA context (~0.5 GiB);
# one number for both questions it answers: which GPUs run it without --max-memory (check_gpu_fits), and which
# --max-memory runs it rather than memory="low" (memory_setting). memory="low" peaks at 21.7 GiB reserved at
# 1024^2 and 23.0 at 1328^2. QWEN_IMAGE_2512_SHAPE: (transformer width, layers) they were measured at.
FAST_PIPELINE_GIB = 43.0
LOW_MEMORY_GIB = 22.0
# Below LOW_MEMORY_GIB, the 2512 text-to-image pipeline runs memory="low" planned in the budget
# (FastConfig.max_memory_gib): the blocks and text encoder layers that do not fit stream from the host
# (benchmarks/RESULTS.md, "Running in 16 GiB"), from STREAMING_MIN_GIB (pipelines/core/config.py).
# Qwen-Image-2.1's, measured the same way at 1024^2 text-to-image only (benchmarks/RESULTS.md, "Qwen-Image-2.1"):
# 35.7 GiB reserved resident, 19.9 with memory="low" (its ~16 GiB text encoder and the blocks taking turns), each
# with the CUDA context and a margin for larger sizes and condition images, which were not measured.
QWEN21_FAST_PIPELINE_GIB = 38.0
QWEN21_LOW_MEMORY_GIB = 21.0
# Below QWEN21_LOW_MEMORY_GIB, 2.1's memory="low" is planned in the budget too (pipelines/qwen_image21/memory.py: one
# 1024^2 text-to-image call): from QWEN21_STREAMING_MIN_GIB, the plan's smallest budget at the real shapes with the 2D
# VAE decode (13.57-13.65 GiB on an H200 at 621ce5c: context 0.83-0.91, VAE and transformer parts 1.13, workspace 7.50,
# the text encoder's fixed part and 2 layer slots 4.11; 13.90 with the 1.16 GiB context seen at 365258c;
# benchmarks/RESULTS.md), rounded up. Without the 2D decode the workspace is diffusers' decode's 8.20 GiB: the
# pipeline refuses such a budget itself, naming its smallest.
QWEN21_STREAMING_MIN_GIB = 14.0
QWEN_IMAGE_21_SHAPE = (4096, 32)
LOW_MEMORY_MEASURED = {"QwenImagePipeline": "21.7 GiB at 1024x1024, 23.0 at 1328x1328, measured; below 22 its blocks "
                                            "and text encoder layers stream from the host",
                       "QwenImage21Pipeline": "19.9 GiB reserved at 1024x1024, measured; below 21 its blocks and "
                                              "text encoder layers stream from the host"}


def memory_needs(pipeline: str) -> tuple[float, float, str]:
    """(the fast pipeline's GiB, memory="low"'s smallest GiB, what was measured) for a pipeline class:
    Qwen-Image-2.1's, else the 2512 family's (streamed below LOW_MEMORY_GIB)."""
    if pipeline == "QwenImage21Pipeline":
        return QWEN21_FAST_PIPELINE_GIB, QWEN21_STREAMING_MIN_GIB, LOW_MEMORY_MEASURED[pipeline]
    return FAST_PIPELINE_GIB, STREAMING_MIN_GIB, LOW_MEMORY_MEASURED["QwenImagePipeline"]


def memory_setting(max_memory: float | None, preset: str, pipeline: str, parallel: str | None) -> str:
    """FastConfig.memory for --max-memory GIB (None: "fast"); ValueError when nothing fits or low cannot run."""
    qwen21 = pipeline == "QwenImage21Pipeline"
    fast_gib, low_gib, measured = memory_needs(pipeline)
    if max_memory is None or max_memory >= fast_gib:
        return "fast"
    if max_memory < low_gib:
        raise ValueError(f"--max-memory {max_memory:g}: the pipeline needs at least {low_gib:g} GiB (with "
                         f"memory='low': {measured})")
    why = (f"--preset {preset} runs the stock pipeline" if preset == STOCK_PRESET else
           f"{pipeline} is not the text-to-image pipeline" if pipeline != "QwenImagePipeline" and not qwen21 else
           f"--parallel {parallel} is set" if parallel else None)
    if why:
        raise ValueError(f"--max-memory {max_memory:g} below {fast_gib:g} needs memory='low', which runs in the fast "
                         f"text-to-image and Qwen-Image-2.1 pipelines alone; {why}: leave --max-memory out")
    return "low"


def memory_budget(max_memory: float | None, memory: str, pipeline: str) -> float | None:
    """FastConfig.max_memory_gib: --max-memory where memory="low" must stream (the 2512 text-to-image pipeline below
    LOW_MEMORY_GIB, Qwen-Image-2.1's below QWEN21_LOW_MEMORY_GIB), else None (the resident low-memory mode as
    measured, or not memory="low")."""
    resident = {"QwenImagePipeline": LOW_MEMORY_GIB, "QwenImage21Pipeline": QWEN21_LOW_MEMORY_GIB}.get(pipeline)
    if memory == "low" and resident is not None and max_memory < resident:
        return max_memory
    return None


def with_memory_options(config, max_memory: float | None, preset: str, pipeline: str, parallel: str | None,
                        batch: int, batch_option: str):
    """`config` with --max-memory's memory mode and budget (render's and serve's rules), refusing a batch above 1
    (`batch_option` N) where the budget is planned for one image a call."""
    config = config.replace(memory=memory_setting(max_memory, preset, pipeline, parallel))
    config = config.replace(max_memory_gib=memory_budget(max_memory, config.memory, pipeline))
    if config.max_memory_gib is not None and batch > 1:
        raise ValueError(f"{batch_option} {batch} with --max-memory {max_memory:g}: below {LOW_MEMORY_GIB:g} GiB "
                         "memory='low' is planned for one image a call (its blocks stream); give "
                         f"{batch_option} 1, or a --max-memory of {LOW_MEMORY_GIB:g} or more")
    return config


def check_gpu_fits(device, max_memory: float | None, preset: str, pipeline: str, model_shape) -> None:
    """Without --max-memory, a GPU too small for the fast pipeline of a Qwen-Image-2512-size model, or of a
    Qwen-Image-2.1-size one (model_shape: sizes.ModelShape), is refused before anything loads, with the
    --max-memory that runs it (memory='low': the same images), or saying that none does."""
    qwen21 = pipeline == "QwenImage21Pipeline"
    if (max_memory is not None or device.type != "cuda" or preset == STOCK_PRESET or model_shape is None
            or (model_shape.width, model_shape.layers) != (QWEN_IMAGE_21_SHAPE if qwen21 else QWEN_IMAGE_2512_SHAPE)):
        return
    import torch

    fast_gib, low_gib, _ = memory_needs(pipeline)
    properties = torch.cuda.get_device_properties(device)
    total = properties.total_memory / 2**30
    if total >= fast_gib:
        return
    where = f"{device} ({properties.name}) has {total:.1f} GiB, and the fast pipeline needs about {fast_gib:g}"
    if total < low_gib:
        raise ValueError(f"{where} ({low_gib:g} with --max-memory, its low-memory mode): GPUs this small are "
                         "not served yet")
    if pipeline != "QwenImagePipeline" and not qwen21:
        raise ValueError(f"{where}; its low-memory mode (--max-memory) runs the text-to-image pipeline only, not "
                         f"{pipeline}")
    resident = QWEN21_LOW_MEMORY_GIB if qwen21 else LOW_MEMORY_GIB
    how = (f"the same images bit for bit in about {resident:g} GiB" if total >= resident else
           f"the same images bit for bit; below {resident:g} GiB the blocks and text encoder layers that do "
           "not fit stream from the host")
    raise ValueError(f"{where}: add --max-memory {int(total)} (memory='low': {how})")


def cap_memory(max_memory: float | None, device) -> None:
    if max_memory is None or device.type != "cuda":
        return
    import torch

    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, max_memory * 2**30 / total), device)


def image_group_shape(args, model: str, pipeline: str, rank: int, world_size: int):
    """--parallel's mesh (MeshShape), checked before any model loads; None without --parallel."""
    if args.parallel is None:
        if args.ulysses:
            raise ValueError(f"--ulysses {args.ulysses} needs --parallel ulysses or cfg,ulysses")
        return None
    from ..pipelines.core.runtime.parallel import MeshShape

    if world_size < 2:
        raise ValueError(f"--parallel {args.parallel} splits one image over several processes: launch with "
                         "torchrun --nproc_per_node N -m qwen_image_fast render ...")
    if args.preset == STOCK_PRESET:
        raise ValueError(f"--parallel runs in the fast pipeline; --preset {STOCK_PRESET} runs the stock diffusers "
                         "pipeline as diffusers runs it (one image per process): leave --parallel out, or use "
                         f"--preset {PRESETS[0]}")
    if pipeline != "QwenImagePipeline":
        raise ValueError(f"--parallel is for text-to-image checkpoints; {pipeline} ({model}) renders one image per "
                         "process (leave --parallel out)")
    return MeshShape.resolve(args.parallel, args.ulysses, world_size, transformer_heads(model))


def check_cfg_parallel(parallel: str, jobs) -> None:
    """CFG-parallel runs the negative prompt on its own rank: every job needs CFG."""
    if "cfg" not in parallel.split(","):
        return
    for job in jobs:
        if job.cfg <= 1 or job.negative_prompt is None:
            raise ValueError(f"--parallel {parallel} runs the prompt and the negative prompt on two ranks, but "
                             f"prompt {job.index + 1} ({job.stem}) has cfg {job.cfg:g}"
                             f"{' and no negative prompt' if job.negative_prompt is None else ''}: give every "
                             "prompt cfg > 1 and a negative prompt, or use --parallel ulysses")


def start_mesh(device, shape):
    """With --parallel: the default process group (NCCL on CUDA, gloo on the CPU) and the mesh of `shape` (a
    parallel.MeshShape) on it. Its image groups render one image together: the leader of each decides what is
    left to render and writes images and manifest lines; the others take part in every call and write nothing."""
    import torch
    import torch.distributed as dist

    from ..pipelines.core.runtime.parallel import ParallelMesh

    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                device_id=device if device.type == "cuda" else None)
    return ParallelMesh(shape)
