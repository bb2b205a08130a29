"""Qwen-Image-2.1's transformer (diffusers' QwenImage21Transformer2DModel: 32 single-stream blocks of 32 heads x 128,
SwiGLU ratio 3, one shared modulation projection) on the kernels the 2512 DiT and the Qwen3.5 text path use.

A block, on the token rows x [B, N, D] (N: the joint sequence in a prefill, the target image's tokens under the
prefix cache), g a token's modulation row:
    h = layer_norm(x) * (1 + scale1[g])              -> FP8 rows     (layer_norm_modulate, shift 0)
    q, k, v = rms_norm + rope of h @ W_qkv                           (one GEMM; qkv_pack writes the attention buffers)
    x = x + tanh(gate1[g]) * (attention(q, k, v) @ W_out)
    h = layer_norm(x) * (1 + scale2[g])                              (fused with the residual: residual_gate_...)
    x = x + tanh(gate2[g]) * (silu(h @ W_gate) * (h @ W_up)) @ W_down   (one GEMM of [W_gate; W_up]; silu_mul_fp8)
the last residual left to the next block's first kernel. g is the token's sample, or with causal_condition the
t = 0 row for the prefix's tokens (diffusers' _select_modulation_rows), the kernels' mod_row. The modulation is
computed once a forward for all blocks (diffusers' shared projection); tanh of the gates once per row.

Attention. The joint sequence is [prefix (text with condition-image blocks, right-padded), target image]. It is
block-causal: causal over text, bidirectional inside each image block, the target sees everything. Keys and values
sit per sample as [target, prefix]: a prompt's padding is then at the end, the valid keys a prefix of T + P_valid
(FlashAttention-4's seqused_k), and non-causal attention does not depend on key order (RoPE is per token). The
target's queries attend to all of them; a prefill's prefix queries go segment by segment with diffusers'
QwenImage21AttnProcessor's masks (SDPA; once a call with the prefix cache). With the prefix cache (kv_cache_mode
"extract", then "cached": the pipeline's default) the prefix's keys and values stay in this model's buffers
(PrefixCache), each block's [target, prefix] buffer written once for the prefix and every step for the target.

A forward's layout (the joint sequence's image slots and blocks, rotary tables, the keys' padding, the prefix's
segments) depends on img_shapes, img_mask and the text mask only, which the pipeline passes unchanged at every
step: it is built once (host work and syncs) and kept (Layout). In a pipeline call whose plan has CUDA graphs, a
cached step (the target's tokens, from its latents and timestep to the output) replays from a graph of the
pipeline's runner (core/runtime/runner.py; the forward context's step_graphs) captured at its second use, keyed by
the layout's content, the cache slot and the shapes.

Under a step cache (FastConfig(cache=DBCache(...)): the runner's StepCacheRun, core/runtime/step_cache.py, in the
forward context) a forward runs in three pieces, front (blocks [0, Fn)), middle and back (the last Bn and the
output), each cached step's a graph of its own; each cache_context ("cond", "uncond") is a branch deciding from the
residual r over the front blocks of the target's rows. The prefill always runs the middle (its prefix keys and values
fill every block's buffer) and keeps its target's rows' residuals; a cached step that skips the middle adds them to
the front's output instead. A skipped block's buffers are not touched: the prefix part is written by the prefill
only, the target part by every step that runs the block, before its attention reads it.

Under batched CFG (the runner's call puts the model's own speculation, cfg_speculation(), in the forward context)
diffusers' "cond" call of a cached step computes the "uncond" branch beside it, as one step of batch 2B
(_forward_pair: the two target row sets through one GEMM each, each half attending to its own branch's prefix
cache at its own rotary positions, block.PairedAttention), and the step's "uncond" call gets its half
(core/runtime/cfg_pairing.py says when). The prefill runs one branch at a time.

Under diffusers' TaylorSeerCacheConfig (enable_cache) its own hooks sit on each block's `attn` (block.AttentionPart)
and compute or predict that block's attention output, one state per cache_context; such a forward runs eagerly. Under
a memory budget (memory.py) the streamed blocks' weights are copied in ahead of them inside the forward, and the
prefix caches are released before each call's decode.
"""

import contextlib
import functools
import inspect
import itertools
import math
import weakref

import torch
import torch.nn as nn
from diffusers.configuration_utils import ConfigMixin
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.modeling_utils import ModelMixin
from diffusers.hooks import TaylorSeerCacheConfig
from diffusers.hooks._helpers import TransformerBlockRegistry
from diffusers.models.cache_utils import CacheMixin
from diffusers.models.transformers.transformer_qwenimage21 import (
    QwenImage21Rope,
    QwenImage21Transformer2DModel,
    QwenImage21TransformerBlock,
    _qwenimage21_prefix_segments,
)

from ...kernels._utils import FP8_DTYPE
from ...kernels.layer_norm_modulate import layer_norm_modulate
from ...kernels.residual_gate import residual_gate, residual_gate_layer_norm_modulate
from ..core.config import FastTransformerConfig, transformer_configs
from ..core.model.adapters import LoraAdapters, check_carriable, peft_lora_layers
from ..core.model.attention import resolve_backend
from ..core.model.fp8_attention import LSE_KERNELS, fp8_attention_kernel
from ..core.model.numerics import clip_float16
from ..core.model.checkpoint import FastCheckpoint
from ..core.model.lora import LoraState, lora_scale_of
from ..core.model.unsupported import Unsupported, refuse
from ..core.runtime.context import count_blocks, forward_context, get_context, record
from ..core.runtime.cuda_graph import read_by_graph, signature
from ..core.runtime.cfg_pairing import Speculation
from .block import Attention, FastBlock21, Fp8Prefix, PairedAttention, Rows
from .single_file import QwenImage21SingleFile
from .single_file import layout as family_layout

