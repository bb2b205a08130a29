"""The runner: how a fast pipeline's transformer forwards run. One for both kinds of loop, the text-to-image
pipeline's own and diffusers' image-conditioned ones, with one policy each for CUDA graphs and batched CFG.

A pipeline owns one Runner (its graphs live across calls); each call opens a CallRun:
- `forward(context, **inputs)`: one forward. With graphs (FastConfig.cuda_graphs, where the registry says they can
  run): the text is padded (masked) to a multiple of text_bucket tokens; a forward signature's first forward in a
  call runs eagerly (it compiles the kernels and fills the model's caches), its second is captured and replayed,
  later ones replay; graphs are kept across calls (at most MAX_GRAPHS, least recently used dropped) and dropped when
  the weights move. Forwards with ControlNet residuals (a list of tensors) run eagerly. A capture error turns graphs
  off for the pipeline, with a warning. When to capture is cuda_graph.Graphs.run's policy, the same for every
  user.
- `pair(inputs, negative_embeds, negative_mask)`: batched CFG, prompt and negative prompt in one forward of batch
  2B (cfg_pairing.paired_inputs); the text-to-image loop calls it.
- `new_forward(inputs)`: the call's hook on the fast transformer's forward (forward_hook.py), for the forwards a
  diffusers loop calls: pairs "cond" and "uncond" by speculation (cfg_pairing.Speculation) when batched CFG is on.
- A model that runs its own steps (`runs_its_steps`: Qwen-Image-2.1's, whose cached steps follow host work on the
  prefix cache) finds the runner's store in the forward context (`step_graphs`, cuda_graph.CallGraphs): the same
  store, capture policy and failure policy; the call's step cache (`step_cache`, a StepCacheRun) whose pieces
  its forward runs; and with batched CFG its own speculation (`cfg_speculation`) that pairs its cached steps.
Under diffusers' step caches (transformer.enable_cache) a forward runs eagerly, its hooks deciding on the host around
the blocks (and their attention modules), unless the step cache runs it (a native rule, model/step_caches.py); with
graphs each block replays from its own graphs instead (block_graphs.py: the whole block, or three pieces around a
hooked attention module, set in the forward context as data).
What ran is recorded in the call's CallRecord (optimizations.py).
"""

import contextlib
import functools

import torch

from .block_graphs import BlockGraphs
from .cfg_pairing import Speculation, bucketed_text, paired_inputs
from .context import forward_context, get_context
from .cuda_graph import CallGraphs, Graphs, signature
from .faster_cache import FasterCacheRule, FasterCacheRun
from .forward_hook import hook_on
from .offload import has_offload_hooks
from .pyramid_broadcast import PyramidBroadcastRule, PyramidBroadcastRun
from .sea_cache import SeaCacheFailOpen, SeaCacheFailOpenRun
from .step_cache import StepCacheRun
from .taylorseer import TaylorSeerRule, TaylorSeerRun

ATTENTION_RULES = (TaylorSeerRule, PyramidBroadcastRule, FasterCacheRule)


# Graphs a pipeline keeps: a paired CFG forward, or a cond and an uncond one, per output and condition size (with a
# step cache three pieces each).
MAX_GRAPHS = 4
# Block graphs under diffusers' step caches, per block: three pieces (around a hooked attention module) for a cond
# and an uncond forward of one size.
BLOCK_GRAPHS_PER_BLOCK = 6


