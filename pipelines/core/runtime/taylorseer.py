"""diffusers' TaylorSeerCacheConfig (diffusers/hooks/taylorseer_cache.py) run by the fast pipeline's call instead of
its hooks (model/step_caches.py says when): the same decisions and the same arithmetic, on whole forwards.

diffusers hooks every block's attention module (`transformer_blocks.<i>.attn`, its default pattern); each keeps, per
cache_context, a step counter and Taylor factors of its outputs (the image and text attention outputs after the
output projections). A step computes (warm-up, every cache_interval-th step after it, cool-down) and updates the
factors, or predicts the outputs from them. Every module counts the same steps, so a forward decides once:
- update: the blocks run as usual and each attention output o refreshes its factors:
  f0 <- o, f1 <- (o - f0_prev) / delta, f2 <- (f1_new - f1_prev) / delta ... (delta: steps since the last update),
  up to max_order and to the orders the last update left; stored in taylor_factors_dtype (one pass over o and
  the factors: kernels/taylor_factors.py);
- predict: each block takes o = sum_j f_j * offset^j / j! (offset: steps since the last update) instead of its
  attention, and skips what only attention reads (the first LayerNorm + modulation, the QKV GEMMs): the residual
  streams are what diffusers' block gives. The sum's last term and the previous block's pending MLP add are
  summed inside the kernel that adds o to the residual (PendingTerm; kernels/residual_gate.py).
The factors live in buffers the pipeline's runner keeps per (branches, forward signature), written in place, and
the per-step numbers (delta, the coefficients) are device scalars: so each variant of a forward (update with k
orders, predict with k) is one CUDA graph. A paired CFG forward holds both branches' rows: each branch has its own
counters, which advance alike (the plan runs this only where every forward of a call has the same branches).
"""

import math
from dataclasses import dataclass, field

import torch

from ....kernels.taylor_factors import taylor_factors_update
from .cuda_graph import read_by_graph


@dataclass(frozen=True)
class TaylorSeerRule:
    """The settings of a TaylorSeerCacheConfig this module runs (its default pattern: every attention module)."""

    cache_interval: int
    disable_cache_before_step: int
    disable_cache_after_step: int | None
    max_order: int
    factors_dtype: torch.dtype | None

    @classmethod
    def of(cls, config) -> "TaylorSeerRule":
        return cls(config.cache_interval, config.disable_cache_before_step, config.disable_cache_after_step,
                   config.max_order, config.taylor_factors_dtype)

    kind = "taylorseer"  # optimizations.Facts.cache_rule

    def label(self) -> str:
        return "TaylorSeerCacheConfig"

    def computes(self, step: int) -> bool:
        """TaylorSeerCacheHook._measure_should_compute at counter value `step`."""
        warmup = step < self.disable_cache_before_step
        interval = (step - self.disable_cache_before_step - 1) % self.cache_interval == 0
        cooldown = self.disable_cache_after_step is not None and step >= self.disable_cache_after_step
        return warmup or interval or cooldown


@dataclass
class Branch:
    """One CFG branch's counters (TaylorSeerState's, equal for every module)."""

    step: int = -1
    last_update: int | None = None
    orders: int = 0  # factors stored: f0 .. f_{orders-1}
    key: tuple | None = None  # the (branches, signature) whose buffers hold them
    decisions: list = field(default_factory=list)  # per step: computed (True) or predicted


class Factors:
    """The Taylor factors of one kind of forward, per block and stream: [max_order + 1, rows, L, D], f_j in slot j."""

    def __init__(self):
        self.tensors: dict[tuple[int, str], torch.Tensor] = {}


@dataclass
class PendingTerm:
    """An attention output x + f * c[0] (diffusers' last `output + factor * coeff` of a prediction) not yet summed:
    FastBlock.post adds it inside the residual kernel that reads it (kernels/residual_gate.py's x_term)."""

    x: torch.Tensor  # [B, L, D]: the lower orders' sum
    f: torch.Tensor  # [B, L, D]: the last factor, in x's dtype
    c: torch.Tensor  # fp32 [1]: its coefficient offset^j / j!


