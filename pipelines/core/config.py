"""The options of the fast pipelines and of the fast transformer, each defined once, with its one default.

FastTransformerConfig: how the fast transformer stores and runs its block linears and attention; the model keeps it
(and saves it in its config.json as "fast_config"). FastConfig: those options plus the pipeline's; what
QwenImageFastPipeline / optimize() apply (`pipe.applied` lists what actually ran; optimizations.py declares each).

Each field says when it is read (`binds`):
- "build": when the pipeline or model is built (conversion, how weights are stored, where components live, process
  groups). Changing it means building again.
- "call": at every pipeline call. `pipe.fast_config = pipe.fast_config.replace(scheduler="unipc")` takes effect at
  the next call; a change to a build option there is refused.

Free of torch/diffusers imports: the command line builds and validates one before loading anything.
"""

from dataclasses import asdict, dataclass, field, fields, replace

# The block linears that may run in FP8; (stream)_(layer). qkv is the per-stream fused Q/K/V projection.
FP8_LINEARS = ("img_qkv", "img_out", "img_fc1", "img_fc2", "txt_qkv", "txt_out", "txt_fc1", "txt_fc2")
ATTENTION_BACKENDS = ("auto", "fa4", "cudnn", "sdpa")
FP8_ATTENTION = ("off", "auto", "cudnn", "fa3")
SCHEDULERS = ("euler", "dpm++2m", "unipc")
PRESETS = ("fast", "baseline")
PARALLEL_MODES = ("none", "cfg", "ulysses", "cfg,ulysses")
MEMORY_MODES = ("fast", "low")
# FastConfig(memory="low", max_memory_gib=...) on a Qwen-Image-2512-size model (transformer width and blocks:
# QWEN_IMAGE_2512_SHAPE): its smallest budget, from the plan's arithmetic at the real shapes (runtime/memory.py): the
# CUDA context with its growth ~1.1 GiB, the VAE and transformer parts 0.3, one 1328^2 image's workspace and table
# 5.5, the text encoder's parts outside its layers 2.0 and two of its layers 0.9. Known before anything loads.
QWEN_IMAGE_2512_SHAPE = (3072, 60)
STREAMING_MIN_GIB = 10.0


def check_cache_blocks(Fn: int, Bn: int, n_blocks: int, what: str = "a transformer", option: str = "DBCache"):
    """ValueError unless the first Fn and the last Bn blocks leave a middle block to cache among n_blocks. A rule
    whose Fn does not fit a shallow model is refused, not shrunk to fit (that would run another rule than asked)."""
    if Fn + Bn >= n_blocks:
        raise ValueError(f"{option}: Fn={Fn} + Bn={Bn} leaves no middle block to cache in {what} of {n_blocks} "
                         f"blocks; allowed: Fn >= 1 and Fn + Bn < {n_blocks} (e.g. dbcache:1,0 or every:2,1,0)")


