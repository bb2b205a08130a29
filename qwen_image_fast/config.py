"""FastConfig: one field per optimization of the fast pipeline, presets, and a tag for file names.

Free of torch/diffusers imports, so the command line can build and validate one before loading anything.
"""

from dataclasses import dataclass, fields, replace

from .pipelines.qwen_image.config import FastTransformerConfig

SCHEDULERS = ("euler", "dpm++2m", "unipc")
PRESETS = ("fast", "baseline")
PARALLEL_MODES = ("none", "cfg", "ulysses", "cfg,ulysses")
MEMORY_MODES = ("fast", "low")
# The fields FastConfig passes to the fast transformer (validated there, once).
TRANSFORMER_FIELDS = tuple(f.name for f in fields(FastTransformerConfig))


@dataclass(frozen=True)
class FastConfig:
    """What QwenImageFastPipeline / optimize() apply. `pipe.applied` lists what actually ran.

    fused_transformer: the fused-kernel transformer (FastQwenImageTransformer) instead of diffusers' blocks.
    fp8, bf16_linears, fp8_fast_accum, attention: the fused transformer's settings (FastTransformerConfig says what
        each means); they need fused_transformer.
    batched_cfg: prompt and negative prompt in one forward of batch 2N, padded text masked.
    cuda_graphs: replay the transformer forward from a CUDA graph per (resolution, batch, text length bucket);
        text lengths round up to a multiple of text_bucket (padding masked). Needs fused_transformer and CUDA. In
        the image-conditioned pipelines (family.py), per forward signature, from its second forward in a call.
    scheduler: "euler" (the pipeline's own scheduler, whatever it is) | "dpm++2m" | "unipc" (derived at call time
        from the pipeline's scheduler config).
    cfg_fraction: selective CFG, LOSSY: guidance only for the first fraction of the steps (1.0 = every step).
    vae_2d_decode: decode an image with the VAE decoder's causal 3D convolutions as the 2D ones they amount to for
        one frame (pipelines/qwen_image/vae.py); not while the VAE tiles or has offload hooks.
    parallel: one image on several processes of an initialised torch.distributed group
        (pipelines/qwen_image/parallel.py): "none" | "cfg" (2 ranks: prompt and negative prompt; needs CFG; then
        batched_cfg does not apply) | "ulysses" (sequence parallel; needs fused_transformer) | "cfg,ulysses".
    ulysses_degree: ranks per Ulysses group; 0 = every rank CFG leaves. With world = dp x cfg x ulysses, dp > 1
        groups each denoise their own images (the CLI splits the prompts among them).
    modulation_table: every block's modulation vectors for every step computed once per schedule and looked up in
        the loop, bit-identical to computing them in each forward (pipelines/qwen_image/modulation.py); not while
        offload hooks move the weights (they are on the GPU only inside the forward). Needs
        fused_transformer (without it, nothing to do).
    memory: "fast" (every weight on the GPU) | "low" (pipelines/qwen_image/offload.py: the modulation weights stay
        on the host, where tables are built from; the text encoder and the transformer's block linears take turns
        on the GPU in one shared buffer). Needs modulation_table; not with parallel.
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
    vae_2d_decode: bool = True
    parallel: str = "none"
    ulysses_degree: int = 0
    modulation_table: bool = True
    memory: str = "fast"

    def __post_init__(self):
        parallel = ",".join(sorted(self.parallel.split(","))) if isinstance(self.parallel, str) else self.parallel
        if parallel not in PARALLEL_MODES:
            raise ValueError(f"parallel={self.parallel!r}; allowed: {', '.join(PARALLEL_MODES)}")
        object.__setattr__(self, "parallel", parallel)
        if not isinstance(self.ulysses_degree, int) or self.ulysses_degree < 0:
            raise ValueError(f"ulysses_degree={self.ulysses_degree!r}; allowed: an integer >= 0 (0 = all the ranks)")
        if self.ulysses_degree > 1 and "ulysses" not in parallel:
            raise ValueError(f"ulysses_degree={self.ulysses_degree} needs parallel='ulysses' or 'cfg,ulysses' "
                             f"(parallel={parallel!r})")
        if "ulysses" in parallel and not self.fused_transformer:
            raise ValueError(f"parallel={parallel!r}: Ulysses runs inside the fused transformer; keep "
                             "fused_transformer=True")
        if self.memory not in MEMORY_MODES:
            raise ValueError(f"memory={self.memory!r}; allowed: {', '.join(MEMORY_MODES)}")
        if self.memory == "low" and not (self.modulation_table and self.fused_transformer):
            raise ValueError("memory='low' keeps the modulation weights on the host and needs modulation_table=True "
                             "and fused_transformer=True")
        if self.memory == "low" and parallel != "none":
            raise ValueError(f"memory='low' with parallel={parallel!r} is not supported: one or the other")
        object.__setattr__(self, "bf16_linears", self.transformer_config().bf16_linears)
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler={self.scheduler!r}; allowed: {', '.join(SCHEDULERS)}")
        if not 0.0 < self.cfg_fraction <= 1.0:
            raise ValueError(f"cfg_fraction={self.cfg_fraction}; allowed: 0 < cfg_fraction <= 1 (1 = CFG every step)")
        if not isinstance(self.text_bucket, int) or self.text_bucket < 1:
            raise ValueError(f"text_bucket={self.text_bucket!r}; allowed: an integer >= 1")

    def transformer_config(self) -> FastTransformerConfig:
        return FastTransformerConfig(**{name: getattr(self, name) for name in TRANSFORMER_FIELDS})

    @classmethod
    def preset(cls, name: str) -> "FastConfig":
        """"fast": everything on (the default). "baseline": the stock diffusers pipeline's computation."""
        if name == "fast":
            return cls()
        if name == "baseline":
            return cls(fused_transformer=False, fp8=False, batched_cfg=False, cuda_graphs=False, vae_2d_decode=False,
                       modulation_table=False)
        raise ValueError(f"preset={name!r}; allowed: {', '.join(PRESETS)}")

    @classmethod
    def coerce(cls, config: "FastConfig | str | None") -> "FastConfig":
        """A FastConfig as is, a preset name, or None (= "fast")."""
        if isinstance(config, FastConfig):
            return config
        if config is None or isinstance(config, str):
            return cls.preset(config or "fast")
        raise TypeError(f"fast_config={config!r}; allowed: a FastConfig, a preset name ({', '.join(PRESETS)}) "
                        "or None")

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
        parts += ["table"] if self.modulation_table and self.fused_transformer else []
        parts += ["lowmem"] if self.memory == "low" else []
        parts += [self.scheduler.replace("+", "p")]
        parts += [f"cfg{self.cfg_fraction:g}"] if self.cfg_fraction < 1 else []
        parts += ["vae2d"] if self.vae_2d_decode else []
        parts += ["cfgpar"] if "cfg" in self.parallel.split(",") else []
        parts += [f"ulysses{self.ulysses_degree or 'all'}"] if "ulysses" in self.parallel else []
        return "-".join(parts)
