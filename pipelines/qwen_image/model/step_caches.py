"""diffusers' step caches (`transformer.enable_cache(config)`) on the fast transformer.

The caches are diffusers' own hooks (diffusers/hooks/), applied by diffusers' CacheMixin to the fast transformer as
to the stock one: each finds what it hooks by the same module names and classes, and sees what it sees there.
- block-level (FirstBlockCache, MagCache, SeaCache, TaylorSeer's lite mode): `transformer_blocks.<i>`, FastBlocks
  called with diffusers' block output while a cache is enabled (transformer.run_blocks), registered with the stock
  block's metadata (block.py);
- attention-level (TaylorSeer, PyramidAttentionBroadcast, FasterCache): `transformer_blocks.<i>.attn`, the
  weightless JointAttention (block.py), which returns the stock `attn`'s outputs;
- `proj_out` (TaylorSeer's lite mode) and the transformer's own forward (SeaCache, FasterCache) are the stock ones.
So with the same config, inputs and seed the hooks make the decisions they make on the stock model, from the same
values up to the kernels' rounding (tests/pipelines/test_step_caches.py compares the two).

While a cache is enabled the forwards run one by one under their cache_context (the hooks keep a state per context and
decide on the host inside the forward): core/optimizations.py plans batched CFG off and says why, and CUDA graphs per
block (core/runtime/runner.py, graphed_block). FastConfig(cache=...) is the fast pipeline's own step cache
(core/runtime/step_cache.py), graphed per piece of a forward.

Five configs are the exception inside a fast pipeline's call (native_rule): the runner makes their decisions by a
rule of its own, the same decisions from the same values with the same arithmetic, on graphed forwards with CFG
batched in the text-to-image pipeline, instead of the hooks' Python around 60 block graphs per branch:
- FirstBlockCacheConfig: the step cache's rule with Fn=1, Bn=0 (runtime/step_cache.FirstBlockRule), each forward in
  three graphed pieces;
- TaylorSeerCacheConfig on its default pattern (every attention module; not the lite mode nor custom identifiers):
  core/runtime/taylorseer.py, a whole forward graphed per variant (update, or predict), the blocks of a predicting step
  skipping what only attention reads;
- PyramidAttentionBroadcastConfig on its default identifiers: core/runtime/pyramid_broadcast.py, a whole forward graphed
  per decision pattern, the attention computed only for the branches that compute (one state for cond and uncond,
  as in diffusers: the uncond half takes the cond half's output);
- FasterCacheConfig(is_guidance_distilled=True) on its default identifiers: core/runtime/faster_cache.py, likewise (one
  state for both, the approximated attention extrapolated from the last two outputs);
- SeaCacheConfig: core/runtime/sea_cache.py; the pipelines pass it no scheduler metadata, so diffusers runs it fail-open
  (nothing skipped): the uncached forward, after its root hook says so.
MagCache and TaylorSeer's lite mode run their hooks. So do the five above where a rule does not run: a forward
outside a fast pipeline's call, under offload hooks (weights arrive inside the module's call), FirstBlockCache in the
ControlNet pipelines (the residuals added between blocks pass through its hooks' cached path as diffusers adds them,
which the pieces do not reproduce), TaylorSeer with cfg_fraction < 1 (the forwards change branches mid-call). Under a
rule the modules are called past those hooks (past_hooks).
"""

import contextlib

from diffusers.hooks import (
    FasterCacheConfig,
    FirstBlockCacheConfig,
    PyramidAttentionBroadcastConfig,
    SeaCacheConfig,
    TaylorSeerCacheConfig,
    TextKVCacheConfig,
)
from diffusers.models.cache_utils import CacheMixin

from ...core.runtime.context import forward_context
from ...core.runtime.faster_cache import FasterCacheRule
from ...core.runtime.pyramid_broadcast import PyramidBroadcastRule
from ...core.runtime.sea_cache import SeaCacheFailOpen
from ...core.runtime.step_cache import FirstBlockRule
from ...core.runtime.taylorseer import TaylorSeerRule

NativeRule = FirstBlockRule | TaylorSeerRule | PyramidBroadcastRule | FasterCacheRule | SeaCacheFailOpen


# every block's attention module (the defaults match `transformer_blocks.<i>.attn`)
PAB_DEFAULT_IDENTIFIERS = PyramidAttentionBroadcastConfig.spatial_attention_block_identifiers
FASTER_CACHE_DEFAULT_IDENTIFIERS = FasterCacheConfig.spatial_attention_block_identifiers