@dataclass(frozen=True)
class DBCache:
    """The fast pipeline's step cache, cache-dit's DBCache (Dual Block Cache) with its names' meaning and its
    Qwen-Image defaults (runtime/step_cache.py runs it; the README says where it differs from cache-dit):

    Fn: the first Fn blocks run every step (cache-dit's Fn_compute_blocks); Bn: so do the last Bn
        (Bn_compute_blocks); the middle blocks run or are replaced by their residual cached at the last step that ran
        them, for the image and the text stream.
    threshold: residual_diff_threshold: the middle runs unless mean|r - r_prev| / mean|r_prev| < threshold, r the
        image stream's residual over the first Fn blocks and r_prev that of the last step that ran the middle.
    warmup: max_warmup_steps: steps 0 .. warmup-1 of each CFG branch run every block.
    max_cached: max_cached_steps, at most this many cached steps per branch (-1: no limit).
    max_consecutive: max_continuous_cached_steps, at most this many cached steps in a row (-1: no limit).
    every: 0: the threshold rule above. k >= 2: a fixed schedule instead (cache-dit's static
        steps_computation_mask): after the warm-up the middle runs on one step in k and is reused on the k-1 others,
        whatever the residuals.
    taylorseer: 0: a cached step adds the middle's residuals as they were at the last step that ran it. n >= 1:
        cache-dit's TaylorSeer calibrator of order n (TaylorSeerCalibratorConfig(taylorseer_order=n), for the image
        and the text residual): it adds their Taylor extrapolation from the steps that ran the middle instead.
    Each CFG branch ("cond", "uncond") keeps its own state and decides for itself, paired in one forward or not."""

    Fn: int = 8
    Bn: int = 0
    threshold: float = 0.08
    warmup: int = 8
    max_cached: int = -1
    max_consecutive: int = -1
    every: int = 0
    taylorseer: int = 0

    def __post_init__(self):
        for name in ("Fn", "Bn", "warmup", "max_cached", "max_consecutive", "every", "taylorseer"):
            if not isinstance(getattr(self, name), int) or isinstance(getattr(self, name), bool):
                raise ValueError(f"DBCache {name}={getattr(self, name)!r}; allowed: an integer")
        if self.Fn < 1 or self.Bn < 0:
            raise ValueError(f"DBCache Fn={self.Fn}, Bn={self.Bn}; allowed: Fn >= 1, Bn >= 0 (and Fn + Bn below the "
                             "number of blocks)")
        if not self.threshold >= 0:
            raise ValueError(f"DBCache threshold={self.threshold!r}; allowed: a number >= 0")
        if self.warmup < 0 or self.max_cached < -1 or self.max_consecutive < -1:
            raise ValueError(f"DBCache warmup={self.warmup}, max_cached={self.max_cached}, max_consecutive="
                             f"{self.max_consecutive}; allowed: warmup >= 0, the others >= 0 or -1 (no limit)")
        if self.every < 0 or self.every == 1:
            raise ValueError(f"DBCache every={self.every}; allowed: 0 (threshold rule) or k >= 2 (the middle blocks "
                             "run on one step in k)")
        if self.taylorseer < 0:
            raise ValueError(f"DBCache taylorseer={self.taylorseer}; allowed: 0 (off) or the order n >= 1 (1 or 2 "
                             "recommended by cache-dit)")

    def label(self) -> str:
        """As applied shows it: dbcache:F8B0:0.08 (threshold rule) or dbcache:F8B0:every2 (fixed schedule); the
        warm-up, limits and TaylorSeer order when not cache-dit's defaults."""
        rule = f"every{self.every}" if self.every else f"{self.threshold:g}"
        extra = [f"w{self.warmup}"] if self.warmup != 8 else []
        extra += [f"mc{self.max_cached}"] if self.max_cached != -1 else []
        extra += [f"mcc{self.max_consecutive}"] if self.max_consecutive != -1 else []
        extra += [f"ts{self.taylorseer}"] if self.taylorseer else []
        return ":".join([f"dbcache:F{self.Fn}B{self.Bn}", rule, *extra])

    @classmethod
    def parse(cls, text: str) -> "DBCache":
        """The command line's grammar: "dbcache" (cache-dit's defaults), "dbcache:Fn,Bn,threshold" (any prefix of
        them), "every:k" or "every:k,Fn,Bn" (a fixed schedule, no warm-up unless ",w=N"), each optionally followed
        by ",warmup=N", ",max_cached=N", ",max_consecutive=N", ",taylorseer=N" (short: w=, mc=, mcc=, ts=)."""
        kind, _, rest = text.partition(":")
        if kind not in ("dbcache", "every"):
            raise ValueError(f"cache {text!r}: allowed: dbcache[:Fn,Bn,threshold] or every:k[,Fn,Bn], then "
                             "optionally ,w=N ,mc=N ,mcc=N ,ts=N")
        names = {"w": "warmup", "warmup": "warmup", "mc": "max_cached", "max_cached": "max_cached",
                 "mcc": "max_consecutive", "max_consecutive": "max_consecutive", "ts": "taylorseer",
                 "taylorseer": "taylorseer"}
        positional = ("Fn", "Bn", "threshold") if kind == "dbcache" else ("every", "Fn", "Bn")
        values: dict = {} if kind == "dbcache" else {"warmup": 0}
        items = [item for item in rest.split(",") if item] if rest else []
        if kind == "every" and not items:
            raise ValueError(f"cache {text!r}: every:k needs k (the middle blocks run on one step in k)")
        def number(text: str, kind: type):
            try:
                return kind(text)
            except ValueError:
                raise ValueError(f"{text!r} is not {'a number' if kind is float else 'an integer'}") from None

        try:
            for i, item in enumerate(items):
                name, eq, value = item.partition("=")
                if eq:
                    if name not in names:
                        raise ValueError(f"unknown setting {name!r}; allowed: w, mc, mcc, ts")
                    values[names[name]] = number(value, int)
                elif i < len(positional) and not any("=" in x for x in items[:i]):
                    values[positional[i]] = number(item, float if positional[i] == "threshold" else int)
                else:
                    raise ValueError(f"too many values ({item!r})")
            return cls(**values)
        except ValueError as e:
            raise ValueError(f"cache {text!r}: {e}") from None


