"""The pipeline base every model family's fast pipelines share: a fast pipeline class mixes FastLoraPipeline and
FastCheckpointPipeline in before its diffusers class (the 2512 family through qwen_image/fast_pipeline.py's
FastPipelineMixin, Qwen-Image-2.1's pipeline directly): the LoRA methods the fast transformer answers, saving a fast
pipeline and loading it back (its FP8 weights as stored) or converting an upstream checkpoint, and the checks of a
FastConfig against a pipeline that need no model family's code.
"""

import contextlib
import inspect
import json
import logging
from pathlib import Path

import torch
from diffusers.pipelines.pipeline_utils import logger as diffusers_pipeline_logger

from ..config import FastConfig, check_cache_blocks
from ..hub import check_path_or_id, local_folder
from ..gpu_support import fp8_gemm_why_not
from ..optimizations import (CallRecord, Facts, planned_labels, plans, refused_by_image_conditioned, runs_cache_rule,
                            step_cache_conflict)
from ..runtime.context import forward_context
from ..runtime.runner import Runner

logger = logging.getLogger(__name__)

# The fast transformers' class names, as a saved fast pipeline's model_index.json names them (the families' classes:
# qwen_image/model/transformer.py, qwen_image21/model.py; tests/pipelines/test_dropin.py checks the names)
FAST_TRANSFORMERS = ("FastQwenImageTransformer", "FastQwenImage21Transformer")
# The VAE classes a model_index.json names: stock -> fast (qwen_image/model/vae.py, qwen_image21/vae.py)
FAST_VAES = {"AutoencoderKLQwenImage": "FastAutoencoderKLQwenImage",
             "AutoencoderKLQwenImage21": "FastAutoencoderKLQwenImage21"}


def transformer_config_on(config: FastConfig, device: torch.device):
    """config's transformer options for a model on `device`: BF16 GEMMs, with a warning, on a GPU that cannot run
    the FP8 ones (gpu_support.py; applied then lacks fp8, and --dry-run says why)."""
    transformer_config = config.transformer_config()
    why = fp8_gemm_why_not(device) if config.fp8 else None
    if why is not None:
        logger.warning("fp8=True on %s: %s", torch.cuda.get_device_name(device), why)
        transformer_config = transformer_config.__class__(**{**transformer_config.to_dict(), "fp8": False})
    return transformer_config


def image_conditioned_refusal(pipeline: str, options: list[str]) -> str:
    return (f"{', '.join(options)}: supported by the text-to-image QwenImageFastPipeline only, not by {pipeline}, "
            "which runs diffusers' own loop (replace pipe.scheduler to sample otherwise; render one image per "
            "process instead of parallel; for less GPU memory, pipe.enable_model_cpu_offload())")


def refuse_text_to_image_only(config: FastConfig, pipeline: str, runs: tuple[str, ...] = ()):
    """ValueError naming the text-to-image-only options `config` asks for (with their values), which `pipeline`
    (running diffusers' loop) would otherwise ignore; runs: those it runs all the same."""
    refused = refused_by_image_conditioned(config, runs)
    if refused:
        raise ValueError(image_conditioned_refusal(pipeline, [f"{opt.field}={getattr(config, opt.field)!r}"
                                                              for opt in refused]))


def check_replacement(built: FastConfig, config: FastConfig, pipeline: str, image_conditioned: bool):
    """ValueError unless `config` may replace `built` on a pipeline (pipe.fast_config = ...): the build options as
    built, and on a pipeline running diffusers' loop no text-to-image-only option asked for."""
    changed = config.changed_build_options(built)
    if changed:
        raise ValueError(f"FastConfig options {changed} are read when the pipeline is built: build it again "
                         "(optimize / from_pretrained) to change them; call options (batched_cfg, cuda_graphs, "
                         "scheduler, cfg_fraction, modulation_table, text_bucket) can change here")
    refused = refused_by_image_conditioned(config) if image_conditioned else []
    if refused:
        raise ValueError(image_conditioned_refusal(pipeline, [opt.field for opt in refused]))