class Runner:
    """A pipeline's transformer forwards across its calls: the CUDA graphs it keeps."""

    def __init__(self, max_graphs: int = MAX_GRAPHS):
        self.graphs = Graphs(max_graphs)
        self.block_graphs = Graphs(shared=True)  # under diffusers' step caches (block_graphs.py)
        # the buffers an attention-level rule's graphs write (kept across calls, as the graphs), and that rule
        self.taylor_factors: dict = {}  # TaylorSeer's factors: taylorseer.py
        self.last_attention: dict = {}  # Pyramid Attention Broadcast's last outputs: pyramid_broadcast.py
        self.attention_slots: dict = {}  # FasterCache's last two outputs: faster_cache.py
        self.attention_rule = None

    @property
    def graphs_failed(self) -> str | None:
        """A capture error of either store (here or block_graphs.py): graphs stay off for this pipeline."""
        return self.graphs.failed or self.block_graphs.failed

    @contextlib.contextmanager
    def call(self, transformer, record, *, graphs: bool, pair_cfg: bool, bucket: int, attention_kwargs=None,
             step_cache=None):
        """A CallRun for one pipeline call. graphs / pair_cfg: whether CUDA graphs and batched CFG may run (the
        registry's plan); bucket: FastConfig.text_bucket; attention_kwargs: the call's, for a stock transformer;
        step_cache: the step cache's rule when one runs (FastConfig.cache, a DBCache, or the native rule of an
        enabled diffusers cache: model/step_caches.py), else None."""
        if self.graphs_failed:  # neither store keeps a graph (a block graph's failure empties its own store only)
            self.graphs.clear()
            self.block_graphs.clear()
        graphs = graphs and self.graphs_failed is None
        if graphs:
            self.graphs.drop_if_weights_moved(transformer)
            self.graphs.max_graphs = MAX_GRAPHS * (3 if step_cache else 1)
            if transformer.is_cache_enabled and step_cache is None:
                self.block_graphs.drop_if_weights_moved(transformer)
                self.block_graphs.max_graphs = BLOCK_GRAPHS_PER_BLOCK * len(transformer.transformer_blocks)
        rule = step_cache if isinstance(step_cache, ATTENTION_RULES) else None
        if rule != self.attention_rule:  # another rule (or none): its buffers go, with the graphs that wrote them
            self.taylor_factors.clear()
            self.last_attention.clear()
            self.attention_slots.clear()
            if self.attention_rule is not None:
                self.graphs.clear()
            self.attention_rule = rule
        if isinstance(step_cache, TaylorSeerRule):
            step_cache = TaylorSeerRun(step_cache, self.taylor_factors)
        elif isinstance(step_cache, PyramidBroadcastRule):
            step_cache = PyramidBroadcastRun(step_cache, self.last_attention)
        elif isinstance(step_cache, FasterCacheRule):
            step_cache = FasterCacheRun(step_cache, self.attention_slots,
                                        [block.attn for block in transformer.transformer_blocks])
        elif isinstance(step_cache, SeaCacheFailOpen):
            step_cache = SeaCacheFailOpenRun(step_cache, transformer)
        elif step_cache is not None:
            step_cache = StepCacheRun(step_cache, len(transformer.transformer_blocks))
        run = CallRun(self, transformer, record, graphs=graphs, pair_cfg=pair_cfg, bucket=bucket,
                      attention_kwargs=attention_kwargs or {}, step_cache=step_cache)
        # a model that runs its own steps (Qwen-Image-2.1's) graphs them with the runner's store, and runs the step
        # cache's pieces itself
        own_steps = getattr(transformer, "runs_its_steps", False)
        own_speculation = transformer.cfg_speculation() if pair_cfg and own_steps else None
        with forward_context(record=record, step_graphs=run.call_graphs if graphs and own_steps else None,
                             step_cache=run.step_cache if own_steps else None, cfg_speculation=own_speculation), \
                hook_on(transformer, run) if run.fused else contextlib.nullcontext():
            yield run
        for speculation in (run.speculation, own_speculation):  # the timesteps it answered for (cfg_pairing.py)
            if speculation is not None:
                speculation.verify()


