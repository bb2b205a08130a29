"""The fast pipeline's step cache: cache-dit's DBCache rule (config.DBCache) on the fused transformer, and diffusers'
FirstBlockCacheConfig run the same way (FirstBlockRule: its decisions, our pieces; model/step_caches.py says when).

A forward runs in three pieces, each a CUDA graph when graphs are on (the runner captures and replays them like
whole forwards, runner.py):
    front:  the embeddings and blocks [0, Fn)            -> img, txt, r = img - img_in(hidden_states)
    middle: blocks [Fn, N - Bn) on (img, txt)            -> mid_img, mid_txt   (only when a branch computes)
    back:   blocks [N - Bn, N), norm_out and proj_out    -> the forward's output
Between them, on the host: each CFG branch (the rows of "cond" and of "uncond" in a paired forward) decides from r
whether its middle runs (one device-to-host read of its residual difference per step, none during the warm-up or on
a fixed schedule); a branch that runs it stores its residuals (mid - front) and r; one that does not adds its stored
residuals to the front's output instead, or with DBCache(taylorseer=n) their Taylor extrapolation (TaylorSeer).
Each branch decides as it would in a forward of its own. Qwen-Image-2.1's single-stream model runs the same pieces
itself (qwen_image21/model.py: no text stream, txt None; its prefill keeps the target's rows of its residuals, which
its later steps compute alone).
"""

import math
from dataclasses import dataclass, field

import torch

from ..config import DBCache, check_cache_blocks


class TaylorSeer:
    """cache-dit's TaylorSeer calibrator of order n on one branch's cached residuals (its TaylorSeerState, one per
    stream, updated together): each step advances `step`; a step that runs the middle updates the derivatives
    d_0 = y, d_{i+1} = (d_i - d_i of the previous update) / (steps since it) (only from step 2 on, as cache-dit's
    `current_step > 1`); a cached step adds sum_i d_i * elapsed^i / i!, elapsed the steps since the last update.
    In the residual's dtype, in cache-dit's order of operations."""

    def __init__(self, order: int):
        self.order, self.step, self.last = order, -1, -1
        self.current: dict[str, list] = {"img": [None] * (order + 1), "txt": [None] * (order + 1)}

    def update(self, stream: str, y: torch.Tensor):
        previous, derivatives = self.current[stream], [y] + [None] * self.order
        for i in range(self.order):
            if previous[i] is None or self.step <= 1:
                break
            derivatives[i + 1] = (derivatives[i] - previous[i]) / (self.step - self.last)
        self.current[stream] = derivatives

    def approximate(self, stream: str) -> torch.Tensor:
        elapsed, out = self.step - self.last, 0
        for i, derivative in enumerate(self.current[stream]):
            if derivative is None:
                break
            out = out + (1 / math.factorial(i)) * derivative * (elapsed ** i)
        return out


@dataclass
class Branch:
    """One CFG branch's cache across the steps of a call."""

    step: int = 0  # forwards of this branch so far
    ref: torch.Tensor | None = None  # r of the last step that ran the middle [B, L_img, D]
    res_img: torch.Tensor | None = None  # that step's mid_img - img [B, L_img, D]
    res_txt: torch.Tensor | None = None  # ... mid_txt - txt [B, L_txt, D] (L_txt of that forward)
    cached: int = 0
    consecutive: int = 0
    decisions: list = field(default_factory=list)  # per step: (computed, relative difference or None)
    taylor: TaylorSeer | None = None  # DBCache(taylorseer=n)


def relative_l1(r: torch.Tensor, ref: torch.Tensor) -> float:
    """cache-dit's residual difference mean|ref - r| / mean|ref| (here in fp32)."""
    ref, r = ref.float(), r.float()
    return ((ref - r).abs().mean() / ref.abs().mean()).item()


@dataclass(frozen=True)
class FirstBlockRule:
    """diffusers' FirstBlockCacheConfig(threshold) as diffusers/hooks/first_block_cache.py decides it, in this
    module's terms: Fn=1, Bn=0, no warm-up or limits; the rest of the blocks run unless
    mean|r - r_prev| / mean|r_prev| <= threshold (strictly greater runs, where DBCache runs from equal), computed in
    r's dtype as its FBCHeadBlockHook does; r_prev that of the last step that ran them."""

    threshold: float
    Fn: int = 1
    Bn: int = 0

    kind = "first_block"  # optimizations.Facts.cache_rule

    def label(self) -> str:
        return "FirstBlockCacheConfig"