def check_blocks_for_cache(transformer, config: FastConfig):
    """ValueError when config's step cache leaves no middle block in the transformer (stock or fast: checked when
    the config is set, before converting anything, not at the first call)."""
    if config.cache is not None and hasattr(transformer, "transformer_blocks"):
        check_cache_blocks(config.cache.Fn, config.cache.Bn, len(transformer.transformer_blocks), "the transformer",
                           f"FastConfig(cache={config.cache.label()!r})")


def check_given_fast_transformer(transformer, config: FastConfig):
    """ValueError unless a pipeline built around a fast transformer already asks for what it stores (its weights
    are as they were converted: fused, FP8 or not, which linears kept in BF16)."""
    stored = transformer.fast_config
    if not config.fused_transformer or (stored.fp8, stored.bf16_linears) != (config.fp8, config.bf16_linears):
        raise ValueError(
            f"the pipeline's transformer is a {type(transformer).__name__} (fp8={stored.fp8}, bf16_linears="
            f"{list(stored.bf16_linears)}) but fast_config asks for fused_transformer={config.fused_transformer}, "
            f"fp8={config.fp8}, bf16_linears={list(config.bf16_linears)}: pass a FastConfig that matches it, or "
            "build the pipeline from the stock transformer")


def init_arguments(pipe) -> dict:
    """What rebuilds `pipe` with its class's constructor: its components and the optional parameters it was built
    with (diffusers' `components` leaves those out: QwenImage21Pipeline's sample_sigmas, the checkpoint's grid)."""
    _, optional = pipe._get_signature_keys(pipe)
    return pipe.components | {name: pipe.config[name] for name in optional if name in pipe.config}


def load_dtype(kwargs: dict, component: str) -> torch.dtype:
    """The dtype diffusers' from_pretrained loads `component` in: dtype / torch_dtype (a dtype, or a dict by
    component with a "default"), else float32, diffusers' own default."""
    dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
    if isinstance(dtype, dict):
        dtype = dtype.get(component, dtype.get("default", torch.float32))
    return dtype or torch.float32


def load_stock(pipeline_class: type, path_or_id, *args, **kwargs):
    """diffusers' pipeline_class.from_pretrained; without torchvision, an edit checkpoint's processor is built as
    vl_processor.py says (diffusers' own loading of it needs torchvision)."""
    from transformers.utils import is_torchvision_available

    takes_processor = "processor" in inspect.signature(pipeline_class.__init__).parameters
    if takes_processor and "processor" not in kwargs and not is_torchvision_available():
        from ..vl_processor import load_processor_without_torchvision

        kwargs["processor"] = load_processor_without_torchvision(local_folder(path_or_id, "processor"))
    if type(kwargs.get("transformer")).__name__ not in FAST_TRANSFORMERS:
        return pipeline_class.from_pretrained(path_or_id, *args, **kwargs)
    # a fast checkpoint's transformer, handed to the stock class: its type check would warn that it is not the
    # stock transformer class (the fast class wraps it on purpose)
    type_check = logging.getLogger("diffusers.pipelines.pipeline_utils")
    expected = ExpectedTransformerType()
    type_check.addFilter(expected)
    try:
        return pipeline_class.from_pretrained(path_or_id, *args, **kwargs)
    finally:
        type_check.removeFilter(expected)


class ExpectedTransformerType(logging.Filter):
    """Drops diffusers' "Expected types for transformer" warning (load_stock with the fast transformer)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Expected types for transformer:")


def model_index(path_or_id) -> dict:
    """A checkpoint's model_index.json (a local folder, or a hub id: read from the hub)."""
    from diffusers import DiffusionPipeline

    check_path_or_id(path_or_id)
    return DiffusionPipeline.load_config(str(path_or_id))


def is_fast_checkpoint(path_or_id) -> bool:
    """Whether a pipeline folder (or hub repo) was written by a fast pipeline's save_pretrained: its
    model_index.json names a fast transformer (FAST_TRANSFORMERS)."""
    try:
        index = model_index(path_or_id)
    except OSError:  # not a pipeline folder or repo: diffusers' own loader says so
        return False
    return list(index.get("transformer", [None, None]))[-1] in FAST_TRANSFORMERS


SAVED_CONFIG = "fast_config.json"  # beside model_index.json: FastConfig.saved() of the pipeline that saved it