@dataclass
class BlockCache:
    """What one block of a forward does with its attention (FastBlock.forward reads it): `predict` (img, txt) or
    None to compute them, then `update(img, txt)`."""

    factors: Factors
    index: int
    mode: str  # "update" or "predict"
    orders: int  # update: factors stored before (0 the first time); predict: factors to sum
    scalars: torch.Tensor  # update: [delta]; predict: [coefficient of order j]
    factors_dtype: torch.dtype | None  # None: the outputs' dtype
    dtype: torch.dtype  # the outputs' (the model's)
    slots: int  # max_order + 1

    @property
    def reads_no_inputs(self) -> bool:
        return self.mode == "predict"

    def outputs(self, attend, batch: int, text_out: bool) -> tuple:
        """(img, txt) attention outputs (txt None when not text_out): predicted (each a tensor or a PendingTerm), or
        attend(rows) of every row, stored."""
        if self.mode == "predict":
            return self._predict("img"), self._predict("txt") if text_out else None
        out = attend(slice(None))
        self.update(*out)
        return out

    def _predict(self, stream: str) -> "torch.Tensor | PendingTerm":
        """The predicted output: the sum itself for one factor, else the sum of all but the last order with the
        last term pending (the block's residual kernel adds it: one pass over the rows instead of three)."""
        stack = self.factors.tensors[(self.index, stream)]
        read_by_graph(stack)  # the runner's buffer, which a graph of this forward reads
        factors = [f if f.dtype == self.dtype else f.to(self.dtype) for f in stack[:self.orders]]
        out = factors[0]  # f0 * 0! / 0! is f0
        for j in range(1, self.orders - 1):
            out = out + factors[j] * self.scalars[j]
        if self.orders == 1:
            return out
        return PendingTerm(out, factors[-1], self.scalars[self.orders - 1:self.orders])

    def update(self, img: torch.Tensor, txt: torch.Tensor | None):
        self._update("img", img)
        if txt is not None:  # the last block's text output: diffusers discards it, the fast block skips it
            self._update("txt", txt)

    def _update(self, stream: str, out: torch.Tensor):
        stack = self.factors.tensors.get((self.index, stream))
        if stack is None:  # the first update (orders 0), eager: a graph captures the variant at a later use
            stack = torch.empty((self.slots, *out.shape), dtype=self.factors_dtype or out.dtype, device=out.device)
            self.factors.tensors[(self.index, stream)] = stack
        read_by_graph(stack)  # the runner's buffer, which a graph of this forward writes
        # self.orders: the orders the last update left, up to max_order
        taylor_factors_update(out, stack, self.orders, self.scalars)


class TaylorSeerRun:
    """The TaylorSeer cache of one pipeline call: the branches' counters; its factor buffers are the runner's."""

    def __init__(self, rule: TaylorSeerRule, buffers: dict):
        self.rule, self.buffers = rule, buffers
        self.branches: dict[str, Branch] = {}

    def forward(self, run, inputs: dict, names: list[str], key: tuple) -> tuple[torch.Tensor, list[bool]]:
        """One forward of `names`' branches (key: its (branches, signature)). run(variant, scalars, block_cache)
        runs the whole forward with block_cache(i, scalars) telling block i what to do (scalars: the forward's
        copy of `scalars`, a graph's static one when graphed). Returns (output, per branch whether it computed)."""
        rule = self.rule
        branches = [self.branches.setdefault(name, Branch()) for name in names]
        for b in branches:
            b.step += 1
        b = branches[0]
        if any((x.step, x.last_update, x.orders, x.key) != (b.step, b.last_update, b.orders, b.key) for x in branches):
            raise ValueError(f"TaylorSeer: the branches {names} of one forward have not run the same steps "
                             "(a call whose forwards change branches runs diffusers' hooks instead)")
        computes = rule.computes(b.step)
        if b.last_update is not None and b.key != key:
            raise ValueError(f"TaylorSeer: branch {names[0]!r} changed its forward's shape between steps (the "
                             "factors are per shape); a call whose forwards change shape runs diffusers' hooks instead")
        factors = self.buffers.setdefault(key, Factors())
        device = inputs["hidden_states"].device
        if computes:
            orders = 0 if b.last_update is None else min(b.orders, rule.max_order)
            delta = 1 if b.last_update is None else b.step - b.last_update
            scalars = torch.tensor([float(delta)], device=device)
            mode, after = "update", min(orders + 1, rule.max_order + 1)
        else:
            if b.last_update is None:
                raise ValueError("Cannot predict without prior initialization/update.")  # diffusers' error
            offset = b.step - b.last_update
            orders, mode, after = b.orders, "predict", b.orders
            scalars = torch.tensor([offset ** j / math.factorial(j) for j in range(orders)], device=device)
        dtype = inputs["hidden_states"].dtype
        out = run((mode, orders), scalars, lambda i, scalars: BlockCache(factors, i, mode, orders, scalars,
                                                                         rule.factors_dtype, dtype, rule.max_order + 1))
        for x in branches:
            x.decisions.append(computes)
            if computes:
                x.last_update, x.orders, x.key = x.step, after, key
        return out, [computes] * len(names)
