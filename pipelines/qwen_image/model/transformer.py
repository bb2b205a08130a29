"""The fast Qwen-Image transformer: diffusers' `QwenImageTransformer2DModel` (0.42) rebuilt on fused kernels.

Built from a stock model (`FastQwenImageTransformer.from_diffusers`, which leaves it usable beside it) or loaded from
a folder its `save_pretrained` wrote (FP8 weights and scales as stored, nothing requantized). Same `forward`
arguments and output as diffusers; block.py says what one block runs.

Each block computes its own modulation vectors and reads only its own weights inside its forward, so offload hooks
(model CPU offload, group offload at block or leaf level) see every weight before it is used. Linears listed in
FP8_LINEARS run as rowwise FP8 `torch._scaled_mm` (per-token activation x per-channel weight scales, bias in the
epilogue) unless the config keeps them in BF16; the embedders, img_mod/txt_mod, norm_out and proj_out always stay in
the model's dtype and keep diffusers' module names (their state-dict keys equal the stock model's). Nothing in
forward synchronizes with the host, so it can be captured in a CUDA graph.

The model holds its weights, its config and caches derived from them; what a pipeline call decides (LoRA scale,
sequence-parallel group, batched CFG and graphs) reaches it through the forward context (core/runtime/context.py).
"""

import inspect
from dataclasses import dataclass
from math import prod

import torch
import torch.nn as nn
import triton
from diffusers import ConfigMixin, ModelMixin, QwenImageTransformer2DModel
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.normalization import AdaLayerNormContinuous, RMSNorm
from diffusers.models.transformers.transformer_qwenimage import (
    QwenEmbedLayer3DRope,
    QwenEmbedRope,
    QwenTimestepProjEmbeddings,
)

from ....kernels._utils import FP8_DTYPE
from ....kernels.layer_norm_modulate import layer_norm_modulate
from ....kernels.residual_gate import residual_gate_layer_norm_modulate
from ...core.config import FastTransformerConfig, transformer_configs
from ...core.runtime.cfg_pairing import pad_text
from ...core.runtime.context import forward_context, get_context
from ...core.runtime.cuda_graph import read_by_graph
from ...core.runtime.forward_hook import HookedForward
from ...core.runtime.offload import HostArena, has_offload_hooks
from ...core.runtime.parallel import UlyssesPlan
from ...core.model.adapters import LoraAdapters, check_carriable, peft_lora_layers
from ...core.model.attention import TextMask, resolve_backend
from ...core.model.fp8_attention import fp8_attention_kernel
from ...core.model.numerics import clip_float16
from .block import FastBlock, JointInputs, Tail, add_tail
from ...core.model.checkpoint import CheckpointWeights, FastCheckpoint
from ...core.model.lora import BLOCK_SITES, LoraState, lora_scale_of
from .modulation import ModulationLayout, ModulationTable, ModulationTables
from .single_file import QwenImageSingleFile
from .step_caches import StepCaches, past_hooks
from ...core.model.unsupported import Unsupported


# The stock model's constructor arguments and defaults: its config, which ours keeps (plus "fast_config").
STOCK_CONFIG = {name: p.default for name, p in inspect.signature(QwenImageTransformer2DModel.__init__).parameters.items()
                if name != "self"}
MAX_ROTARY = 64  # rotary tables kept per model, one per image shapes and text length (a graph keeps its own)
# The modules of the stock model the fast one takes as they are (from_diffusers shares them).
SHARED_MODULES = ("time_text_embed", "txt_norm", "img_in", "txt_in", "norm_out", "proj_out")


@triton.jit
def _interpreter_probe(X):
    pass


def triton_runs_on(device: torch.device) -> bool:
    """Our Triton kernels run on CUDA, and on the CPU only when Triton's interpreter was on when they were defined
    (TRITON_INTERPRET=1 before triton was first imported), as this module's probe kernel was."""
    from triton.runtime.interpreter import InterpretedFunction

    return device.type == "cuda" or isinstance(_interpreter_probe, InterpretedFunction)