def saved_config(path_or_id) -> FastConfig:
    """The FastConfig a folder a fast pipeline saved was saved with (SAVED_CONFIG; this machine's parallel and
    memory settings). A folder saved before SAVED_CONFIG was written: its stored build options on the defaults."""
    path = Path(path_or_id)
    if path.is_dir():
        file = path / SAVED_CONFIG
    else:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError

        try:
            file = Path(hf_hub_download(str(path_or_id), SAVED_CONFIG))
        except EntryNotFoundError:
            file = None
    if file is not None and file.exists():
        return FastConfig.from_saved(json.loads(file.read_text()))
    return FastConfig(**saved_options(path_or_id))


def saved_options(path_or_id) -> dict:
    """The build options a folder a fast pipeline saved was saved with: the fast transformer's stored ones (fp8,
    bf16_linears, fp8_fast_accum) and vae_2d_decode (the VAE class it names: FAST_VAES)."""
    saved = json.loads((local_folder(path_or_id, "transformer") / "config.json").read_text())["fast_config"]
    options = {name: saved[name] for name in ("fp8", "bf16_linears", "fp8_fast_accum")}
    vae = list(model_index(path_or_id).get("vae", [None, None]))[-1]
    if vae in FAST_VAES or vae in FAST_VAES.values():
        options["vae_2d_decode"] = vae in FAST_VAES.values()
    return options


class FastLoraPipeline:
    """diffusers' pipeline LoRA methods that look for peft layers, answered by the fast transformer (a fast
    pipeline class mixes this in, after FastPipelineState, before its diffusers class; _fast_transformer() gives the
    fast transformer, or None: the stock one's peft layers answer)."""

    def get_active_adapters(self) -> list[str]:
        fast = self._fast_transformer()
        if fast is None:
            return super().get_active_adapters()
        return list(fast.lora_state.active) if fast.lora_state.configs else []

    def fuse_lora(self, components: list[str] = ["transformer"], lora_scale: float = 1.0, safe_fusing: bool = False,
                  adapter_names: list[str] | None = None, **kwargs):
        fast = self._fast_transformer()
        if fast is None:
            return super().fuse_lora(components=components, lora_scale=lora_scale, safe_fusing=safe_fusing,
                                     adapter_names=adapter_names, **kwargs)
        self._check_lora_components(components)
        turns = getattr(self, "_turns", None)
        if turns is not None and turns.streams("transformer"):
            raise ValueError(f"fuse_lora with FastConfig(max_memory_gib={self.fast_config.max_memory_gib:g}): the "
                             "budget streams some of the transformer's blocks through shared slots, so their weights "
                             "cannot change in place; run the adapters unfused (set_adapters / the adapter weights: "
                             "the same images within FP8's bound), or leave max_memory_gib out")
        fast.fuse_lora(lora_scale, safe_fusing=safe_fusing, adapter_names=adapter_names)
        self._merged_adapters = self._merged_adapters | fast.fused_adapters

    def unfuse_lora(self, components: list[str] = ["transformer"], **kwargs):
        fast = self._fast_transformer()
        if fast is None:
            return super().unfuse_lora(components=components, **kwargs)
        self._check_lora_components(components)
        fast.unfuse_lora()
        self._merged_adapters = self._merged_adapters & fast.fused_adapters

    def _check_lora_components(self, components):
        if not components:
            raise ValueError("`components` cannot be an empty list.")
        for component in components:
            if component not in self._lora_loadable_modules:
                raise ValueError(f"{component} is not found in {self._lora_loadable_modules=}.")

    def set_lora_device(self, adapter_names, device):
        if self._fast_transformer() is None:
            return super().set_lora_device(adapter_names, device)
        raise NotImplementedError("set_lora_device: the fast transformer keeps adapters on its own device; "
                                  "delete_adapters(...) the ones you do not need")