BUILD = {"binds": "build"}
CALL = {"binds": "call"}


@dataclass(frozen=True)
class FastTransformerConfig:
    """fp8: run FP8_LINEARS in rowwise FP8 (False: BF16 mode, every GEMM in the model's dtype).
    bf16_linears: those of FP8_LINEARS kept in the model's dtype anyway (e.g. ("img_fc2",), which other engines
    found sensitive). fp8_fast_accum: cuBLAS's faster FP8 accumulation on Hopper (torchao's default).
    attention: "auto" (FlashAttention-4, else cuDNN, else SDPA) | "fa4" | "cudnn" | "sdpa".
    fp8_attention: lossy, off by default: the blocks' attention in FP8 on a Hopper GPU (q, k, v and the softmax
        probabilities in e4m3; model/fp8_attention.py). "off" | "cudnn" (cuDNN's FP8 SDPA, nvidia-cudnn-frontend)
        | "fa3" (FlashAttention-3's FP8 forward, tokenspeed-fa3) | "auto" (cuDNN's where it is installed, else
        FA3's, else the BF16 attention above, and `applied` / the plan say why). A named kernel that cannot run
        here is refused.

    fp8 and bf16_linears decide how the weights are stored (a saved checkpoint keeps them); fp8_fast_accum,
    attention and fp8_attention only how they run."""

    fp8: bool = field(default=True, metadata=BUILD)
    bf16_linears: tuple[str, ...] = field(default=(), metadata=BUILD)
    fp8_fast_accum: bool = field(default=True, metadata=BUILD)
    attention: str = field(default="auto", metadata=BUILD)
    fp8_attention: str = field(default="off", metadata=BUILD)

    def __post_init__(self):
        object.__setattr__(self, "bf16_linears", tuple(self.bf16_linears))
        unknown = [name for name in self.bf16_linears if name not in FP8_LINEARS]
        if unknown:
            raise ValueError(f"bf16_linears={unknown}; allowed: {', '.join(FP8_LINEARS)}")
        if self.attention not in ATTENTION_BACKENDS:
            raise ValueError(f"attention={self.attention!r}; allowed: {', '.join(ATTENTION_BACKENDS)}")
        if self.fp8_attention not in FP8_ATTENTION:
            raise ValueError(f"fp8_attention={self.fp8_attention!r}; allowed: {', '.join(FP8_ATTENTION)}")

    def is_fp8(self, name: str) -> bool:
        return self.fp8 and name in FP8_LINEARS and name not in self.bf16_linears

    @property
    def fp8_linears(self) -> tuple[str, ...]:
        return tuple(name for name in FP8_LINEARS if self.is_fp8(name))

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(FastTransformerConfig)} | {
            "bf16_linears": list(self.bf16_linears)}

    @classmethod
    def of(cls, config: "FastTransformerConfig") -> "FastTransformerConfig":
        """The transformer's options of a FastTransformerConfig or a FastConfig, as a FastTransformerConfig."""
        return cls(**{f.name: getattr(config, f.name) for f in fields(cls)})

    @classmethod
    def from_dict(cls, values: dict) -> "FastTransformerConfig":
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(set(values) - set(allowed))
        if unknown:
            raise ValueError(f"unknown FastTransformerConfig field(s) {unknown}; allowed: {', '.join(allowed)}")
        return cls(**values)


