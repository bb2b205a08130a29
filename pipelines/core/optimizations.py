"""Every optimization of the fast pipelines, declared once: its `applied` label, the FastConfig field that switches
it, whether it is exact or lossy (and a lossy one's error bound), and when it can run.

`pipe.applied` is built from here only: before a call, `planned_labels` (what the next call will run; those that
need something of the call, CFG for batched_cfg, cfg_fraction and parallel:cfg2, as in a call with CFG); after a
call, `CallRecord.labels` (what that call ran: the code that runs an optimization records it). The command line's
`--no-<name>` flags and `--dry-run` come from here too. Kinds:
- "exact": the output equals stock diffusers' at the same inputs and seed (fp32 tiny config: EXACT_TOL);
- "lossy": an approximation, within its Bound;
- "choice": computes something else on purpose, as stock diffusers does when set up the same way (another sampler,
  a guidance schedule, a rewritten prompt); equal to that to EXACT_TOL.

Free of torch/diffusers imports (the command line imports it to build its parser).
"""

from dataclasses import dataclass, field
from typing import Callable

from .config import FastConfig

# fp32, tiny config, FP8 off: what "equal to stock" means for an exact optimization (final latents, rel-RMS).
EXACT_TOL = 1e-5
QWEN21 = "QwenImage21Pipeline"


@dataclass(frozen=True)
class Bound:
    """A lossy optimization's error: rel-RMS of the final latents against stock diffusers at the same seed, on the
    tiny fp32 test config on the CPU (`tiny`, 3 steps), and at the real shapes with random weights on a GPU (`full`,
    50 steps, with the decoded image's PSNR). Random weights do not reproduce real activations: `full` says what
    was measured there, not what a real checkpoint gives."""

    tiny: float | None  # None: it does not run on the CPU
    full: float
    full_psnr_db: float


# Measured: tiny 1.5e-3 to 1.1e-2 over the pipelines (test_optimizations.py); full 4.4e-2, 45 dB at 1024^2 (H200).
FP8_BOUND = Bound(tiny=2e-2, full=0.1, full_psnr_db=38.0)
# FP8 attention's kernels run on Hopper only. `full`: with the FP8 GEMMs, against stock (benchmarks/RESULTS.md "FP8
# attention"); each attention call alone sits at ~6e-2 rel-RMS against fp32 on Gaussian operands (BF16: 3.5e-3).
FP8_ATTENTION_BOUND = Bound(tiny=None, full=0.15, full_psnr_db=34.0)


# A step cache's error depends on its threshold or schedule and on the content: no bound holds for every setting.
# What the tests hold it to instead: each diffusers cache config equals stock diffusers with the same config
# (decisions and latents, EXACT_TOL), and FastConfig(cache=...) equals its plain-PyTorch reference of the rule
# (tests/pipelines/test_step_caches.py); its error against the uncached image is the user's to measure (compare).
STEP_CACHE_BOUND = None


@dataclass(frozen=True)
class Facts:
    """What decides whether an optimization can run, read off a built pipeline (FastPipelineMixin.facts) or, for
    the command line's --dry-run, known before anything loads."""

    pipeline: str  # the diffusers pipeline class it is, or is the fast version of, e.g. "QwenImageEditPlusPipeline"
    fused: bool  # the transformer is the fused FastQwenImageTransformer
    device: str  # where the transformer runs: "cuda" or "cpu"
    fp8: bool  # its block linears run FP8 GEMMs (False on a GPU that cannot: fp8_why)
    fast_accum: bool  # ... with fast accumulation
    attention: str | None  # the attention backend it runs (None: not fused)
    offload_hooks: bool  # accelerate's or diffusers' offload hooks on the transformer
    vae_2d: str | None  # None: the VAE decodes an image as 2D convolutions; else why not
    enhancer: bool  # a prompt enhancer rewrites prompts
    parallel: tuple[str, ...] = ()  # the process mesh's labels: "cfg2", "ulysses4"
    fp8_attention: str | None = None  # the FP8 attention kernel that runs ("cudnn", "fa3"), else None
    fp8_attention_why: str | None = None  # ... and why not, when "auto" was asked and none can run here
    diffusers_cache: str | None = None  # the config class of a cache enabled by transformer.enable_cache(...)
    cache_rule: str | None = None  # ... the rule making its decisions (native_rule): "first_block", "taylorseer",
    # "pyramid_broadcast", "faster_cache", "sea_cache"
    loaded: tuple = ()  # a transformer from one checkpoint file: (label name, value) pairs (core/single_file/)
    fp8_why: str | None = None  # why this device runs no FP8 GEMM (gpu_support.fp8_gemm_why_not), None where it can

    @property
    def text_to_image(self) -> bool:
        return self.pipeline == "QwenImagePipeline"

    @property
    def qwen21(self) -> bool:
        """Qwen-Image-2.1's pipeline (its own transformer: pipelines/qwen_image21/)."""
        return self.pipeline == QWEN21