class FastCheckpointPipeline:
    """A fast pipeline's save_pretrained and from_pretrained (mixed in before its diffusers class, `stock_class`):
    a folder qwen_image_fast.from_pretrained loads back as it is, its fast transformer (`fast_transformer_class`)'s
    FP8 weights as stored. FastPipelineState, mixed in before it, gives _fast_transformer() and _build(components,
    config, device)."""

    stock_class: type
    fast_transformer_class: type

    def save_pretrained(self, save_directory, *args, **kwargs):
        """diffusers' save_pretrained (the same arguments: safe_serialization, variant, max_shard_size, ...): a
        folder qwen_image_fast.from_pretrained loads back as it is. Refused before anything is written while the
        fast transformer has LoRA adapters (its own save refuses them, but only after the components saved before
        it were written)."""
        fast = self._fast_transformer()
        if fast is not None and fast.lora_state.configs:
            fast.save_pretrained(save_directory)  # raises, saying what to do
        result = super().save_pretrained(save_directory, *args, **kwargs)
        (Path(save_directory) / SAVED_CONFIG).write_text(json.dumps(self.fast_config.saved(), indent=2) + "\n")
        return result

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, fast_config=None, device=None, **kwargs):
        """The upstream checkpoint layout (hub id or local folder, loaded by diffusers, then converted on `device`:
        e.g. "cuda" from a CPU load keeps one BF16 copy, on the CPU), or a folder a fast pipeline's save_pretrained
        wrote (its FP8 transformer loaded as stored, straight onto `device`; without fast_config, with the options
        it was saved with). dtype / torch_dtype as in diffusers (a dtype or a dict by component); without either,
        float32 for every component, diffusers' own default (transformers >= 5 would load the text encoder in the
        dtype it was saved in, and stock diffusers' first call then fails on mixed dtypes)."""
        check_path_or_id(pretrained_model_name_or_path)
        if "dtype" not in kwargs and "torch_dtype" not in kwargs:
            kwargs["dtype"] = torch.float32
        fast_checkpoint = "transformer" not in kwargs and is_fast_checkpoint(pretrained_model_name_or_path)
        if fast_config is None and fast_checkpoint:  # the options the folder was saved with
            fast_config = saved_config(pretrained_model_name_or_path)
        config = FastConfig.coerce(fast_config)
        fast_state = cls._before_loading(config, pretrained_model_name_or_path, device, kwargs)
        if fast_checkpoint:
            if not config.fused_transformer:
                raise ValueError(f"{pretrained_model_name_or_path} holds the fast transformer (no stock one): "
                                 "fast_config must keep fused_transformer=True")
            kwargs["transformer"] = cls.fast_transformer_class.from_pretrained(
                pretrained_model_name_or_path, subfolder="transformer",
                device="cpu" if config.memory == "low" else device, torch_dtype=load_dtype(kwargs, "transformer"),
                fast_config=config.transformer_config(), variant=kwargs.get("variant"))
            # diffusers' own line for each component it loads (it is handed this one loaded)
            diffusers_pipeline_logger.info(f"Loaded transformer as {cls.fast_transformer_class.__name__} from "
                                           f"`transformer` subfolder of {pretrained_model_name_or_path}.")
        stock = load_stock(cls.stock_class, pretrained_model_name_or_path, *args, **kwargs)
        return cls._build(init_arguments(stock), config, device, **fast_state)

    @classmethod
    def from_pipe(cls, pipeline, fast_config=None, device=None, **kwargs):
        """A fast pipeline sharing `pipeline`'s components (its transformer is left as it is and stays usable; but a
        memory="low" source gives its components to the new pipeline, which places them, and refuses to run after).
        Unlike diffusers' from_pipe, which casts the shared components to float32 unless told otherwise (and so
        changes the source pipeline too), the dtype stays the source transformer's unless dtype is given."""
        config = FastConfig.coerce(fast_config)
        fast_state = cls._before_loading(config, None, device, kwargs)
        if "torch_dtype" not in kwargs:
            kwargs.setdefault("dtype", pipeline.transformer.dtype)
        stock = cls.stock_class.from_pipe(pipeline, **kwargs)
        return cls._build(init_arguments(stock), config, device, **fast_state)

    @classmethod
    def _before_loading(cls, config: FastConfig, path_or_id, device, kwargs: dict) -> dict:
        """Checks that need no weights, made before any is loaded; returns the fast state _set_up takes."""
        return {}


