"""diffusers' SeaCacheConfig (diffusers/hooks/sea_cache.py) inside a fast pipeline's call, where diffusers runs it
fail-open (model/step_caches.py says when this runs instead of its hooks).

SeaCache decides from the scheduler's step index, sigma and step count, which a denoising loop must pass as
`cache_context(name, step_index=..., sigma=..., num_inference_steps=...)`; the Qwen-Image pipelines pass a name
only. Its root hook then warns once ("... running in fail-open mode ...") and every block runs in full: stock
diffusers with SeaCache enabled computes what it computes without it. So does this, with CFG batched and whole
forwards graphed, after asking the root hook itself whether it runs fail-open (its own pre_forward, under the
branch's cache_context where the pipeline's loop is ours): the same warning, and a clear error, never a silent
difference, if it ever got what it needs to skip.
"""

from dataclasses import dataclass, field

from diffusers.hooks.hooks import HookRegistry
from diffusers.hooks.sea_cache import _SEA_CACHE_ROOT_HOOK


@dataclass(frozen=True)
class SeaCacheFailOpen:
    """A SeaCacheConfig whose forwards get no scheduler metadata: it skips nothing."""

    kind = "sea_cache"  # optimizations.Facts.cache_rule

    def label(self) -> str:
        return "SeaCacheConfig"


@dataclass
class Branch:
    decisions: list = field(default_factory=list)  # per forward: True (computed)


class SeaCacheFailOpenRun:
    """One pipeline call: each forward checked fail-open with SeaCache's root hook, per branch."""

    def __init__(self, rule: SeaCacheFailOpen, transformer):
        self.rule, self.transformer = rule, transformer
        self.root = HookRegistry.check_if_exists_or_initialize(transformer).get_hook(_SEA_CACHE_ROOT_HOOK)
        self.branches: dict[str, Branch] = {}

    def check(self, names: list[str]):
        """Before a forward of `names`' branches. A diffusers loop called the module through the root hook, under its
        cache_context; the text-to-image loop calls the root hook here, under each branch's."""
        if self.root.state_manager._context is None:
            for name in names:
                with self.transformer.cache_context(name):
                    self.root.pre_forward(self.transformer)
                    self._fail_open()
        else:
            self._fail_open()
        for name in names:
            self.branches.setdefault(name, Branch()).decisions.append(True)

    def _fail_open(self):
        if self.root.shared_state.forward_metadata is not None:
            raise ValueError("SeaCacheConfig got the scheduler metadata it decides from inside a fast pipeline's call, "
                             "where the fast pipeline runs it only fail-open (as diffusers' Qwen-Image pipelines do); "
                             "call the transformer from your own loop to run its hooks")