@dataclass(frozen=True)
class Plan:
    values: tuple = ()  # what will run: () not at all, (True,) a plain label, else each a label's value
    why_not: str | None = None  # asked for but cannot run here


NOT_ASKED = Plan()


@dataclass(frozen=True)
class Optimization:
    name: str  # the applied label (with ":value" for valued ones)
    field: str | None  # the FastConfig field that switches it (None: a pipeline argument, enhance_prompt)
    kind: str  # "exact" | "lossy" | "choice"
    summary: str
    plan: Callable[[FastConfig, Facts], Plan] = field(repr=False)
    bound: Bound | None = None
    needs: tuple[str, ...] = ()  # optimizations it runs inside: switching one of those off switches it off
    text_to_image_only: bool = False  # the image-conditioned pipelines run diffusers' loop, which it would change

    def label(self, value) -> str:
        return self.name if value is True else f"{self.name}:{value}"

    @property
    def binds(self) -> str:
        from dataclasses import fields

        if self.field is None:
            return "build"
        return next(f.metadata["binds"] for f in fields(FastConfig) if f.name == self.field)


def plain(asked: bool, why_not: str | None = None, values: tuple = (True,)) -> Plan:
    if not asked:
        return NOT_ASKED
    return Plan(why_not=why_not) if why_not else Plan(values=values)


def no_graphs_reason(facts: Facts) -> str | None:
    if not facts.fused:
        return "needs fused_transformer (the stock transformer's forward is not captured)"
    if facts.device != "cuda":
        return f"needs a CUDA device (the transformer runs on {facts.device})"
    if facts.offload_hooks:
        return "offload hooks move the weights between forwards (a graph would read stale addresses)"
    if facts.qwen21 and facts.diffusers_cache:
        return (f"diffusers' {facts.diffusers_cache} hooks decide on the host inside each forward: Qwen-Image-2.1's "
                "forwards run eagerly under them")
    return None


def runs_cache_rule(config: FastConfig, facts: Facts) -> bool:
    """Whether the runner makes the enabled diffusers cache's decisions by its rule in this pipeline's calls (batched
    CFG and whole-forward graphs as for FastConfig(cache=...)) instead of running its hooks (model/step_caches.py
    says why not under offload hooks, nor FirstBlockCache in the ControlNet pipelines, nor TaylorSeer with
    cfg_fraction < 1)."""
    if not facts.cache_rule or not facts.fused or facts.offload_hooks:
        return False
    if facts.cache_rule == "first_block":
        return "ControlNet" not in facts.pipeline
    if facts.cache_rule == "taylorseer":
        return config.cfg_fraction == 1
    return True


# The text-to-image-only options Qwen-Image-2.1's pipeline runs too, in diffusers' loop: it places its components
# itself (qwen_image21/memory.py)
QWEN21_ALSO_RUNS = ("memory",)


def text_to_image_reason(facts: Facts, name: str = "") -> str | None:
    """Why text-to-image-only option `name` does not run here (None: it does)."""
    if facts.text_to_image or (facts.qwen21 and name in QWEN21_ALSO_RUNS):
        return None
    return f"{facts.pipeline} runs diffusers' own loop"


def plan_fused(config: FastConfig, facts: Facts) -> Plan:
    return plain(config.fused_transformer)


def plan_fp8(config: FastConfig, facts: Facts) -> Plan:
    asked = config.fused_transformer and config.fp8
    if asked and set(config.bf16_linears) >= {"img_qkv", "img_out", "img_fc1", "img_fc2", "txt_qkv", "txt_out",
                                              "txt_fc1", "txt_fc2"}:
        return Plan(why_not="bf16_linears keeps every block linear in BF16")
    return plain(asked, None if facts.fp8 else facts.fp8_why or "FP8 GEMMs do not run on this device")