class CallRun:
    """The transformer forwards of one pipeline call (see the module docstring)."""

    def __init__(self, runner: Runner, transformer, record, *, graphs: bool, pair_cfg: bool, bucket: int,
                 attention_kwargs: dict, step_cache=None):
        self.runner, self.transformer, self.record = runner, transformer, record
        self.fused = hasattr(transformer, "compute")  # FastQwenImageTransformer; else a stock model
        # a diffusers cache whose decisions the step cache makes runs as one (model/step_caches.py, native_rule)
        self.diffusers_hooks = self.fused and transformer.is_cache_enabled and step_cache is None
        # offload hooks (model / group offload) and diffusers' step caches wrap the module's forward (the weights
        # come in through it; a cache's hooks on the transformer itself run there)
        self.hooked = self.fused and (has_offload_hooks(transformer) or self.diffusers_hooks)
        self.step_cache = step_cache
        self.graphs, self.pair_cfg, self.bucket = graphs and self.fused, pair_cfg, bucket
        self.attention_kwargs = attention_kwargs
        self.seen: set[tuple] = set()  # signatures run eagerly in this call
        self.call_graphs = CallGraphs(runner.graphs, self.seen)
        self.speculation = Speculation() if pair_cfg and self.fused else None

    def forward(self, context: str, **inputs) -> torch.Tensor:
        """One forward (the transformer's `forward` arguments, `modulation` too for the fused one) -> [B, L, C]."""
        return self._forward(context, inputs, onload=True)

    def _forward(self, context: str, inputs: dict, onload: bool, text_lengths: tuple | None = None) -> torch.Tensor:
        """onload: the forward has not been through the module's own call yet (the text-to-image loop's); where the
        module has offload hooks, it goes through it then (the hooks bring the weights in), computing without
        coming back here (no hook). False where a diffusers loop's call of the module brought it here.
        text_lengths: a paired forward's two prompt lengths before padding (else its text's)."""
        if not self.fused:  # diffusers' model: its own forward, under the cache_context a diffusers loop sets
            if inputs.pop("modulation", None) is not None:
                raise ValueError("modulation= is an argument of the fused transformer only")
            with self.transformer.cache_context(context):
                return self.transformer(**inputs, attention_kwargs=self.attention_kwargs, return_dict=False)[0]
        for name, value in self.transformer.running():
            self.record.add(name, value)
        blocks, rows = len(self.transformer.transformer_blocks), inputs["hidden_states"].shape[0]
        if self.diffusers_hooks:  # each block the hooks let run counts itself
            self.record.add("step_cache", self.transformer.step_cache_name)
            self.record.count_blocks(0, blocks * rows)
        # under a diffusers cache's hooks, blocks replay from graphs (block_graphs.py); no graph of a whole forward
        blocks_graphed = (BlockGraphs(self.runner.block_graphs, self.seen, self.transformer.lora_key())
                          if self.graphs and self.diffusers_hooks else None)
        if onload and self.hooked:  # no graphs under offload hooks (the registry's plan)
            with hook_on(self.transformer, None), forward_context(block_graphs=blocks_graphed), \
                    self.transformer.cache_context(context):
                return self.transformer(**inputs, attention_kwargs={"scale": get_context().lora_scale},
                                        return_dict=False)[0]
        with forward_context(cache_name=context, block_graphs=blocks_graphed):
            graphs = self.graphs and not blocks_graphed and inputs["controlnet_block_samples"] is None
            text_lengths = text_lengths or (inputs["encoder_hidden_states"].shape[1],)  # before any padding
            inputs = bucketed_text(inputs, self.bucket) if graphs else inputs
            names = ["cond", "uncond"] if context == "cond_uncond" else [context or "cond"]
            if isinstance(self.step_cache, (TaylorSeerRun, PyramidBroadcastRun, FasterCacheRun)):  # every block
                # runs, its attention computed, or predicted / reused
                hidden, text = inputs["hidden_states"], inputs["encoder_hidden_states"]
                run = functools.partial(self._attention_rule, graphs, inputs, tuple(names))
                if isinstance(self.step_cache, TaylorSeerRun):  # factors per branches and shape
                    key = (tuple(names), tuple(hidden.shape), tuple(text.shape), hidden.dtype)
                    out, _ = self.step_cache.forward(run, inputs, names, key)
                else:  # the last outputs per shape of one branch's rows, shared by the branches
                    key = (rows // len(names), *hidden.shape[1:], *text.shape[1:], hidden.dtype)
                    out, _ = self.step_cache.forward(run, inputs, names, key, text_lengths)
                self.record.add("step_cache", self.step_cache.rule.label())
                self.record.count_blocks(blocks * rows, blocks * rows)
                return out
            fail_open = isinstance(self.step_cache, SeaCacheFailOpenRun)  # the plain forward, past SeaCache's hooks
            if fail_open:
                self.step_cache.check(names)
                self.record.add("step_cache", self.step_cache.rule.label())
            elif self.step_cache is not None:
                with forward_context(past_hooks=self.transformer.is_cache_enabled):
                    out, computes = self.step_cache.forward(functools.partial(self._piece, graphs), inputs, names)
                config, per_row = self.step_cache.config, rows // len(names)
                self.record.add("step_cache", config.label())
                self.record.count_blocks(sum((blocks if c else config.Fn + config.Bn) * per_row for c in computes),
                                         blocks * rows)
                return out
            if not self.diffusers_hooks:
                self.record.count_blocks(blocks * rows, blocks * rows)
            with forward_context(past_hooks=fail_open):
                if not graphs:
                    return self.transformer.compute(**inputs)
                return self._graphed(inputs, self.transformer.compute)

    def _piece(self, graphs: bool, name: str, inputs: dict, start: int = 0, stop: int = 0, **tensors):
        """One piece of a step-cached forward (transformer.front / middle / back), graphed like a whole forward."""
        piece = functools.partial(getattr(self.transformer, name), **({"start": start} if name != "front" else {}),
                                  **({"stop": stop} if name != "back" else {}))
        if not graphs:
            return piece(**inputs, **tensors)
        return self._graphed(inputs | tensors, piece, (name, start, stop))

    def _attention_rule(self, graphs: bool, inputs: dict, names: tuple, variant: tuple,
                        scalars: torch.Tensor | None, block_cache):
        """One forward of the branches `names` under an attention-level rule (taylorseer.py, pyramid_broadcast.py),
        graphed per variant (TaylorSeer: "update" / "predict" and orders; PAB: each branch's decision) and branches
        (whose buffers it writes) like a whole forward; its scalars (TaylorSeer's delta or coefficients) are an
        input of the graph."""
        def compute(rule_scalars, **inputs):
            caches = tuple(block_cache(i, rule_scalars) for i in range(len(self.transformer.transformer_blocks)))
            with forward_context(attention_cache=caches, past_hooks=self.transformer.is_cache_enabled):
                return self.transformer.compute(**inputs)

        if not graphs:
            return compute(scalars, **inputs)
        return self._graphed(inputs | dict(rule_scalars=scalars), compute,
                             (self.step_cache.rule.kind, names) + tuple(variant))

    def _graphed(self, inputs: dict, compute, piece: tuple = ()):
        """compute(**inputs), from a graph of the runner's from the second time its key runs (CallGraphs.run); after
        a failed capture the call's later forwards run eagerly, unpadded."""
        out = self.call_graphs.run((signature(inputs), self.transformer.lora_key(), piece), inputs, compute)
        if self.runner.graphs.failed:
            self.graphs = False
            self.runner.block_graphs.clear()
        return out

    def pair(self, inputs: dict, negative_embeds: torch.Tensor, negative_mask: torch.Tensor | None,
             modulation: torch.Tensor | None = None, onload: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Batched CFG: (prompt half, negative half) of one forward of batch 2B."""
        batch = inputs["hidden_states"].shape[0]
        out = self._forward("cond_uncond", paired_inputs(inputs, negative_embeds, negative_mask, modulation), onload,
                            text_lengths=(inputs["encoder_hidden_states"].shape[1], negative_embeds.shape[1]))
        self.record.add("batched_cfg")
        return out[:batch], out[batch:]

    def new_forward(self, inputs: dict) -> torch.Tensor:
        """The fast transformer's forward while this call's hook is on it (forward_hook.py): a forward a diffusers
        loop made (under its cache_context), paired by speculation when batched CFG is on."""
        context = get_context().cache_name  # the loop's call of the module went through its offload hooks
        if self.speculation is None:
            return self._forward(context, inputs, onload=False)
        return self.speculation(lambda inputs: self._forward(context, inputs, onload=False),
                                lambda inputs, negative: self.pair(inputs, negative["encoder_hidden_states"],
                                                                   negative["encoder_hidden_states_mask"],
                                                                   onload=False),
                                context, inputs, self.transformer.lora_key())