STOCK_CONFIG = {name: p.default for name, p in
                inspect.signature(QwenImage21Transformer2DModel.__init__).parameters.items() if name != "self"}
# The modules of the stock model the fast one takes as they are (from_diffusers shares them).
SHARED_MODULES = ("pos_embed", "time_text_embed", "txt_in", "img_in", "modulation", "norm_out", "proj_out")
# The block linears (FP8 with fp8=True): Q/K/V fused, the output projection, SwiGLU's [gate; up] fused, the down one.
# A LoRA's stock block module -> (the fast linear, which part of its rows; None: all) (core/model/lora.py)
LORA_SITES = {"attn.to_q": ("qkv", 0), "attn.to_k": ("qkv", 1), "attn.to_v": ("qkv", 2), "attn.to_out.0": ("out", None),
              "img_mlp.gate_layer": ("gate_up", 0), "img_mlp.proj": ("gate_up", 1), "img_mlp.out": ("down", None)}
IMG_TOKENS_PER_SLOT = 4  # a vision-language image slot stands for 2 x 2 latent tokens (diffusers' constant)
# diffusers' step caches whose hooks look the block class up in its TransformerBlockRegistry, which has no
# QwenImage21TransformerBlock in 0.42.1: stock's enable_cache refuses them with the registry's ValueError
REGISTRY_CACHES = ("FirstBlockCacheConfig", "MagCacheConfig", "SeaCacheConfig")
MAX_LAYOUTS = 16  # kept layouts: past this, all are dropped (a graph keeps the tensors it reads: read_by_graph)
RECENT_LAYOUTS = 4  # the masks last passed (a prompt's and a negative prompt's, in turn), found without a host sync
# a cached step's own inputs under batched CFG (the rest, the latents and the timestep, the branches share)
BRANCH_INPUTS = ("encoder_hidden_states", "encoder_hidden_states_mask", "img_mask", "kv_cache")
STEP_KINDS = ("cached_step", "cached_pair")  # the graphs of cached steps: keyed by the prefix slots they read


class Layout:
    """A forward's layout, as diffusers' forward derives it from img_shapes, img_mask and the text mask: the joint
    sequence's image slots (repeats, image_pad_mask), `target` and `prefix` token counts, the rotary tables freqs
    [S, D_head / 2, 2] in the joint order, each token's modulation row (mod_row, causal_condition), the prefix's
    key validity [B, P] (None: no text mask), the keys' count and mask in the [target, prefix] order, and the
    prefix's segments."""

    def __init__(self, model, img_shapes, img_mask, text_mask, batch: int, device, key: tuple):
        self.key = key  # Layout.key: what it is a function of
        repeats = torch.where(img_mask, IMG_TOKENS_PER_SLOT, 1)[0]
        self.repeats, self.image_pad_mask = repeats, torch.repeat_interleave(img_mask[0], repeats)
        self.target = math.prod(img_shapes[0][-1])
        self.prefix = self.image_pad_mask.shape[0] - self.target
        image_ids, target_token_mask = QwenImage21Transformer2DModel.build_token_metadata(self.image_pad_mask,
                                                                                          img_shapes[0])
        rotary = model.pos_embed(img_shapes[0], self.image_pad_mask, device=device)  # complex [S, D_head / 2]
        self.freqs = torch.view_as_real(rotary).float().contiguous()
        self.mod_row = None
        if model.config.causal_condition:  # the target's tokens read their sample's row, the others the t = 0 row
            self.mod_row = torch.where(target_token_mask[None, :], torch.arange(batch, device=device)[:, None],
                                       batch).flatten().to(torch.int32)
        key_valid = torch.ones(batch, self.prefix, dtype=torch.bool, device=device)  # the prefix's, in its order
        if text_mask is not None:
            text_positions = (~self.image_pad_mask[: self.prefix]).nonzero(as_tuple=True)[0]
            vlm_text_positions = ~img_mask[0][: text_mask.shape[1]]
            key_valid[:, text_positions] = text_mask.bool()[:, vlm_text_positions]
        self.key_valid = key_valid if text_mask is not None else None
        valid = key_valid.sum(dim=1)
        if not torch.equal(key_valid, torch.arange(self.prefix, device=device)[None, :] < valid[:, None]):
            raise ValueError("encoder_hidden_states_mask must mark each prompt's padding at its end (right padding, "
                             "as QwenImage21Pipeline builds it): the fast attention counts the valid keys")
        self.seqused_k = (self.target + valid).to(torch.int32)
        self.prefix_valid = valid.to(torch.int32) if text_mask is not None else None  # [B], FP8 attention's
        self.key_mask = torch.cat([key_valid.new_ones(batch, self.target), key_valid], dim=1)[:, None, None, :]
        self.segments = _qwenimage21_prefix_segments(image_ids, self.prefix)

    def step_attention(self, backend: str, fp8: str | None) -> Attention:
        """A cached step's attention plan: the target's queries against its own keys and the prefix cache's."""
        return Attention(backend, self.seqused_k, self.key_mask, fp8=fp8, prefix_valid=self.prefix_valid)

    def step_tables(self) -> tuple:
        """The tables and masks a cached step reads beside its inputs (a graph of it keeps them: read_by_graph)."""
        return (self.freqs, self.seqused_k, self.key_mask) + (() if self.prefix_valid is None else (self.prefix_valid,))

    @staticmethod
    def key(img_shapes, img_mask, text_mask, batch: int, device) -> tuple:
        """What a layout is a function of, by content (one small device-to-host copy)."""
        masks = [img_mask[0]] + ([] if text_mask is None else [text_mask.bool().flatten()])
        host = torch.cat([m.to(torch.bool) for m in masks]).cpu().numpy().tobytes()
        return repr(img_shapes[0]), batch, str(device), text_mask is None, host