def plan_fast_accum(config: FastConfig, facts: Facts) -> Plan:
    return plain(config.fused_transformer and config.fp8 and config.fp8_fast_accum,
                 None if facts.fp8 and facts.fast_accum else "no FP8 GEMM runs")


def plan_attention(config: FastConfig, facts: Facts) -> Plan:
    return Plan(values=(facts.attention,)) if config.fused_transformer and facts.attention else NOT_ASKED


def plan_fp8_attention(config: FastConfig, facts: Facts) -> Plan:
    """Ulysses first: the model has a kernel but its forwards run none there (transformer.fp8_attention_in)."""
    if config.fp8_attention == "off":
        return NOT_ASKED
    if not config.fused_transformer:  # "auto" only: FastConfig refuses a named kernel without it
        return Plan(why_not="needs fused_transformer: the stock transformer's attention runs")
    if any(p.startswith("ulysses") for p in facts.parallel):
        return Plan(why_not="parallel='ulysses' moves BF16 heads between ranks: BF16 attention runs")
    if facts.fp8_attention:
        return Plan(values=(facts.fp8_attention,))
    return Plan(why_not=facts.fp8_attention_why)


def plan_batched_cfg(config: FastConfig, facts: Facts) -> Plan:
    if facts.qwen21 and config.max_memory_gib is not None:
        return plain(config.batched_cfg, "Qwen-Image-2.1's memory budget is planned for one branch's forward at a "
                                         "time (qwen_image21/memory.py)")
    if "cfg2" in facts.parallel:
        return plain(config.batched_cfg, "parallel='cfg' runs the negative prompt on another rank")
    if facts.diffusers_cache and not runs_cache_rule(config, facts):
        return plain(config.batched_cfg, f"diffusers' {facts.diffusers_cache} keeps a state per cache_context: the "
                                         "cond and uncond forwards run one by one")
    stateless = facts.cache_rule == "sea_cache"  # fail-open in the pipelines: no state to undo
    if (config.cache is not None or facts.diffusers_cache) and not facts.text_to_image and not stateless:
        return plain(config.batched_cfg, "the step cache's branches advance once per forward, which pairing by "
                                         "speculation in diffusers' loop could not undo")
    return plain(config.batched_cfg, None if facts.text_to_image or facts.fused else
                 "the image-conditioned pipelines pair their CFG forwards inside the fused transformer")


def plan_cuda_graphs(config: FastConfig, facts: Facts) -> Plan:
    """Under diffusers' step caches whose hooks decide on the host around the blocks inside each forward, each block
    replays from its own graphs ("blocks"; runtime/runner.py)."""
    plan = plain(config.cuda_graphs and config.fused_transformer, no_graphs_reason(facts))
    hooks = facts.diffusers_cache and not runs_cache_rule(config, facts)
    return Plan(values=("blocks",)) if plan.values and hooks else plan


def plan_modulation_table(config: FastConfig, facts: Facts) -> Plan:
    why_not = (text_to_image_reason(facts) or (None if facts.fused else "needs fused_transformer")
               or ("offload hooks bring the weights to the GPU only inside the forward" if facts.offload_hooks else None))
    return plain(config.modulation_table and config.fused_transformer, why_not)


def memory_label(config: FastConfig) -> str:
    """memory's applied value: "low", or "low16gib" with a budget of 16 GiB (what does not fit it streams)."""
    return config.memory + (f"{config.max_memory_gib:g}gib" if config.max_memory_gib is not None else "")


def plan_memory(config: FastConfig, facts: Facts) -> Plan:
    return plain(config.memory != "fast", text_to_image_reason(facts, "memory"), (memory_label(config),))


def plan_parallel(config: FastConfig, facts: Facts) -> Plan:
    return plain(config.parallel != "none", text_to_image_reason(facts), facts.parallel)


def plan_scheduler(config: FastConfig, facts: Facts) -> Plan:
    return plain(config.scheduler != "euler", text_to_image_reason(facts), (config.scheduler,))


def plan_cfg_fraction(config: FastConfig, facts: Facts) -> Plan:
    return plain(config.cfg_fraction != 1, text_to_image_reason(facts), (f"{config.cfg_fraction:g}",))


# diffusers' caches whose hooks keep one state for both CFG branches (not one per cache_context)
ONE_STATE_CACHES = ("PyramidAttentionBroadcastConfig", "FasterCacheConfig")


