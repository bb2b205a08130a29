"""FastConfig: one field per optimization of the fast pipeline, presets, and a tag for file names."""

from dataclasses import dataclass, replace

from .pipelines.qwen_image.attention import BACKENDS
from .pipelines.qwen_image.transformer import FP8_LINEARS

SCHEDULERS = ("euler", "dpm++2m", "unipc")
PRESETS = ("fast", "baseline")


@dataclass(frozen=True)
class FastConfig:
    """What QwenImageFastPipeline / optimize() apply. `pipe.applied` lists what actually was.

    fused_transformer: the fused-kernel transformer (FastQwenImageTransformer) instead of diffusers' blocks.
    fp8: rowwise-FP8 block linears (needs fused_transformer); bf16_linears keeps some of them in BF16.
    fp8_fast_accum: cuBLAS's faster FP8 accumulation (torchao's inference default): ~6% faster forward on an H200
        with the same error vs BF16 as exact accumulation (7.40e-2 vs 7.41e-2, benchmarks/RESULTS.md).
    attention: "auto" (FlashAttention-4, else cuDNN, else SDPA) | "fa4" | "cudnn" | "sdpa" (needs fused_transformer).
    batched_cfg: prompt and negative prompt in one forward of batch 2N, padded text masked.
    cuda_graphs: replay the transformer forward from a CUDA graph per (resolution, batch, text length bucket);
        text lengths round up to a multiple of text_bucket (padding masked). Needs fused_transformer and CUDA.
    scheduler: "euler" (the checkpoint's FlowMatchEuler) | "dpm++2m" | "unipc"; the latter two change the sampler.
    cfg_fraction: selective CFG, LOSSY: guidance only for the first fraction of the steps (1.0 = every step).
    """

    fused_transformer: bool = True
    fp8: bool = True
    bf16_linears: tuple[str, ...] = ()
    fp8_fast_accum: bool = True
    attention: str = "auto"
    batched_cfg: bool = True
    cuda_graphs: bool = True
    text_bucket: int = 64
    scheduler: str = "euler"
    cfg_fraction: float = 1.0

    def __post_init__(self):
        object.__setattr__(self, "bf16_linears", tuple(self.bf16_linears))
        unknown = [name for name in self.bf16_linears if name not in FP8_LINEARS]
        if unknown:
            raise ValueError(f"bf16_linears={unknown}; allowed: {', '.join(FP8_LINEARS)}")
        if self.attention not in BACKENDS:
            raise ValueError(f"attention={self.attention!r}; allowed: {', '.join(BACKENDS)}")
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler={self.scheduler!r}; allowed: {', '.join(SCHEDULERS)}")
        if not 0.0 < self.cfg_fraction <= 1.0:
            raise ValueError(f"cfg_fraction={self.cfg_fraction}; allowed: 0 < cfg_fraction <= 1 (1 = CFG every step)")
        if not isinstance(self.text_bucket, int) or self.text_bucket < 1:
            raise ValueError(f"text_bucket={self.text_bucket!r}; allowed: an integer >= 1")

    @classmethod
    def preset(cls, name: str) -> "FastConfig":
        """"fast": everything on (the default). "baseline": the stock diffusers pipeline's computation."""
        if name == "fast":
            return cls()
        if name == "baseline":
            return cls(fused_transformer=False, fp8=False, batched_cfg=False, cuda_graphs=False)
        raise ValueError(f"preset={name!r}; allowed: {', '.join(PRESETS)}")

    def replace(self, **changes) -> "FastConfig":
        return replace(self, **changes)

    def tag(self) -> str:
        """Short, file-name-safe summary, e.g. 'fused-fp8-fastacc-auto-bcfg-graphs-euler'."""
        if not self.fused_transformer:
            parts = ["stock"]
        else:
            parts = ["fused", "fp8" if self.fp8 else "bf16"]
            parts += [f"keep-{'-'.join(self.bf16_linears)}"] if self.fp8 and self.bf16_linears else []
            parts += ["fastacc"] if self.fp8 and self.fp8_fast_accum else []
            parts += [self.attention]
        parts += ["bcfg"] if self.batched_cfg else []
        parts += ["graphs"] if self.cuda_graphs and self.fused_transformer else []
        parts += [self.scheduler.replace("+", "p")]
        parts += [f"cfg{self.cfg_fraction:g}"] if self.cfg_fraction < 1 else []
        return "-".join(parts)