class PrefixCache:
    """Per pipeline cache (diffusers' QwenImage21KVCache objects are the handles): each block's key and value
    buffers [B, T + P, H, D], kept by the model across calls while their shape holds (CUDA graphs need fixed
    addresses; under a memory budget they go back before each call's decode instead: release). A handle is bound to
    a slot at its "extract" step; a slot of that shape whose handle is gone is reused; a new slot frees those whose
    handles are gone first (another size's). Each slot has a serial number,
    never reused: a graph keyed by it cannot be taken for one reading another slot's buffers; `freed` holds the
    serials of freed slots until the graphs that read them are dropped (stale_graphs)."""

    def __init__(self):
        self.slots: dict[tuple, list] = {}  # key -> [owner weakref, [(k, v)] per block, serial]
        self.serials = itertools.count()
        self.freed: set[int] = set()

    def bind(self, handle, name: str, shape: tuple, dtype, device, n_blocks: int, fp8: bool = False) -> list:
        """The buffers of the slot bound to `handle` (a new slot frees those whose handles are gone first): per block
        (key, value) [B, T + P, H, D] = shape, or under FP8 attention (fp8) an Fp8Prefix of shape [B, P, H, D]."""
        for n in range(len(self.slots) + 1):
            key = (name, n, shape, dtype if not fp8 else "fp8", str(device))
            slot = self.slots.get(key)
            if slot is None or slot[0]() is None or slot[0]() is handle:
                break
        if slot is None:
            for k in [k for k, (owner, _, _) in self.slots.items() if owner() is None]:
                self.freed.add(self.slots.pop(k)[2])
            buffers = [Fp8Prefix(shape, device) if fp8 else
                       (torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))
                       for _ in range(n_blocks)]
            slot = self.slots[key] = [None, buffers, next(self.serials)]
        slot[0] = weakref.ref(handle)
        handle.fast_prefix_slot = key
        return slot[1]

    def release(self, graphs=None):
        """Every slot's buffers go back (a memory budget's VAE decode needs their room), and the graphs of `graphs`
        (a CallGraphs) that read them are dropped, which hold them too; the next extract step allocates anew."""
        for slot in self.slots.values():
            self.freed.add(slot[2])
        self.slots.clear()
        if graphs is not None:
            self.stale_graphs(graphs)
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()  # their segments, and the steps' cached ones, back whole: the decode's are larger

    def serial(self, handle) -> int:
        return self.slots[handle.fast_prefix_slot][2]

    def stale_graphs(self, graphs):
        """Drops the graphs (a CallGraphs) that read the buffers of freed slots."""
        if self.freed:
            graphs.drop(lambda key: key[2][0] in STEP_KINDS and not self.freed.isdisjoint(key[2][1]))
            self.freed.clear()

    def of(self, handle) -> list:
        key = getattr(handle, "fast_prefix_slot", None)
        if key is None or key not in self.slots or self.slots[key][0]() is not handle:
            # diffusers' error for a cache never extracted; and what differs: the fast model keeps the prefix itself
            raise RuntimeError("KV cache has not been populated yet. (The fast Qwen-Image-2.1 transformer keeps the "
                               "prefix in its own buffers, filled by its own extract step: a QwenImage21KVCache "
                               "filled by the stock model, or by hand, cannot be read by it, nor its cache by stock)")
        return self.slots[key][1]