class FastPipelineState:
    """The state every fast pipeline keeps, whatever its family (mixed in before its diffusers class, `stock_class`,
    with its fast transformer's class, `fast_transformer_class`): how it is built from components (_build: diffusers'
    constructor, then the family's _set_up), `fast_config` (build options fixed, call options changeable: the family
    checks the rest in _check_fast_config), what the next call will run (facts() is the family's, the plan the
    registry's), the runner each call runs in (_fast_call: core/runtime/runner.py, whose CUDA graphs live across
    calls) and what the last one ran (`applied`, from the call's record)."""

    stock_class: type
    fast_transformer_class: type
    _fast_config: FastConfig
    runner: Runner
    _last_call: CallRecord | None = None  # what the last call ran (None before the first)
    _last_step_cache = None  # the last call's runtime.step_cache.StepCacheRun (its branches' decisions), or None

    @classmethod
    def _build(cls, components: dict, config: FastConfig, device=None, **fast_state):
        """The fast pipeline around these components (diffusers' constructor of stock_class, then _set_up)."""
        pipe = cls.__new__(cls)
        cls.stock_class.__init__(pipe, **components)
        pipe._set_up(config, device, **fast_state)
        return pipe

    def _set_up(self, config: FastConfig, device, **fast_state):
        """The family's fast components; ends with _new_state(config)."""
        raise NotImplementedError

    def _new_state(self, config: FastConfig):
        self._fast_config = config
        self.runner = Runner()
        self._last_call = None

    @property
    def _image_conditioned(self) -> bool:
        """Whether the pipeline runs diffusers' own loop, refusing the text-to-image-only options."""
        return self.stock_class.__name__ != "QwenImagePipeline"

    @property
    def fast_config(self) -> FastConfig:
        """What was asked for (config.py). Assign a FastConfig to change the call options for the next calls; the
        build options must stay as built."""
        return self._fast_config

    @fast_config.setter
    def fast_config(self, config: FastConfig):
        check_replacement(self._fast_config, config, self.stock_class.__name__, self._image_conditioned)
        self._check_fast_config(config)
        self._fast_config = config

    def _check_fast_config(self, config: FastConfig):
        """ValueError for what the family cannot take in `config` beyond the build options (_set_up checks it too)."""

    def facts(self) -> Facts:
        raise NotImplementedError

    def will_run(self, facts: Facts | None = None) -> dict[str, bool]:
        """Optimization name -> whether the next call runs it (when the call allows: CFG for batched_cfg); facts:
        self.facts() if the caller has them."""
        return {opt.name: bool(plan.values) for opt, plan in plans(self.fast_config, facts or self.facts())}

    @property
    def applied(self) -> list[str]:
        """After a call: what that call ran. Before the first: what the next call will run (those that need
        something of the call, batched_cfg and cfg_fraction: CFG, as in a call with it). optimizations.py."""
        if self._last_call is not None:
            return self._last_call.labels()
        return planned_labels(self.fast_config, self.facts())

    @property
    def blocks_computed(self) -> float | None:
        """After a call: the fraction of its transformer blocks (times batch rows) that ran, 1.0 without a step
        cache; None before the first call, or when no fused transformer forward ran."""
        return None if self._last_call is None else self._last_call.blocks_fraction

    @contextlib.contextmanager
    def _fast_call(self, attention_kwargs: dict | None = None, will_run: dict[str, bool] | None = None,
                   facts: Facts | None = None, **context):
        """The runner of one call (CUDA graphs and batched CFG as the registry plans them: will_run, default
        self.will_run()) and its record, which `applied` reads once the call has returned. facts: self.facts() if the
        caller has them; context: more of the forward context (core/runtime/context.py)."""
        facts = facts if facts is not None else self.facts()
        will_run = will_run or self.will_run(facts)
        conflict = step_cache_conflict(self.fast_config, facts)
        if conflict:
            raise ValueError(conflict)
        record = CallRecord()
        rule = self.transformer.native_step_cache if runs_cache_rule(self.fast_config, facts) else None
        with self.runner.call(self.transformer, record, graphs=will_run["cuda_graphs"],
                              pair_cfg=will_run["batched_cfg"], bucket=self.fast_config.text_bucket,
                              attention_kwargs=attention_kwargs, step_cache=self.fast_config.cache or rule) as run, \
                forward_context(**context):
            yield run
        self._last_call, self._last_step_cache = record, run.step_cache

    def _fast_transformer(self):
        """The fast transformer, or None (a pipeline built without fused_transformer keeps the stock one)."""
        return self.transformer if isinstance(self.transformer, self.fast_transformer_class) else None