def check_triton_runs_on(device: torch.device):
    """Before converting onto `device` (a CPU build may be meant for offload to a GPU, so only without one) and in
    every forward (the inputs' device): a clear error instead of Triton's "0 active drivers"."""
    if not triton_runs_on(device):
        raise RuntimeError(
            f"the fast transformer's Triton kernels cannot run on {device}: on a CPU they need Triton's interpreter, "
            "turned on by TRITON_INTERPRET=1 before Python starts (before triton or diffusers is imported); or run "
            "on a CUDA GPU, or keep the stock transformer (FastConfig.preset('baseline'))")



class FastQwenImageTransformer(Unsupported, StepCaches, ModulationTable, LoraAdapters, HookedForward,
                               QwenImageSingleFile, ModelMixin, ConfigMixin):
    """Drop-in for diffusers' QwenImageTransformer2DModel: same forward arguments and output, its config (plus
    "fast_config": how the block linears are stored and run), dtype, device, cache_context, and every weight
    registered, so `.to()`, `state_dict()`, `save_pretrained()` and offload hooks see them all.

    A diffusers ModelMixin (not a QwenImageTransformer2DModel subclass): pipelines, offload hooks and
    save/load treat it as a model, while nothing of the stock model's block structure is inherited that it does
    not have. LoRA through diffusers' API (adapters.py). Stock methods it cannot honour (attention processors, step
    caches, gradient checkpointing: unsupported.py) raise NotImplementedError saying what to do instead.
    `.to(dtype)` casts everything except the FP8 weights and their scales.
    """

    config_name = "config.json"
    lora_sites, block_class, stock_model_name = BLOCK_SITES, FastBlock, "QwenImageTransformer2DModel"  # adapters.py
    stock_config_fields = STOCK_CONFIG  # single_file.py
    _no_split_modules = ["FastBlock"]
    _supports_gradient_checkpointing = False
    _supports_group_offloading = True

    def __init__(self, fast_config: FastTransformerConfig | dict | None = None, **config):
        """The structure, with uninitialized weights (build under torch.device("meta") to allocate nothing; use
        from_diffusers / from_pretrained for a working model). config: QwenImageTransformer2DModel's arguments."""
        super().__init__()
        config, fast_config = transformer_configs(config, STOCK_CONFIG, self.stock_model_name, fast_config)
        self.register_to_config(**config, fast_config=fast_config.to_dict())
        self.fast_config = fast_config
        heads, head_dim = config["num_attention_heads"], config["attention_head_dim"]
        inner = heads * head_dim
        self.pos_embed = self._pos_embed(config)
        self.time_text_embed = QwenTimestepProjEmbeddings(inner, use_additional_t_cond=config["use_additional_t_cond"])
        self.txt_norm = RMSNorm(config["joint_attention_dim"], eps=1e-6)
        self.img_in = nn.Linear(config["in_channels"], inner)
        self.txt_in = nn.Linear(config["joint_attention_dim"], inner)
        self.transformer_blocks = nn.ModuleList(FastBlock(inner, heads, head_dim, fast_config)
                                                for _ in range(config["num_layers"]))
        self.norm_out = AdaLayerNormContinuous(inner, inner, elementwise_affine=False, eps=1e-6)
        out_channels = config["out_channels"] or config["in_channels"]
        self.proj_out = nn.Linear(inner, config["patch_size"] ** 2 * out_channels)
        self.zero_cond_t = config["zero_cond_t"]
        self.requires_grad_(False)
        self._mod_rows: dict = {}  # zero_cond_t: each image token's modulation row, per shape
        self._rotary: dict = {}  # pos_embed's tables per shape (_rotary_tables)
        self.modulation_tables = ModulationTables()
        self.lora_state = LoraState()
        self.weight_source: CheckpointWeights | None = None  # the BF16 masters of the FP8 weights (fuse_lora)
        self.single_file = None  # from_single_file: what it kept, dequantized, requantized (core/single_file/)
        self.block_arena: HostArena | None = None  # memory="low": the blocks' weights (core/runtime/memory.py)

    @staticmethod
    def _pos_embed(config: dict) -> nn.Module:
        """The rotary tables (plain CPU tensors, no parameters; cached per device on use). Built on the CPU even under a
        meta-device context: they are computed, not loaded."""
        rope = QwenEmbedLayer3DRope if config["use_layer3d_rope"] else QwenEmbedRope
        with torch.device("cpu"):
            return rope(theta=10000, axes_dim=list(config["axes_dims_rope"]), scale_rope=True)

    # ---- building and loading

    @classmethod
    @torch.no_grad()
    def from_diffusers(cls, stock, config: FastTransformerConfig | None = None, device=None, modulation_device=None):
        """stock: a diffusers QwenImageTransformer2DModel (any device; left unchanged except that the modules shared
        with this model (embedders, img_mod/txt_mod, norm_out, proj_out) move to `device`, img_mod / txt_mod to
        `modulation_device` if given: "cpu" keeps their 12.7 GiB off the GPU, for tables built from the host).
        Block by block, so at most one block's BF16 linears sit on the device beside the converted ones."""
        if not isinstance(stock, QwenImageTransformer2DModel):
            raise TypeError(f"from_diffusers takes a diffusers QwenImageTransformer2DModel, got {type(stock).__name__}")
        peft_layers = peft_lora_layers(stock)
        check_carriable(stock, peft_layers)
        config = FastTransformerConfig.of(config or FastTransformerConfig())
        device = torch.device(device) if device is not None else stock.device
        if not torch.cuda.is_available():
            check_triton_runs_on(device)
        if config.attention != "auto":
            resolve_backend(config.attention, device, stock.dtype)  # a clear error before any conversion
        fp8_attention_kernel(config.fp8_attention, device, stock.dtype)  # the same for a named FP8 kernel
        stock_config = {name: stock.config[name] for name in STOCK_CONFIG if name in stock.config}
        with torch.device("meta"):
            fast = cls(config, **stock_config)
        fast.pos_embed = stock.pos_embed
        for name in SHARED_MODULES:
            setattr(fast, name, getattr(stock, name).to(device))
        for i, block in enumerate(stock.transformer_blocks):
            fast.transformer_blocks[i] = FastBlock.from_stock(block, config, device, modulation_device or device)
        if peft_layers:
            fast._carry_lora(stock, peft_layers)
        fast.weight_source = CheckpointWeights.of(stock)
        return fast.requires_grad_(False).eval()

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, subfolder: str | None = None, *, device=None,
                        torch_dtype: torch.dtype | None = None, fast_config: FastTransformerConfig | None = None,
                        variant: str | None = None, **unsupported):
        """Load what save_pretrained wrote (a local folder or a hub repo; `variant` as diffusers names it): weights
        as stored (FP8 ones with their scales, not requantized), straight onto `device` (default: the CPU).
        torch_dtype casts all but the FP8 tensors. fast_config: how to run it (fp8 and bf16_linears must match the
        checkpoint; fp8_fast_accum and attention may differ); None: as saved, attention "auto"."""
        checkpoint = FastCheckpoint(cls, pretrained_model_name_or_path, subfolder, unsupported)
        run = checkpoint.run_config(fast_config)
        device = torch.device(device or "cpu")
        if not torch.cuda.is_available():
            check_triton_runs_on(device)
        model = cls.meta_model(run, checkpoint.stock_config(STOCK_CONFIG))
        checkpoint.load_into(model, device, variant, torch_dtype)
        if run.attention != "auto":
            resolve_backend(run.attention, device, model.dtype)
        return model.requires_grad_(False).eval()

    @classmethod
    def check_load(cls, run: FastTransformerConfig, device: torch.device, dtype: torch.dtype):
        if not torch.cuda.is_available():
            check_triton_runs_on(device)  # a CPU without Triton's interpreter: says how to fix it
        super().check_load(run, device, dtype)

    @classmethod
    def meta_model(cls, run: FastTransformerConfig, stock_config: dict) -> "FastQwenImageTransformer":
        """The structure on the meta device, its rotary tables computed (from_pretrained, from_single_file)."""
        with torch.device("meta"):
            model = cls(run, **stock_config)
        model.pos_embed = cls._pos_embed({**STOCK_CONFIG, **stock_config})
        return model

    # ---- what pipelines and users touch on a diffusers model

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (that of every weight except the FP8 ones and their fp32 scales)."""
        return self.img_in.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.img_in.weight.device

    @property
    def attention_backend(self) -> str:
        """The attention that runs on the model's current device and dtype."""
        return resolve_backend(self.fast_config.attention, self.device, self.dtype)

    @property
    def fp8_attention(self) -> tuple[str | None, str | None]:
        """(the FP8 attention kernel that runs on the model's current device and dtype, None) or (None, why not)."""
        return fp8_attention_kernel(self.fast_config.fp8_attention, self.device, self.dtype)

    def fp8_attention_in(self, ulysses) -> str | None:
        """The FP8 attention kernel a forward runs: none under Ulysses (what "auto" falls back to there; FastConfig
        refuses a named kernel with it)."""
        return None if ulysses is not None else self.fp8_attention[0]

    def running(self) -> list[tuple[str, object]]:
        """What a forward runs, as core/optimizations.py names it (recorded in a call's CallRecord)."""
        fp8 = bool(self.fast_config.fp8_linears)
        kernel = self.fp8_attention_in(get_context().ulysses)
        return ([("fused_transformer", True)] + ([("fp8", True)] if fp8 else [])
                + ([("fp8_fast_accum", True)] if fp8 and self.fast_config.fp8_fast_accum else [])
                + [("attention", self.attention_backend)] + ([("fp8_attention", kernel)] if kernel else [])
                + list(self.single_file.applied if self.single_file else ()))

    def _check_weights_on(self, device: torch.device, modulation: bool, take_turns: bool):
        """The block linears, and for a forward without a table the modulation weights, must be where the forward
        runs. take_turns: memory="low" (the forward context says so) keeps them on the host between turns; outside
        such a call, a transformer with offload hooks is not checked (its hooks bring the weights in as it runs)."""
        blocks = self.transformer_blocks[0].img_qkv.bias.device
        mods = self.transformer_blocks[0].img_mod[1].weight.device if modulation else device
        if (blocks == device and mods == device) or (not take_turns and has_offload_hooks(self)):
            return
        if blocks != device:
            raise RuntimeError(
                f"the transformer's block linears are on {blocks} and the forward on {device}: with "
                "FastConfig(memory='low') they take turns with the text encoder on the GPU, and "
                "QwenImageFastPipeline brings them in before its loop; call the pipeline, not the transformer "
                "(otherwise move the transformer with .to(device))")
        raise RuntimeError(
            f"the modulation weights (img_mod / txt_mod) are on {mods} and the forward on {device} "
            "(FastConfig(memory='low') keeps them on the host): pass this step's row of "
            "transformer.modulation_table(...) as modulation=, which QwenImageFastPipeline does, or move the "
            "transformer with .to(device)")

    def _mod_row(self, img_shapes, batch: int, device, plan: UlyssesPlan | None = None) -> torch.Tensor:
        """zero_cond_t: the modulation row of each image token, b (its sample, timestep t) for the first image's
        tokens and b + B (timestep 0) for condition images. int32 [B * L_img] (under Ulysses this rank's image
        tokens only), cached per shape."""
        img = plan.img if plan else slice(None)
        key = (str(img_shapes), batch, str(device), img.start, img.stop)
        if key not in self._mod_rows:
            index = torch.tensor(
                [[0] * prod(sample[0]) + [1] * sum(prod(s) for s in sample[1:]) for sample in img_shapes],
                dtype=torch.int32,
            )
            rows = torch.arange(batch, dtype=torch.int32)[:, None] + batch * index
            self._mod_rows[key] = rows[:, img].flatten().to(device)
        return self._mod_rows[key]

    def _rotary_tables(self, img_shapes, txt_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """pos_embed's (image, text) rotary tables for these shapes, kept here (at most MAX_ROTARY shapes, the oldest
        dropped): diffusers' QwenEmbedRope caches its image tables in an lru_cache shared by every model, whose
        entries a long-running process evicts while a CUDA graph may still read them (a graph keeps what it read:
        cuda_graph.read_by_graph)."""
        key = (repr(img_shapes), txt_len, str(device))
        if key not in self._rotary:
            if len(self._rotary) >= MAX_ROTARY:
                del self._rotary[next(iter(self._rotary))]
            self._rotary[key] = self.pos_embed(img_shapes, max_txt_seq_len=txt_len, device=device)
        return self._rotary[key]

    # ---- the modulation table (modulation.py)

    @torch.no_grad()
    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor = None,
        encoder_hidden_states_mask: torch.Tensor = None,
        timestep: torch.LongTensor = None,
        img_shapes=None,
        guidance: torch.Tensor = None,
        attention_kwargs=None,
        controlnet_block_samples=None,
        additional_t_cond=None,
        return_dict: bool = True,
        modulation: torch.Tensor | None = None,
    ):
        """diffusers' forward. modulation (not a diffusers argument): this step's row of modulation_table(...)
        built for the same timestep, guidance, additional_t_cond and attention_kwargs scale; then the timestep
        embedding and the modulation linears are not run (their weights are not read). Inside a fast pipeline's
        call the forward goes through its runner's hook (core/runtime/forward_hook.py, runner.py: batched CFG, CUDA
        graphs)."""
        scale = lora_scale_of(attention_kwargs, "Qwen-Image")
        inputs = dict(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                      encoder_hidden_states_mask=encoder_hidden_states_mask, timestep=timestep, img_shapes=img_shapes,
                      guidance=guidance, controlnet_block_samples=controlnet_block_samples,
                      additional_t_cond=additional_t_cond, modulation=modulation)
        with forward_context(lora_scale=scale):
            hook = self.fast_forward_hook
            output = hook.new_forward(inputs) if hook is not None else self.compute(**inputs)
        return Transformer2DModelOutput(sample=output) if return_dict else (output,)

    def compute(self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, timestep, img_shapes,
                guidance, controlnet_block_samples, additional_t_cond, modulation=None) -> torch.Tensor:
        """One forward on the kernels: [B, L_img, p*p*C]. The LoRA scale, and under FastConfig(parallel="ulysses")
        the sequence-parallel group, come from the forward context."""
        state = self.begin(hidden_states, encoder_hidden_states, encoder_hidden_states_mask, timestep, img_shapes,
                           guidance, controlnet_block_samples, additional_t_cond, modulation)
        self.run_blocks(state, 0, len(self.transformer_blocks))
        return self.finish(state)

    # The pieces a step cache runs (core/runtime/step_cache.py), each a function of forward's inputs and tensors, so
    # that the runner can capture each in a CUDA graph. Each begins the forward anew to have what the blocks share
    # (rotary tables, mask, timestep embedding); middle and back take the streams as they are, without the embedders.

    def front(self, stop: int, **inputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Blocks [0, stop): (img, txt, the image residual over them)."""
        state = self.begin(**inputs)
        embedded = state.img
        self.run_blocks(state, 0, stop)
        state.settle()
        return state.img, state.txt, state.img - embedded

    def middle(self, img: torch.Tensor, txt: torch.Tensor, start: int, stop: int, **inputs):
        """Blocks [start, stop) on the streams (img, txt): the streams after them."""
        state = self.begin(**inputs, streams=(img, txt))
        self.run_blocks(state, start, stop)
        state.settle()
        return state.img, state.txt

    def back(self, img: torch.Tensor, txt: torch.Tensor, start: int, **inputs) -> torch.Tensor:
        """Blocks [start, N) on the streams (img, txt), then norm_out and proj_out: the forward's output."""
        state = self.begin(**inputs, streams=(img, txt))
        self.run_blocks(state, start, len(self.transformer_blocks))
        return self.finish(state)

    def begin(self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, timestep, img_shapes,
              guidance, controlnet_block_samples, additional_t_cond, modulation=None,
              streams: tuple[torch.Tensor, torch.Tensor] | None = None) -> "ForwardState":
        """A forward up to the first block: the embedded streams and what every block shares. streams: (img, txt) of a
        forward past its first blocks (a step cache's piece), taken instead of embedding the inputs again."""
        device = hidden_states.device
        check_triton_runs_on(device)
        batch, img_len, _ = hidden_states.shape
        context = get_context()
        ulysses, plan = context.ulysses, None
        if ulysses is not None and encoder_hidden_states.shape[1] < ulysses.degree:  # every rank holds text
            encoder_hidden_states, encoder_hidden_states_mask = pad_text(
                encoder_hidden_states, encoder_hidden_states_mask, ulysses.degree)
        txt_len = encoder_hidden_states.shape[1]  # the whole text (RoPE positions, mask)
        if ulysses is not None:  # this rank's rows only once embedded (core/runtime/parallel.py)
            plan = ulysses.plan(img_len, txt_len, device)
            if controlnet_block_samples is not None:
                controlnet_block_samples = [sample[:, plan.img] for sample in controlnet_block_samples]
        if streams is not None:  # a step cache's piece: this rank's rows already
            hidden_states, encoder_hidden_states = streams
        else:
            # under Ulysses on every rank's whole rows too, then cut: these BF16 GEMMs' rows round as one GPU's only
            # at one GPU's row count (cuBLAS picks its kernel by M; a text's half rows took another one)
            hidden_states = self.img_in(hidden_states)  # [B, L_img, D]
            encoder_hidden_states = self.txt_in(self.txt_norm(encoder_hidden_states))  # [B, L_txt, D]
            if plan is not None:  # the kernels take contiguous rows
                hidden_states = hidden_states[:, plan.img].contiguous()
                encoder_hidden_states = encoder_hidden_states[:, plan.txt].contiguous()
        mod_row = self._mod_row(img_shapes, batch, device, plan) if self.zero_cond_t else None

        layout = self.modulation_layout(batch)
        self._check_weights_on(device, modulation=modulation is None, take_turns=context.weights_take_turns)
        if modulation is None:
            silu_temb, silu_temb_t = self.time_embedding(timestep, guidance, additional_t_cond, hidden_states.dtype)
        elif modulation.shape != (layout.size,) or modulation.dtype != hidden_states.dtype:
            raise ValueError(f"modulation {tuple(modulation.shape)} {modulation.dtype}: a forward of batch {batch} "
                             f"takes a row of modulation_table(...) ({layout.size},) {hidden_states.dtype}")
        else:
            silu_temb = silu_temb_t = None
        img_freqs, txt_freqs = self._rotary_tables(img_shapes, txt_len, device)
        read_by_graph(img_freqs, txt_freqs, mod_row, *(plan.tensors() if plan else ()))  # made before, kept by caches
        if plan:
            img_freqs, txt_freqs = img_freqs[plan.img], txt_freqs[plan.txt]
        block0 = self.transformer_blocks[0]
        rows = plan.local_len if plan else img_len + txt_len
        mask = None if encoder_hidden_states_mask is None else TextMask(encoder_hidden_states_mask, img_len)
        fp8_kernel, fp8_buffers = self.fp8_attention_in(ulysses), {}
        if fp8_kernel:  # q, k (and v) in FP8 buffers; every key valid when no mask pads the text
            fp8_buffers = dict(fp8_attention=fp8_kernel, qkv8=torch.empty(
                3, batch, rows, block0.heads, block0.head_dim, dtype=FP8_DTYPE, device=device),
                valid_keys=mask.seqused_k if mask is not None else torch.full(
                    (batch,), rows, dtype=torch.int32, device=device))
        joint = JointInputs(
            mask=mask, img_freqs=torch.view_as_real(img_freqs), txt_freqs=torch.view_as_real(txt_freqs),
            silu_temb=silu_temb, silu_temb_t=silu_temb_t,
            mod_row=mod_row, backend=resolve_backend(self.fast_config.attention, device, hidden_states.dtype),
            qkv=hidden_states.new_empty(3, batch, rows, block0.heads, block0.head_dim), ulysses=ulysses, plan=plan,
            **fp8_buffers,
        )
        if context.block_graphs is not None:  # blocks replaying from graphs read what they share from its buffers
            joint = joint.on_buffers(context.block_graphs)
        return ForwardState(hidden_states, encoder_hidden_states, None, None, joint, layout, modulation,
                            controlnet_block_samples)

    def run_blocks(self, state: "ForwardState", start: int, stop: int):
        """Blocks start .. stop - 1 on `state`. Fused, each block leaves its last residual adds to the next one's
        first kernel; with a diffusers step cache enabled (enable_cache) each is called as diffusers calls its
        blocks (stock output, every residual added), so that the cache's hooks see what they see on the stock
        model."""
        n_blocks, samples = len(self.transformer_blocks), state.controlnet_block_samples
        context = get_context()
        past = self.is_cache_enabled and context.past_hooks  # a native rule runs the cache (step_caches.py)
        hooked = self.is_cache_enabled and not past
        attention_cache = context.attention_cache  # a TaylorSeer step's (core/runtime/taylorseer.py)
        streaming = self.block_arena.stream if self.block_arena is not None else None  # a memory budget's
        if streaming is not None:
            streaming.begin(start, stop)
        for i in range(start, stop):
            block = self.transformer_blocks[i]
            if streaming is not None:
                streaming.before(i)
            mods = None if state.modulation is None else state.layout.block(state.modulation, i)
            if hooked:
                state.settle()
                state.txt, state.img = block(hidden_states=state.img, encoder_hidden_states=state.txt,
                                             joint=state.joint, mods=mods)
            else:
                state.txt, state.img, state.txt_tail, state.img_tail = (past_hooks(block) if past else block)(
                    state.img, state.txt, state.joint, mods, (state.img_tail, state.txt_tail), i < n_blocks - 1,
                    defer=True, attention_cache=None if attention_cache is None else attention_cache[i])
                if state.img.dtype == torch.float16:  # the block's outputs as diffusers' (clipped): settled here
                    state.settle()
                    state.img, state.txt = clip_float16(state.img), clip_float16(state.txt)
            if samples is not None:  # added after the block's residual, as diffusers does
                state.img = add_tail(state.img, state.img_tail, state.joint.mod_row) + samples[
                    i // -(-n_blocks // len(samples))]
                state.img_tail = None
        if streaming is not None:
            streaming.end()

    def finish(self, state: "ForwardState") -> torch.Tensor:
        """norm_out and proj_out after the last block: [B, L_img, p*p*C]."""
        joint, modulation = state.joint, state.modulation
        mod_row, img, img_tail = joint.mod_row, state.img, state.img_tail
        out_mod = self.norm_out.linear(joint.silu_temb_t) if modulation is None else state.layout.out(modulation)
        out_scale, out_shift = out_mod.chunk(2, dim=1)  # [B, D] each
        if img_tail is not None and mod_row is None:  # last residual fused with norm_out's LayerNorm + modulation
            img, img_x = residual_gate_layer_norm_modulate(img, img_tail.out, img_tail.gate, out_shift, out_scale)
        else:  # norm_out modulates per sample, a zero_cond_t gate per token
            img_x = layer_norm_modulate(add_tail(img, img_tail, mod_row), out_shift, out_scale)
        if joint.plan is not None:  # proj_out on all image rows, as img_in: one GPU's row count, one GPU's rounding
            img_x = joint.ulysses.gather_image(img_x, joint.plan)
        return self.proj_out(img_x)  # [B, L_img, p*p*C]


@dataclass
class ForwardState:
    """A forward between blocks: the residual streams (img [B, L_img, D], txt [B, L_txt, D]) with the tails the last
    block left to add (block.py), and what the blocks share."""

    img: torch.Tensor
    txt: torch.Tensor
    img_tail: Tail | None
    txt_tail: Tail | None
    joint: JointInputs
    layout: ModulationLayout
    modulation: torch.Tensor | None
    controlnet_block_samples: list | None

    def settle(self):
        """Add the pending tails: img and txt are then the streams as diffusers has them after the last block."""
        self.img = add_tail(self.img, self.img_tail, self.joint.mod_row)
        self.txt = add_tail(self.txt, self.txt_tail, None)
        self.img_tail = self.txt_tail = None