def native_rule(config) -> NativeRule | None:
    """The rule the runner makes diffusers' cache `config`'s decisions by, where there is one, else None:
    FirstBlockCacheConfig, TaylorSeerCacheConfig on its default pattern (every attention module),
    PyramidAttentionBroadcastConfig and FasterCacheConfig(is_guidance_distilled=True) on their default identifiers,
    SeaCacheConfig (fail-open in the pipelines)."""
    if isinstance(config, FirstBlockCacheConfig):
        return FirstBlockRule(config.threshold)
    if (isinstance(config, TaylorSeerCacheConfig) and not config.use_lite_mode
            and config.cache_identifiers is None and config.skip_predict_identifiers is None):
        return TaylorSeerRule.of(config)
    if (isinstance(config, PyramidAttentionBroadcastConfig) and config.spatial_attention_block_skip_range is not None
            and config.spatial_attention_block_identifiers == PAB_DEFAULT_IDENTIFIERS):
        # enable_cache set the skip range to 2 if none was given; temporal and cross attention: no such module here
        return PyramidBroadcastRule(config.spatial_attention_block_skip_range,
                                    tuple(config.spatial_attention_timestep_skip_range),
                                    config.current_timestep_callback)
    if (isinstance(config, FasterCacheConfig) and config.is_guidance_distilled
            and config.spatial_attention_block_skip_range is not None
            and tuple(config.spatial_attention_block_identifiers) == FASTER_CACHE_DEFAULT_IDENTIFIERS):
        # enable_cache set attention_weight_callback to diffusers' default (0.5) if none was given
        return FasterCacheRule(config.spatial_attention_block_skip_range,
                               tuple(config.spatial_attention_timestep_skip_range), config.attention_weight_callback,
                               config.current_timestep_callback)
    if isinstance(config, SeaCacheConfig):
        return SeaCacheFailOpen()
    return None


def past_hooks(block):
    """The block's own forward, past the diffusers hooks registered on the instance (register_hook sets
    `module.forward`): how a native rule's pieces call the blocks those hooks would otherwise intercept."""
    return type(block).forward.__get__(block)


def refusal(config) -> str | None:
    """Why a diffusers cache config cannot run on this model, as it cannot on the stock one; None if it can."""
    if isinstance(config, TextKVCacheConfig):
        return ("TextKVCacheConfig caches text keys and values that stay the same across steps, which only "
                "NucleusMoE-Image's blocks have (diffusers hooks no other block): Qwen-Image's dual-stream blocks "
                "modulate and update the text stream with the timestep in every block, so its keys and values change "
                "every step and there is nothing exact to cache (on the stock transformer it runs nothing)")
    if isinstance(config, FasterCacheConfig) and not config.is_guidance_distilled:
        return ("FasterCacheConfig(is_guidance_distilled=False) reuses the unconditional half of a CFG batch, which "
                "needs a pipeline that runs the conditional and unconditional inputs as one batch: the Qwen-Image "
                "pipelines run them as two forwards, and on the stock transformer it fails at the first forward "
                "(IndexError in diffusers/hooks/faster_cache.py); pass is_guidance_distilled=True (attention reuse "
                "only), or use FirstBlockCacheConfig / TaylorSeerCacheConfig / FastConfig(cache=...)")
    return None


class StepCaches(CacheMixin):
    """diffusers' CacheMixin (enable_cache, disable_cache, is_cache_enabled, cache_context), mixed into the fast
    transformer; the configs it refuses raise ValueError with the reason."""

    def enable_cache(self, config) -> None:
        why_not = refusal(config)
        if why_not:
            raise ValueError(f"FastQwenImageTransformer.enable_cache: {why_not}")
        super().enable_cache(config)

    @property
    def step_cache_name(self) -> str | None:
        """The enabled diffusers cache's config class, e.g. "FirstBlockCacheConfig" (None: none enabled)."""
        return None if self._cache_config is None else type(self._cache_config).__name__

    @property
    def native_step_cache(self) -> NativeRule | None:
        """The step cache's rule for the enabled diffusers cache (native_rule), None if none or it has none."""
        return None if self._cache_config is None else native_rule(self._cache_config)

    @contextlib.contextmanager
    def cache_context(self, name: str, **kwargs):
        """diffusers' cache_context (the hooks' state for this pass: "cond" / "uncond"), and the name in the forward
        context, where the runner reads which CFG pass a forward is."""
        with super().cache_context(name, **kwargs), forward_context(cache_name=name):
            yield
