"""The forward context: what one pipeline call tells the models it runs, in one explicit place.

The fast transformer and VAE hold only their weights (and caches derived from them). What a call decides reaches
them here, set by the pipeline for the call (or by the transformer's forward for itself: the LoRA scale, the
cache_context name) and read where it is used, as nano-vllm's `Context` does; a context variable, so threads and
nested calls each see their own. It holds data: where a forward must go through the runner (a diffusers loop's
call of the transformer), the runner puts a hook on the module (runtime/forward_hook.py) instead.
- lora_scale: attention_kwargs["scale"] of the forward running (model/lora.py multiplies the adapters by it);
- cache_name: diffusers' cache_context ("cond" / "uncond"): which CFG pass a forward is (runtime/runner.py pairs
  them);
- block_graphs: when blocks replay from graphs under diffusers' step-cache hooks, the forward's BlockGraphs
  (runtime/block_graphs.py: the runner's store of block graphs, the call's eager keys, the adapters' key);
- past_hooks: a step cache run by the runner (runtime/step_cache.py) for an enabled diffusers cache whose decisions
  it makes (model/step_caches.native_rule): the blocks are called past that cache's hooks;
- attention_cache: in a forward of an attention-level step cache run by the runner (runtime/taylorseer.py,
  pyramid_broadcast.py, faster_cache.py): per block, what it does with its attention (a BlockCache: predict or
  reuse it, or compute and store it);
- ulysses: the sequence-parallel group of a FastConfig(parallel="ulysses") call (runtime/parallel.py);
- weights_take_turns: memory="low" (runtime/offload.py): the forward checks that the block linears are on its device;
- record: the call's CallRecord (optimizations.py): what ran, for `applied`;
- step_graphs: in a call whose plan has CUDA graphs, for a model that runs its own steps (Qwen-Image-2.1's: a cached
  step follows host work on the prefix cache): the runner's store and the call's eager keys
  (runtime/cuda_graph.CallGraphs);
- step_cache: in a call with FastConfig(cache=...), for such a model: the call's StepCacheRun (runtime/step_cache.py),
  which its forwards run their pieces through;
- cfg_speculation: in a call whose plan has batched CFG, for such a model: the call's pairing of its "cond" and
  "uncond" forwards (runtime/cfg_pairing.Speculation, made by the model: cfg_speculation()), which its forward
  answers through.
"""

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class ForwardContext:
    lora_scale: float = 1.0
    cache_name: str | None = None
    block_graphs: Any = None  # block_graphs.BlockGraphs
    past_hooks: bool = False
    attention_cache: tuple | None = None  # a BlockCache per block
    ulysses: Any = None  # parallel.Ulysses
    weights_take_turns: bool = False
    record: Any = None  # optimizations.CallRecord
    step_graphs: Any = None  # cuda_graph.CallGraphs
    step_cache: Any = None  # step_cache.StepCacheRun
    cfg_speculation: Any = None  # cfg_pairing.Speculation


_CONTEXT: ContextVar[ForwardContext] = ContextVar("qwen_image_fast_forward_context", default=ForwardContext())


def get_context() -> ForwardContext:
    return _CONTEXT.get()


@contextlib.contextmanager
def forward_context(**changes):
    """The current context with `changes`, for the duration of the block."""
    token = _CONTEXT.set(replace(_CONTEXT.get(), **changes))
    try:
        yield _CONTEXT.get()
    finally:
        _CONTEXT.reset(token)


def count_blocks(run: int, total: int = 0):
    """Note in the running call's CallRecord that `run` block-rows ran (of `total` more in all)."""
    call = _CONTEXT.get().record
    if call is not None:
        call.count_blocks(run, total)


def record(name: str, value=True):
    """Note in the running call's CallRecord that optimization `name` ran (nothing outside a pipeline call)."""
    call = _CONTEXT.get().record
    if call is not None:
        call.add(name, value)