class FastQwenImage21Transformer(Unsupported, LoraAdapters, QwenImage21SingleFile, CacheMixin, ModelMixin, ConfigMixin):
    """Drop-in for diffusers' QwenImage21Transformer2DModel: the same forward arguments (kv_cache and kv_cache_mode
    included) and output, its config plus "fast_config", cache_context, LoRAs through diffusers' API (the 2512
    model's adapters.py on this model's sites: LORA_SITES; attention_kwargs={"scale": s} scales them). Stock methods
    it cannot honour raise NotImplementedError saying what to do instead."""

    config_name = "config.json"
    lora_sites, block_class, stock_model_name = LORA_SITES, FastBlock21, "QwenImage21Transformer2DModel"
    single_file_layout, stock_config_fields = family_layout(LORA_SITES), STOCK_CONFIG  # single_file.py
    parallel_advice = "render one image per process (FastConfig(parallel=...) is not on Qwen-Image-2.1 yet)"
    # the runner's graphs and step cache reach its steps through the forward context (step_graphs, step_cache)
    runs_its_steps = True
    _no_split_modules = ["FastBlock21"]
    _supports_gradient_checkpointing = False

    def __init__(self, fast_config: FastTransformerConfig | dict | None = None, **config):
        """The structure, with uninitialized weights; from_diffusers makes a working model."""
        super().__init__()
        config, fast_config = transformer_configs(config, STOCK_CONFIG, self.stock_model_name, fast_config)
        if fast_config.fp8_attention not in ("off", "auto") + LSE_KERNELS:
            raise ValueError(f"fp8_attention={fast_config.fp8_attention!r} is not available on Qwen-Image-2.1: its "
                             "target's queries attend to the prefix cache and to their own keys in two calls merged "
                             "by their log-sum-exps, which cuDNN's FP8 SDPA does not return; use fp8_attention='fa3' "
                             "or 'auto'")
        if fast_config.bf16_linears:
            raise ValueError(f"bf16_linears={list(fast_config.bf16_linears)} names Qwen-Image-2512's linears; "
                             "Qwen-Image-2.1 runs all of its block linears (qkv, out, gate_up, down) in FP8 with "
                             "fp8=True, or none with fp8=False")
        self.register_to_config(**config, fast_config=fast_config.to_dict())
        self.fast_config = fast_config
        inner = config["num_attention_heads"] * config["attention_head_dim"]
        stock = QwenImage21Transformer2DModel(**{**config, "num_layers": 0})  # its embedders, modulation and output
        for name in SHARED_MODULES:
            setattr(self, name, getattr(stock, name))
        with torch.device("cpu"):  # tables computed, not loaded (no state_dict entries): real even under meta
            self.pos_embed = QwenImage21Rope(theta=10000, axes_dim=list(config["axes_dims_rope"]))
            proj = self.time_text_embed.time_proj  # its frequencies: a non-persistent buffer
            self.time_text_embed.time_proj = type(proj)(proj.timestep_dim, time_factor=proj.time_factor)
        self.transformer_blocks = nn.ModuleList(
            FastBlock21(inner, config["num_attention_heads"], config["attention_head_dim"],
                        inner * config["mlp_ratio"], fast_config, config["eps"])
            for _ in range(config["num_layers"]))
        self.requires_grad_(False)
        self.lora_state = LoraState()
        self.weight_source = None  # fuse_lora requantizes an FP8 weight from its dequantized form (adapters.py)
        self.single_file = None  # from_single_file: what it kept, dequantized, requantized (core/single_file/)
        self.prefix_cache = PrefixCache()
        self.block_arena = None  # memory="low": the blocks' weights, streamed under a budget (memory.py)
        self.planned_prefix: int | None = None  # a budget's plan: the most prefix tokens a forward may have
        self._cache_name: str | None = None
        self.layouts: dict[tuple, Layout] = {}  # by Layout.key
        # the last RECENT_LAYOUTS lookups: (img_mask, its version, text mask, its version, shapes, (batch, device), key)
        self._recent_layouts: list[tuple] = []

    @classmethod
    @torch.no_grad()
    def from_diffusers(cls, stock, config: FastTransformerConfig | None = None, device=None):
        """stock: a diffusers QwenImage21Transformer2DModel (its embedders, modulation and output layers are shared,
        moved to `device`); converted block by block."""
        if not isinstance(stock, QwenImage21Transformer2DModel):
            raise TypeError(f"from_diffusers takes a diffusers QwenImage21Transformer2DModel, got "
                            f"{type(stock).__name__}")
        peft_layers = peft_lora_layers(stock)
        check_carriable(stock, peft_layers)
        config = FastTransformerConfig.of(config or FastTransformerConfig())
        device = torch.device(device) if device is not None else stock.device
        if config.attention != "auto":
            resolve_backend(config.attention, device, stock.dtype)  # a clear error before any conversion
        if config.fp8_attention in LSE_KERNELS:  # a named kernel that cannot run: before any conversion
            fp8_attention_kernel(config.fp8_attention, device, stock.dtype, LSE_KERNELS)
        stock_config = {name: stock.config[name] for name in STOCK_CONFIG if name in stock.config}
        with torch.device("meta"):
            fast = cls(config, **{**stock_config, "num_layers": 0})
        fast.register_to_config(num_layers=stock.config.num_layers)
        for name in SHARED_MODULES:
            setattr(fast, name, getattr(stock, name).to(device))
        fast.transformer_blocks = nn.ModuleList(FastBlock21.from_stock(block, config, device)
                                                for block in stock.transformer_blocks)
        if peft_layers:
            fast._carry_lora(stock, peft_layers)
        return fast.requires_grad_(False).eval()

    @property
    def attention_backend(self) -> str:
        return resolve_backend(self.fast_config.attention, self.device, self.dtype)

    @property
    def fp8_attention(self) -> tuple[str | None, str | None]:
        """(the FP8 attention kernel the forwards run, None) or (None, why not) (core/model/fp8_attention.py)."""
        return fp8_attention_kernel(self.fast_config.fp8_attention, self.device, self.dtype, LSE_KERNELS)

    def running(self) -> list[tuple[str, object]]:
        """What a forward runs, as core/optimizations.py names it (recorded in a pipeline call's CallRecord)."""
        fp8 = self.fast_config.fp8
        kernel = self.fp8_attention[0]
        return ([("fused_transformer", True)] + ([("fp8", True)] if fp8 else [])
                + ([("fp8_fast_accum", True)] if fp8 and self.fast_config.fp8_fast_accum else [])
                + [("attention", self.attention_backend)] + ([("fp8_attention", kernel)] if kernel else [])
                + list(self.single_file.applied if self.single_file else ()))

    # ---- diffusers' CacheMixin: the pipeline names each pass; TaylorSeerCacheConfig's hooks on the blocks' `attn`

    @contextlib.contextmanager
    def cache_context(self, name: str, **kwargs):
        """The pass's name (its prefix cache's slot; the step cache's branch), and with a diffusers cache enabled
        its hooks' state for this pass, as diffusers' CacheMixin.cache_context sets it."""
        previous, self._cache_name = self._cache_name, name
        try:
            with CacheMixin.cache_context(self, name, **kwargs) if self.is_cache_enabled else contextlib.nullcontext():
                yield
        finally:
            self._cache_name = previous

    def enable_cache(self, config):
        """diffusers' TaylorSeerCacheConfig on its default pattern runs its own hooks on every block's `attn`
        (block.AttentionPart: the attention's output projection, as on the stock block), the forwards then eager
        (the hooks decide on the host). Where stock refuses, its own refusal; the others are refused saying why."""
        if type(config).__name__ in REGISTRY_CACHES:  # where stock refuses, its own refusal (a ValueError)
            TransformerBlockRegistry.get(QwenImage21TransformerBlock)
        if (isinstance(config, TaylorSeerCacheConfig) and not config.use_lite_mode
                and config.cache_identifiers is None and config.skip_predict_identifiers is None):
            CacheMixin.enable_cache(self, config)
            return
        refuse(self, "enable_cache", f"{type(config).__name__} is not supported on the fast Qwen-Image-2.1 "
                                     "transformer: TaylorSeerCacheConfig runs on its default pattern (not its lite "
                                     "mode nor custom identifiers, which hook modules whose outputs the fast block "
                                     "does not have); FastConfig(cache=...) runs the DBCache rules; keep the stock "
                                     "transformer (FastConfig.preset('baseline')) for the rest (on stock "
                                     "Qwen-Image-2.1, diffusers 0.42.1's TextKVCacheConfig hooks no block and runs "
                                     "nothing, and "
                                     "PyramidAttentionBroadcastConfig and FasterCacheConfig fail at the first call)")

    # ---- saving and loading (the 2512 model's format: the stock config plus fast_config, FP8 weights as stored)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, subfolder: str | None = None, *, device=None,
                        torch_dtype: torch.dtype | None = None, fast_config: FastTransformerConfig | None = None,
                        variant: str | None = None, **unsupported):
        """What save_pretrained wrote, as FastQwenImageTransformer.from_pretrained loads it (FP8 weights as stored,
        onto `device`; fast_config's fp8 must be the stored one)."""
        checkpoint = FastCheckpoint(cls, pretrained_model_name_or_path, subfolder, unsupported)
        run = checkpoint.run_config(fast_config)
        device = torch.device(device or "cpu")
        model = cls.meta_model(run, checkpoint.stock_config(STOCK_CONFIG))
        checkpoint.load_into(model, device, variant, torch_dtype)
        if run.attention != "auto":
            resolve_backend(run.attention, device, model.dtype)
        return model.requires_grad_(False).eval()

    @classmethod
    def meta_model(cls, run: FastTransformerConfig, stock_config: dict) -> "FastQwenImage21Transformer":
        with torch.device("meta"):
            return cls(run, **stock_config)

    # ---- forward

    @torch.no_grad()
    def forward(self, hidden_states, encoder_hidden_states, timestep, img_shapes, img_mask,
                encoder_hidden_states_mask=None, attention_kwargs=None, kv_cache=None, kv_cache_mode=None,
                return_dict: bool = True):
        """QwenImage21Transformer2DModel.forward's arguments and output (its docstring)."""
        for name, value in self.running():
            record(name, value)
        if self.is_cache_enabled:
            record("step_cache", type(self._cache_config).__name__)
        inputs = dict(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states, timestep=timestep,
                      img_shapes=img_shapes, img_mask=img_mask, encoder_hidden_states_mask=encoder_hidden_states_mask,
                      kv_cache=kv_cache, kv_cache_mode=kv_cache_mode)
        with forward_context(lora_scale=lora_scale_of(attention_kwargs, "Qwen-Image-2.1")):
            speculation = get_context().cfg_speculation
            if speculation is None:
                output = self._forward(**inputs)
            else:
                output = speculation(lambda inputs: self._forward(**inputs), self._forward_pair, self._cache_name,
                                     inputs, self.lora_key())
        return Transformer2DModelOutput(sample=output) if return_dict else (output,)

    def cfg_speculation(self) -> Speculation:
        """Batched CFG's pairing of a diffusers-loop call's "cond" and "uncond" forwards (core/runtime/
        cfg_pairing.py): with the prefix cache, from the first cached step on (_forward_pair); the prefill runs one
        branch at a time (each fills its own prefix cache), and forwards without the prefix cache are not paired."""
        return Speculation(BRANCH_INPUTS, pairable=lambda inputs: inputs["kv_cache"] is not None,
                           pairs_now=lambda inputs: inputs["kv_cache_mode"] == "cached")

    def _forward(self, hidden_states, encoder_hidden_states, timestep, img_shapes, img_mask, encoder_hidden_states_mask,
                 kv_cache, kv_cache_mode) -> torch.Tensor:
        batch = hidden_states.shape[0]
        causal = self.config.causal_condition
        if kv_cache is not None and not causal:
            raise ValueError("kv_cache requires `causal_condition=True`: the cache is only valid because text and "
                             "condition-image tokens modulate from t=0")
        if kv_cache is not None and kv_cache_mode not in ("extract", "cached"):
            raise ValueError(f"kv_cache_mode must be 'extract' or 'cached' when kv_cache is provided, got "
                             f"{kv_cache_mode!r}.")
        if kv_cache is None and kv_cache_mode is not None:
            raise ValueError(f"kv_cache_mode is {kv_cache_mode!r} but no kv_cache was passed to hold the prefix.")
        device, dtype = hidden_states.device, hidden_states.dtype
        layout = self._layout(img_shapes, img_mask, encoder_hidden_states_mask, batch, device)
        backend = self.attention_backend
        context = get_context()
        graphs, step_cache = context.step_graphs, context.step_cache  # the runner's, when the call's plan has them
        if self.is_cache_enabled:  # diffusers' hooks decide on the host inside the forward: no graph of it
            graphs = None
        blocks = len(self.transformer_blocks)

        fp8_attention = self.fp8_attention[0]
        kv_shape = self._kv_shape(layout, batch)
        if kv_cache_mode == "cached":  # only the target's tokens: their latents are the last `target` rows
            kvs = self._prefix_buffers(kv_cache, layout, batch, graphs)
            # what a graph reads beside its inputs: the slot's buffers, the layout's tables (by content), the
            # adapters as they are
            graph_key = ("cached_step", (self.prefix_cache.serial(kv_cache),), layout.key, backend, fp8_attention)
            piece = functools.partial(self._cached_piece, graphs, graph_key, layout, kvs,
                                      layout.step_attention(backend, fp8_attention))
            inputs = dict(hidden_states=hidden_states[:, -layout.target:], timestep=timestep)
            if step_cache is None:
                count_blocks(blocks * batch, blocks * batch)
                return piece("step", inputs)
            return self._step_cached(step_cache, piece, inputs, batch, slice(None))

        if self.planned_prefix is not None and layout.prefix > self.planned_prefix:
            raise ValueError(f"the prefix (the prompt and any condition image) has {layout.prefix} tokens; the memory "
                             f"budget (FastConfig(max_memory_gib=...)) is planned for at most {self.planned_prefix}: "
                             "shorten the prompt, or leave max_memory_gib out")
        x = self._joint(hidden_states, encoder_hidden_states, img_mask, layout)
        modulation, temb = self._modulation(timestep, hidden_states)
        rows = Rows(modulation, layout.mod_row, layout.freqs, layout.prefix, layout.target)
        plan = Attention(backend, layout.seqused_k, layout.key_mask, layout.segments, layout.key_valid,
                         fp8_attention, layout.prefix_valid)
        if kv_cache_mode == "extract":
            kvs = self.prefix_cache.bind(kv_cache, self._cache_name or "default", kv_shape, dtype, device, blocks,
                                         fp8=fp8_attention is not None)
            if graphs is not None:
                self.prefix_cache.stale_graphs(graphs)
        else:  # one scratch for every block: each writes it, then reads it
            scratch = Fp8Prefix(kv_shape, device) if fp8_attention else (
                torch.empty(kv_shape, dtype=dtype, device=device), torch.empty(kv_shape, dtype=dtype, device=device))
            kvs = [scratch] * blocks
        if step_cache is None:
            count_blocks(blocks * batch, blocks * batch)
            return self._output(*self._blocks(x, None, rows, plan, kvs, 0, blocks), rows, temb)
        piece = functools.partial(self._prefill_piece, x, rows, plan, kvs, temb, layout.target)
        # a prefill's later steps compute the target's rows alone: its branch keeps their residuals
        kept = slice(-layout.target, None) if kv_cache_mode == "extract" else slice(None)
        return self._step_cached(step_cache, piece, {}, batch, kept)

    def _kv_shape(self, layout: Layout, batch: int) -> tuple:
        """A block's prefix-cache buffers' shape: [B, T + P, H, D] (key and value, [target, prefix]), or under FP8
        attention the prefix's alone [B, P, H, D] (Fp8Prefix)."""
        return (batch, layout.prefix if self.fp8_attention[0] else layout.target + layout.prefix,
                self.config.num_attention_heads, self.config.attention_head_dim)

    def _prefix_buffers(self, kv_cache, layout: Layout, batch: int, graphs) -> list:
        """A cached step's prefix cache: kv_cache's slot, per block, checked against the forward's shape; the graphs
        of freed slots dropped (graphs: the call's CallGraphs, or None)."""
        kvs, kv_shape = self.prefix_cache.of(kv_cache), self._kv_shape(layout, batch)
        if tuple(next(iter(kvs[0])).shape) != kv_shape:
            raise ValueError(f"the prefix KV cache holds {tuple(next(iter(kvs[0])).shape[:2])} (batch, keys), "
                             f"this forward needs {kv_shape[:2]}: extract it anew")
        if graphs is not None:
            self.prefix_cache.stale_graphs(graphs)
        return kvs

    def _forward_pair(self, inputs: dict, negative: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Batched CFG (cfg_speculation's pair): the prompt's cached step (`inputs`, a forward's arguments) and the
        negative prompt's (the same latents and timestep, with negative's own BRANCH_INPUTS) as one step of batch
        2B -> (the prompt's output, the negative prompt's). Each half attends to its own branch's prefix cache at
        its own rotary positions (block.PairedAttention); one graph of the runner's for both, keyed by both slots."""
        hidden, timestep, img_shapes = inputs["hidden_states"], inputs["timestep"], inputs["img_shapes"]
        batch, device = hidden.shape[0], hidden.device
        context = get_context()
        graphs = context.step_graphs if not self.is_cache_enabled else None
        branches = []
        for branch in (inputs, inputs | negative):
            layout = self._layout(img_shapes, branch["img_mask"], branch["encoder_hidden_states_mask"], batch, device)
            branches.append((layout, self._prefix_buffers(branch["kv_cache"], layout, batch, graphs)))
        (layout, kvs), (negative_layout, negative_kvs) = branches
        backend, fp8_attention = self.attention_backend, self.fp8_attention[0]
        plan = PairedAttention(tuple(lay.step_attention(backend, fp8_attention) for lay, _ in branches),
                               tuple(lay.freqs[lay.prefix:] for lay, _ in branches), batch)
        serials = tuple(self.prefix_cache.serial(branch["kv_cache"]) for branch in (inputs, negative))
        graph_key = ("cached_pair", serials, layout.key, negative_layout.key, backend, fp8_attention)
        step_inputs = dict(hidden_states=hidden[:, -layout.target:], timestep=timestep)
        compute = functools.partial(self._paired_step, (layout, negative_layout), plan, list(zip(kvs, negative_kvs)))
        blocks = len(self.transformer_blocks)
        record("batched_cfg")
        count_blocks(2 * blocks * batch, 2 * blocks * batch)
        if graphs is None:
            out = compute(**step_inputs)
        else:
            out = graphs.run((signature(step_inputs), self.lora_key(), graph_key + ("step", 0, blocks)),
                             step_inputs, compute)
        return out[:batch], out[batch:]

    def _paired_step(self, layouts: tuple, plan: PairedAttention, kvs: list, hidden_states, timestep) -> torch.Tensor:
        """_forward_pair's step: the target's latents [B, T, C] -> the outputs [2B, T, C], the prompt's first; kvs
        per block the branches' pair of prefix buffers."""
        # as _cached_step: what the step reads beside its inputs, made before it (a graph of it keeps them)
        read_by_graph(*(t for layout in layouts for t in layout.step_tables()),
                      *(t for pair in kvs for kv in pair for t in kv))
        target = layouts[0].target
        x = self.img_in(hidden_states)
        x = torch.cat([x, x])  # both branches' target rows begin as the same latents
        modulation, temb = self._modulation(torch.cat([timestep, timestep]), x)
        rows = Rows(modulation[:x.shape[0]], None, None, 0, target)
        return self._piece("step", x, rows, plan, kvs, temb, 0, len(self.transformer_blocks), target)

    def _step_cached(self, step_cache, piece, inputs: dict, batch: int, kept: slice) -> torch.Tensor:
        """A forward under the call's step cache (core/runtime/step_cache.py), its branch the cache_context's."""
        out, computes = step_cache.forward(piece, inputs, [self._cache_name or "cond"], kept)
        config, blocks = step_cache.config, len(self.transformer_blocks)
        record("step_cache", config.label())
        count_blocks((blocks if computes[0] else config.Fn + config.Bn) * batch, blocks * batch)
        return out

    def _layout(self, img_shapes, img_mask, text_mask, batch: int, device) -> Layout:
        """The forward's Layout: a recent one when the pipeline passes the same mask tensors again, unmodified (no
        host sync), else the one of this content, built if new."""
        for last in self._recent_layouts:
            if (last[0]() is img_mask and last[1] == img_mask._version
                    and (last[2]() if last[2] is not None else None) is text_mask
                    and last[3] == (text_mask._version if text_mask is not None else None)
                    and last[4] == repr(img_shapes) and last[5] == (batch, str(device)) and last[6] in self.layouts):
                return self.layouts[last[6]]
        key = Layout.key(img_shapes, img_mask, text_mask, batch, device)
        if key not in self.layouts:
            if len(self.layouts) >= MAX_LAYOUTS:
                self.layouts.clear()
            self.layouts[key] = Layout(self, img_shapes, img_mask, text_mask, batch, device, key)
        self._recent_layouts = [(weakref.ref(img_mask), img_mask._version,
                                 weakref.ref(text_mask) if text_mask is not None else None,
                                 text_mask._version if text_mask is not None else None, repr(img_shapes),
                                 (batch, str(device)), key)] + self._recent_layouts[:RECENT_LAYOUTS - 1]
        return self.layouts[key]

    def _modulation(self, timestep, hidden_states) -> tuple[torch.Tensor, torch.Tensor]:
        """(the shared modulation [G, 4D], temb [G, D]) as diffusers computes them: G = B, plus the t = 0 row with
        causal_condition."""
        timestep = timestep.to(hidden_states.dtype)
        if self.config.causal_condition:
            timestep = torch.cat([timestep, timestep.new_zeros(1)], dim=0)
        temb = self.time_text_embed(timestep, hidden_states)
        return self.modulation(temb), temb

    def _cached_piece(self, graphs, graph_key: tuple, layout: Layout, kvs: list, plan: Attention, name: str,
                      inputs: dict, start: int = 0, stop: int | None = None, img=None, txt=None):
        """A cached step (name "step": all of it), or one piece of it under a step cache ("front": blocks
        [0, stop) -> (x, None, r); "middle": [start, stop) on img -> (x, None); "back": [start, N) and the output),
        from a graph of the runner's where the call has graphs."""
        stop = len(self.transformer_blocks) if stop is None else stop
        if name in ("middle", "back"):  # from the front's rows: the latents are not read again
            inputs = dict(timestep=inputs["timestep"], img=img)
        compute = functools.partial(self._cached_step, layout, kvs, plan, name, start, stop)
        if graphs is None:
            return compute(**inputs)
        return graphs.run((signature(inputs), self.lora_key(), graph_key + (name, start, stop)), inputs, compute)

    def _cached_step(self, layout: Layout, kvs: list, plan: Attention, name: str, start: int, stop: int, timestep,
                     hidden_states=None, img=None):
        """The blocks [start, stop) of a cached step on the target's rows: from its latents [B, T, C] (name "step"
        and "front"), or from the rows img [B, T, D] a piece before it left; every token reads its sample's row."""
        # the layout's tables and masks and the prefix buffers, made before the step: a graph of it keeps them
        read_by_graph(*layout.step_tables(), *(t for kv in kvs for t in kv))
        x = self.img_in(hidden_states) if img is None else img
        batch = x.shape[0]
        modulation, temb = self._modulation(timestep, x)
        rows = Rows(modulation[:batch], None, layout.freqs[layout.prefix:], 0, layout.target)
        return self._piece(name, x, rows, plan, kvs, temb, start, stop, layout.target)

    def _prefill_piece(self, x, rows: Rows, plan: Attention, kvs: list, temb, target: int, name: str, inputs: dict,
                       start: int = 0, stop: int | None = None, img=None, txt=None):
        """A piece of a forward of the joint sequence (a prefill, or a step without the prefix cache) under a step
        cache: as _cached_piece's, eagerly (once a call), r of the target's rows."""
        stop = len(self.transformer_blocks) if stop is None else stop
        return self._piece(name, x if img is None else img, rows, plan, kvs, temb, start, stop, target)

    def _piece(self, name: str, x, rows: Rows, plan: Attention, kvs: list, temb, start: int, stop: int, target: int):
        if name in ("step", "back"):  # to the output
            return self._output(*self._blocks(x, None, rows, plan, kvs, start, stop), rows, temb)
        x_in, (x, tail) = x, self._blocks(x, None, rows, plan, kvs, start, stop)
        if tail is not None:  # the last block's residual, which the next piece's first kernel would have fused
            x = residual_gate(x, *tail, mod_row=rows.mod_row)
        if name == "middle":
            return x, None
        return x, None, (x - x_in)[:, -target:]  # front: the residual over the first blocks, the target's rows

    def _blocks(self, x, tail, rows: Rows, plan: Attention, kvs: list, start: int, stop: int):
        """Blocks [start, stop) on x -> (x, the last block's residual left to the next kernel, or None); under a
        memory budget the streamed blocks' weights are copied in ahead of them (core/runtime/streaming.py)."""
        if plan.fp8:  # the target's q, k, v in FP8 [B, T, H, D]
            shape = (x.shape[0], rows.target_rows, self.config.num_attention_heads, self.config.attention_head_dim)
            scratch = tuple(torch.empty(shape, dtype=FP8_DTYPE, device=x.device) for _ in range(3))
        elif isinstance(plan, PairedAttention):  # each branch's queries' buffer, as its key and value buffers
            scratch = tuple(torch.empty(k.shape, dtype=x.dtype, device=x.device) for k, _ in kvs[0])
        else:  # the queries' buffer, as the blocks' key and value buffers
            scratch = torch.empty(kvs[0][0].shape, dtype=x.dtype, device=x.device)
        streaming = self.block_arena.stream if self.block_arena is not None else None
        if streaming is not None:
            streaming.begin(start, stop)
        for i in range(start, stop):
            if streaming is not None:
                streaming.before(i)
            x, tail = self.transformer_blocks[i](x, tail, rows, plan, kvs[i], scratch)
            if x.dtype == torch.float16:  # diffusers' block clips its float16 output to the finite range
                x, tail = clip_float16(residual_gate(x, *tail, mod_row=rows.mod_row)), None
        if streaming is not None:
            streaming.end()
        return x, tail

    def _output(self, x, tail, rows: Rows, temb) -> torch.Tensor:
        scale = self.norm_out.linear(self.norm_out.silu(temb).to(x.dtype))  # [G, D]
        scale = (scale if rows.mod_row is not None else scale[:x.shape[0]]).contiguous()
        if tail is None:
            y = layer_norm_modulate(x, torch.zeros_like(scale), scale, mod_row=rows.mod_row, eps=self.norm_out.norm.eps)
        else:
            _, y = residual_gate_layer_norm_modulate(x, tail[0], tail[1], torch.zeros_like(scale), scale,
                                                     mod_row=rows.mod_row, eps=self.norm_out.norm.eps)
        return self.proj_out(y)

    def _joint(self, hidden_states, encoder_hidden_states, img_mask, layout: Layout):
        """The joint sequence [B, S, D] as diffusers builds it: text with each image slot expanded to 2 x 2 latent
        tokens and the condition images' latents put there, then the target's."""
        batch = hidden_states.shape[0]
        text = self.txt_in(encoder_hidden_states)
        joint = torch.cat([text, text.new_zeros(batch, layout.target // IMG_TOKENS_PER_SLOT, text.shape[2])], dim=1)
        joint = joint.repeat_interleave(layout.repeats, dim=1)
        joint[:, layout.image_pad_mask] = self.img_in(hidden_states)
        return joint