def step_cache_conflict(config: FastConfig, facts: Facts) -> str | None:
    """Why the step caches asked for cannot run together or here (a call raises it)."""
    if config.cache is not None and facts.diffusers_cache:
        return (f"FastConfig(cache={config.cache.label()}) and diffusers' {facts.diffusers_cache} (enable_cache) are "
                "two step caches: use one (transformer.disable_cache(), or fast_config.replace(cache=None))")
    if (config.cache is not None or facts.diffusers_cache) and any(p.startswith("ulysses") for p in facts.parallel):
        return ("a step cache with parallel='ulysses' would decide on each rank's rows alone; use parallel='cfg' "
                "(each rank keeps its branch's cache) or no step cache")
    if facts.diffusers_cache in ONE_STATE_CACHES and any(p.startswith("cfg") for p in facts.parallel):
        return (f"diffusers' {facts.diffusers_cache} keeps one state for cond and uncond (the uncond forward reuses "
                "what the cond forward left): with parallel='cfg' each rank sees one branch and would decide "
                "otherwise; use no parallel mode, or FirstBlockCacheConfig / TaylorSeerCacheConfig (a state per branch)")
    if config.cache is not None and not facts.fused:
        return "FastConfig(cache=...) needs fused_transformer"
    return None


def plan_step_cache(config: FastConfig, facts: Facts) -> Plan:
    if config.cache is None and not facts.diffusers_cache:
        return NOT_ASKED
    why_not = step_cache_conflict(config, facts)
    if why_not:
        return Plan(why_not=why_not)
    return Plan(values=(config.cache.label() if config.cache is not None else facts.diffusers_cache,))


def loaded_plan(name: str) -> Callable[[FastConfig, Facts], Plan]:
    """What loading the transformer's single file did (recorded when it loaded, not switched by a FastConfig)."""
    return lambda config, facts: Plan(values=tuple(value for label, value in facts.loaded if label == name))


def plan_vae_2d_decode(config: FastConfig, facts: Facts) -> Plan:
    return plain(config.vae_2d_decode, facts.vae_2d)


def plan_enhance_prompt(config: FastConfig, facts: Facts) -> Plan:
    return plain(facts.enhancer)