def first_block_difference(r: torch.Tensor, ref: torch.Tensor) -> float:
    """FBCHeadBlockHook's difference: its operations in its order, in r's dtype."""
    return ((r - ref).abs().mean() / ref.abs().mean()).item()


def decide(config: DBCache | FirstBlockRule, branch: Branch, r: torch.Tensor) -> bool:
    """Whether this step of `branch` runs the middle blocks, r its residual over the first Fn blocks; advances the
    branch's counters and logs the decision."""
    step, diff = branch.step, None
    branch.step += 1
    if isinstance(config, FirstBlockRule):
        compute = branch.ref is None or (diff := first_block_difference(r, branch.ref)) > config.threshold
    elif step < config.warmup or branch.ref is None:
        compute = True
    elif config.every:
        compute = (step - config.warmup) % config.every == 0
    elif 0 <= config.max_cached <= branch.cached or 0 <= config.max_consecutive <= branch.consecutive:
        compute = True
    elif config.threshold >= 1.0:  # cache-dit's: a threshold of 1 or more takes every step as similar, unmeasured
        compute = False
    elif branch.ref.shape != r.shape:
        compute = True
    else:
        diff = relative_l1(r, branch.ref)
        compute = not diff < config.threshold
    if compute:
        branch.consecutive = 0
    else:
        branch.cached += 1
        branch.consecutive += 1
    branch.decisions.append((compute, diff))
    return compute


def fit(res: torch.Tensor, length: int) -> torch.Tensor:
    """A stored text residual [B, L, D] for a forward of `length` text tokens: the rows past a prompt's own tokens
    are masked padding (cfg_pairing.py), so it is cut or zero-padded there."""
    if res.shape[1] >= length:
        return res[:, :length]
    return torch.cat([res, res.new_zeros(res.shape[0], length - res.shape[1], res.shape[2])], dim=1)


class StepCacheRun:
    """The DBCache of one pipeline call: its branches' states and how a forward runs with it."""

    def __init__(self, config: DBCache | FirstBlockRule, n_blocks: int):
        check_cache_blocks(config.Fn, config.Bn, n_blocks)
        self.config, self.n_blocks = config, n_blocks
        self.branches: dict[str, Branch] = {}

    def forward(self, piece, inputs: dict, names: list[str], kept: slice = slice(None)) -> tuple[torch.Tensor, list[bool]]:
        """One forward whose batch is `names`' branches in equal parts (["cond", "uncond"] for a paired one).
        piece(name, inputs, **tensors) runs a piece (the runner: eagerly or graphed; a single-stream model's pieces
        return txt None). kept: the rows of the image stream a branch stores (Qwen-Image-2.1's prefill stores its
        target's, which its later steps compute alone). Returns (output, per branch whether its middle ran)."""
        config, n = self.config, self.n_blocks
        img, txt, r = piece("front", inputs, stop=config.Fn)
        rows = img.shape[0] // len(names)
        parts = [slice(k * rows, (k + 1) * rows) for k in range(len(names))]
        branches = [self.branches.setdefault(name, Branch()) for name in names]
        for branch in branches:
            if getattr(config, "taylorseer", 0) and branch.taylor is None:
                branch.taylor = TaylorSeer(config.taylorseer)
            if branch.taylor is not None:
                branch.taylor.step += 1
        computes = [decide(config, b, r[p]) for b, p in zip(branches, parts)]
        if any(computes):
            mid_img, mid_txt = piece("middle", inputs, img=img, txt=txt, start=config.Fn, stop=n - config.Bn)
        imgs, txts = [], []
        for branch, p, compute in zip(branches, parts, computes):
            taylor = branch.taylor
            if compute:
                branch.res_img = (mid_img[p] - img[p])[:, kept]
                branch.res_txt = None if txt is None else mid_txt[p] - txt[p]
                branch.ref = r[p]
                if taylor is not None:
                    taylor.update("img", branch.res_img)
                    if txt is not None:
                        taylor.update("txt", branch.res_txt)
                    taylor.last = taylor.step
                imgs.append(mid_img[p])
                txts.append(None if txt is None else mid_txt[p])
            else:
                res_img = taylor.approximate("img") if taylor is not None else branch.res_img
                imgs.append(img[p] + res_img)
                if txt is not None:
                    res_txt = taylor.approximate("txt") if taylor is not None else branch.res_txt
                    txts.append(txt[p] + fit(res_txt, txt.shape[1]))
        img = imgs[0] if len(names) == 1 else torch.cat(imgs)
        txt = None if txt is None else txts[0] if len(names) == 1 else torch.cat(txts)
        out = piece("back", inputs, img=img, txt=txt, start=n - config.Bn)
        return out, computes