def transformer_configs(config: dict, stock_fields: dict, stock_name: str,
                        fast_config: FastTransformerConfig | dict | None) -> tuple[dict, FastTransformerConfig]:
    """A fast transformer's constructor arguments, checked: its stock model's config (stock_name's fields; another
    field is a TypeError naming it, the missing ones take stock_fields' values) and its FastTransformerConfig (one
    given, a FastConfig's transformer options, a dict of them, or None: the defaults)."""
    unknown = sorted(set(config) - set(stock_fields))
    if unknown:
        raise TypeError(f"unknown {stock_name} config field(s) {unknown}")
    fast = (FastTransformerConfig.of(fast_config) if isinstance(fast_config, FastTransformerConfig)
            else FastTransformerConfig.from_dict(fast_config or {}))
    return {**stock_fields, **config}, fast


@dataclass(frozen=True)
class FastConfig(FastTransformerConfig):
    """The transformer's options (above) and the pipeline's:

    fused_transformer: the fused-kernel transformer (FastQwenImageTransformer) instead of diffusers' blocks; the
        transformer's options need it.
    batched_cfg: prompt and negative prompt in one forward of batch 2N, padded text masked.
    cuda_graphs: replay transformer forwards from CUDA graphs (runtime/runner.py: a forward signature's first
        forward in a call runs eagerly, the second captures); text lengths round up to a multiple of text_bucket
        (padding masked) so that prompts of other lengths share a graph. Needs fused_transformer and CUDA.
    scheduler: "euler" (the pipeline's own scheduler, whatever it is) | "dpm++2m" | "unipc" (derived at call time
        from the pipeline's scheduler config). Text-to-image only.
    cfg_fraction: selective CFG: guidance only for the first fraction of the steps (1.0 = every step).
        Text-to-image only.
    vae_2d_decode: decode an image with plain 2D convolutions (2512: its decoder's causal 3D ones as the 2D ones
        they amount to for one frame), each norm and SiLU one kernel, no frame cache (core/model/vae_2d.py); not
        while the VAE tiles or has offload hooks.
    parallel: one image on several processes of an initialised torch.distributed group (runtime/parallel.py):
        "none" | "cfg" (2 ranks: prompt and negative prompt; needs CFG; then batched_cfg does not apply) |
        "ulysses" (sequence parallel; needs fused_transformer) | "cfg,ulysses". Text-to-image only.
    ulysses_degree: ranks per Ulysses group; 0 = every rank CFG leaves. With world = dp x cfg x ulysses, dp > 1
        groups each denoise their own images (the CLI splits the prompts among them).
    modulation_table: every block's modulation vectors for every step computed once per schedule and looked up in
        the loop, equal to computing them in each forward up to the GEMM's summation order (model/modulation.py);
        not while offload hooks move the weights. Text-to-image only.
    memory: "fast" (every weight on the GPU) | "low" (runtime/offload.py: the modulation weights stay on the host,
        where tables are built from; the text encoder and the transformer's block linears take turns on the GPU in
        one shared buffer). Needs modulation_table; not with parallel. Text-to-image only.
    max_memory_gib: with memory="low", the GPU memory the pipeline is planned to use (PyTorch's reserved memory
        plus the CUDA context), for one image a call up to 1328x1328 (runtime/memory.py): the shared buffer is what
        it leaves, and the transformer's blocks and the text encoder's layers that do not fit stream from pinned
        host memory (runtime/streaming.py), the same images bit for bit; too small a budget is refused with the
        smallest that works. None: the buffer holds the transformer's blocks (about 22 GiB in all). It plans, it
        does not cap: set torch.cuda.set_per_process_memory_fraction for a hard cap (the command line's
        --max-memory does both).
    cache: None (every block every step) or a DBCache (above; or its command-line form, "dbcache:8,0,0.08"): lossy,
        the middle blocks of a step replaced by their cached residual when the first blocks' residual barely
        changed. Needs fused_transformer; not with parallel="ulysses" (runtime/step_cache.py).
    """

    fused_transformer: bool = field(default=True, metadata=BUILD)
    batched_cfg: bool = field(default=True, metadata=CALL)
    cuda_graphs: bool = field(default=True, metadata=CALL)
    text_bucket: int = field(default=64, metadata=CALL)
    scheduler: str = field(default="euler", metadata=CALL)
    cfg_fraction: float = field(default=1.0, metadata=CALL)
    vae_2d_decode: bool = field(default=True, metadata=BUILD)
    parallel: str = field(default="none", metadata=BUILD)
    ulysses_degree: int = field(default=0, metadata=BUILD)
    modulation_table: bool = field(default=True, metadata=CALL)
    memory: str = field(default="fast", metadata=BUILD)
    max_memory_gib: float | None = field(default=None, metadata=BUILD)
    cache: DBCache | None = field(default=None, metadata=CALL)

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.cache, str):
            object.__setattr__(self, "cache", None if self.cache == "none" else DBCache.parse(self.cache))
        if self.cache is not None and not isinstance(self.cache, DBCache):
            raise ValueError(f"cache={self.cache!r}; allowed: None, a DBCache(...) or its command-line form "
                             "(e.g. 'dbcache:8,0,0.08', 'every:2')")
        if self.cache is not None and not self.fused_transformer:
            raise ValueError("cache=DBCache(...) runs inside the fused transformer; keep fused_transformer=True (on "
                             "the stock transformer use diffusers' transformer.enable_cache)")
        parallel = ",".join(sorted(self.parallel.split(","))) if isinstance(self.parallel, str) else self.parallel
        if parallel not in PARALLEL_MODES:
            raise ValueError(f"parallel={self.parallel!r}; allowed: {', '.join(PARALLEL_MODES)}")
        object.__setattr__(self, "parallel", parallel)
        if not isinstance(self.ulysses_degree, int) or self.ulysses_degree < 0:
            raise ValueError(f"ulysses_degree={self.ulysses_degree!r}; allowed: an integer >= 0 (0 = all the ranks)")
        if self.ulysses_degree > 1 and "ulysses" not in parallel:
            raise ValueError(f"ulysses_degree={self.ulysses_degree} needs parallel='ulysses' or 'cfg,ulysses' "
                             f"(parallel={parallel!r})")
        if "ulysses" in parallel and self.fp8_attention in ("cudnn", "fa3"):
            raise ValueError(f"fp8_attention={self.fp8_attention!r} with parallel={parallel!r} is not supported (the "
                             "all-to-all moves BF16 heads): use one of them, or fp8_attention='auto'")
        if self.fp8_attention in ("cudnn", "fa3") and not self.fused_transformer:
            raise ValueError(f"fp8_attention={self.fp8_attention!r} runs inside the fused transformer; keep "
                             "fused_transformer=True")
        if "ulysses" in parallel and not self.fused_transformer:
            raise ValueError(f"parallel={parallel!r}: Ulysses runs inside the fused transformer; keep "
                             "fused_transformer=True")
        if self.memory not in MEMORY_MODES:
            raise ValueError(f"memory={self.memory!r}; allowed: {', '.join(MEMORY_MODES)}")
        if self.memory == "low" and not (self.modulation_table and self.fused_transformer):
            raise ValueError("memory='low' keeps the modulation weights on the host and needs modulation_table=True "
                             "and fused_transformer=True")
        if self.max_memory_gib is not None and (isinstance(self.max_memory_gib, bool) or not isinstance(
                self.max_memory_gib, (int, float)) or not self.max_memory_gib > 0):
            raise ValueError(f"max_memory_gib={self.max_memory_gib!r}; allowed: None or a number of GiB > 0")
        if self.max_memory_gib is not None and self.memory != "low":
            raise ValueError(f"max_memory_gib={self.max_memory_gib:g} plans memory='low''s buffer; set "
                             f"memory='low' too (memory={self.memory!r} keeps every weight on the GPU)")
        if self.memory == "low" and parallel != "none":
            raise ValueError(f"memory='low' with parallel={parallel!r} is not supported: one or the other")
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler={self.scheduler!r}; allowed: {', '.join(SCHEDULERS)}")
        if not 0.0 < self.cfg_fraction <= 1.0:
            raise ValueError(f"cfg_fraction={self.cfg_fraction}; allowed: 0 < cfg_fraction <= 1 (1 = CFG every step)")
        if not isinstance(self.text_bucket, int) or self.text_bucket < 1:
            raise ValueError(f"text_bucket={self.text_bucket!r}; allowed: an integer >= 1")

    def transformer_config(self) -> FastTransformerConfig:
        return FastTransformerConfig.of(self)

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

    # Not saved with a pipeline: where and how this machine runs it, not what the weights compute
    NOT_SAVED = ("parallel", "ulysses_degree", "memory", "max_memory_gib")

    def saved(self) -> dict:
        """Every field but NOT_SAVED as JSON values (a pipeline's save_pretrained writes them)."""
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in self.NOT_SAVED}
        return values | {"bf16_linears": list(self.bf16_linears),
                         "cache": None if self.cache is None else asdict(self.cache)}

    @classmethod
    def from_saved(cls, values: dict) -> "FastConfig":
        """What saved() wrote, as a FastConfig (this machine's defaults for NOT_SAVED)."""
        allowed = [f.name for f in fields(cls) if f.name not in cls.NOT_SAVED]
        unknown = sorted(set(values) - set(allowed))
        if unknown:
            raise ValueError(f"unknown saved FastConfig field(s) {unknown}; allowed: {', '.join(allowed)}")
        cache = values.get("cache")
        return cls(**values | {"cache": None if cache is None else DBCache(**cache)})

    def changed_build_options(self, other: "FastConfig") -> list[str]:
        """The build options whose values differ between self and other."""
        return [f.name for f in fields(self) if f.metadata["binds"] == "build"
                and getattr(self, f.name) != getattr(other, f.name)]

    def differences(self, base: "FastConfig") -> dict:
        """{field: value} where self differs from `base` (e.g. a preset): what a command line changed."""
        mine, theirs = asdict(self), asdict(base)
        return {name: value for name, value in mine.items() if value != theirs[name]}

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
        budget = f"{self.max_memory_gib:g}" if self.max_memory_gib else ""
        parts += [f"lowmem{budget}"] if self.memory == "low" else []
        parts += [self.cache.label().replace(":", "-")] if self.cache is not None else []
        parts += [self.scheduler.replace("+", "p")]
        parts += [f"cfg{self.cfg_fraction:g}"] if self.cfg_fraction < 1 else []
        parts += ["vae2d"] if self.vae_2d_decode else []
        parts += ["cfgpar"] if "cfg" in self.parallel.split(",") else []
        parts += [f"ulysses{self.ulysses_degree or 'all'}"] if "ulysses" in self.parallel else []
        return "-".join(parts)