REGISTRY: tuple[Optimization, ...] = (
    Optimization("fused_transformer", "fused_transformer", "exact",
                 "the transformer on fused Triton kernels (FastQwenImageTransformer)", plan_fused),
    Optimization("fp8", "fp8", "lossy", "rowwise FP8 GEMMs for the block linears", plan_fp8, bound=FP8_BOUND,
                 needs=("fused_transformer",)),
    Optimization("fp8_fast_accum", "fp8_fast_accum", "lossy",
                 "Hopper's fast FP8 accumulation (inside fp8's bound)", plan_fast_accum, bound=FP8_BOUND,
                 needs=("fused_transformer", "fp8")),
    Optimization("attention", "attention", "exact", "the attention kernel, padded text masked", plan_attention,
                 needs=("fused_transformer",)),
    Optimization("fp8_attention", "fp8_attention", "lossy",
                 "the blocks' attention in FP8 on Hopper (q, k, v and the probabilities in e4m3)", plan_fp8_attention,
                 bound=FP8_ATTENTION_BOUND, needs=("fused_transformer",)),
    Optimization("modulation_table", "modulation_table", "exact",
                 "every step's modulation vectors computed once per schedule", plan_modulation_table,
                 needs=("fused_transformer",), text_to_image_only=True),
    Optimization("memory", "memory", "exact",
                 "low: the text encoder and the transformer's blocks take turns on the GPU (2512's modulation "
                 "weights on the host); low<N>gib: planned in N GiB, the blocks and text encoder layers that do not "
                 "fit streamed from the host",
                 plan_memory, needs=("fused_transformer", "modulation_table"), text_to_image_only=True),
    Optimization("parallel", "parallel", "exact", "one image on several processes (CFG-parallel, Ulysses)",
                 plan_parallel, text_to_image_only=True),
    Optimization("batched_cfg", "batched_cfg", "exact", "prompt and negative prompt in one forward of batch 2N",
                 plan_batched_cfg),
    Optimization("cuda_graphs", "cuda_graphs", "exact", "transformer forwards replayed from CUDA graphs",
                 plan_cuda_graphs, needs=("fused_transformer",)),
    Optimization("step_cache", "cache", "lossy",
                 "steps reuse the cached residual of blocks whose input barely changed: FastConfig(cache=DBCache(...))"
                 " or diffusers' transformer.enable_cache(...)", plan_step_cache, bound=STEP_CACHE_BOUND),
    Optimization("scheduler", "scheduler", "choice", "DPM-Solver++ 2M or UniPC from the pipeline's scheduler",
                 plan_scheduler, text_to_image_only=True),
    Optimization("cfg_fraction", "cfg_fraction", "choice", "guidance on the first fraction of the steps only",
                 plan_cfg_fraction, text_to_image_only=True),
    Optimization("enhance_prompt", None, "choice", "prompts rewritten by a local Qwen3.5", plan_enhance_prompt,
                 text_to_image_only=True),
    Optimization("single_file", None, "exact",
                 "the transformer read from one checkpoint file (its format: comfyui_scaled_fp8, gguf_q8_0, ...) into "
                 "the fast layout; e4m3 codes with a per-tensor scale kept as rowwise FP8, bit for bit",
                 loaded_plan("single_file")),
    Optimization("dequantized", None, "exact",
                 "tensors the file stores quantized (its source: fp8_e4m3fn_scaled, gguf_q4_0, ...) where the model "
                 "keeps its dtype: the stored value computed in fp32, rounded once to that dtype", loaded_plan("dequantized")),
    Optimization("requantized", None, "lossy",
                 "FP8 block weights from a form the FP8 GEMMs cannot take as is (GGUF blocks, e5m2 codes, parts "
                 "stored unlike each other): the stored value in fp32 quantized to rowwise e4m3, a second rounding "
                 "(against the file's own dequantized weights: the fp8 bound)", loaded_plan("requantized"),
                 bound=FP8_BOUND),
    Optimization("vae_2d_decode", "vae_2d_decode", "exact",
                 "an image's VAE decode as plain 2D convolutions (2512: what its causal 3D ones amount to), each "
                 "norm and SiLU one kernel, no frame cache", plan_vae_2d_decode),
)
BY_NAME = {opt.name: opt for opt in REGISTRY}
CFG_ONLY = ("batched_cfg", "cfg_fraction")  # they run only in a call with CFG (true_cfg_scale > 1, a negative prompt)


def plans(config: FastConfig, facts: Facts) -> list[tuple[Optimization, Plan]]:
    return [(opt, opt.plan(config, facts)) for opt in REGISTRY]


def planned_labels(config: FastConfig, facts: Facts) -> list[str]:
    """What the next call will run (a call with CFG)."""
    return [opt.label(value) for opt, plan in plans(config, facts) for value in plan.values]


def refused_by_image_conditioned(config: FastConfig, runs: tuple[str, ...] = ()) -> list[Optimization]:
    """The text-to-image-only optimizations that `config` sets away from their default: an image-conditioned
    pipeline (diffusers' own loop) refuses them rather than ignore them, but those it `runs` (Qwen-Image-2.1's:
    QWEN21_ALSO_RUNS). One on by default there (modulation_table) just does not run, and applied / --dry-run say so;
    switched off (the baseline preset) it asks for nothing."""
    default = FastConfig()
    return [opt for opt in REGISTRY if opt.text_to_image_only and opt.field is not None and opt.name not in runs
            and getattr(config, opt.field) is not False and getattr(config, opt.field) != getattr(default, opt.field)]


class CallRecord:
    """What one pipeline call ran, recorded by the code that ran it: name -> values (insertion-ordered)."""

    def __init__(self):
        self.ran: dict[str, dict] = {}
        self.blocks_run = self.blocks_total = 0  # transformer blocks x batch rows: run, and in the forwards

    def count_blocks(self, run: int, total: int):
        self.blocks_run += run
        self.blocks_total += total

    @property
    def blocks_fraction(self) -> float | None:
        """The fraction of the call's transformer blocks (times rows) that ran: 1.0 without a step cache; None
        when no fused transformer forward ran."""
        return self.blocks_run / self.blocks_total if self.blocks_total else None

    def add(self, name: str, value=True):
        if name not in BY_NAME:
            raise KeyError(f"{name!r} is not a registered optimization (optimizations.REGISTRY)")
        self.ran.setdefault(name, {})[value] = None

    def labels(self) -> list[str]:
        return [opt.label(value) for opt in REGISTRY for value in self.ran.get(opt.name, ())]
