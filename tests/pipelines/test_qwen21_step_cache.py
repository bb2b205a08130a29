"""FastConfig(cache=...) on Qwen-Image-2.1 (pipelines/qwen_image21/model.py's pieces under the runner's StepCacheRun):
the decisions and latents equal the rule's plain-PyTorch reference on the stock transformer's own blocks
(test_step_caches.py's ReferenceDBCache: cache-dit's similarity and TaylorSeer calibrator) through the stock
QwenImage21Pipeline's loop, per CFG branch, with the prefix KV cache on and off, eagerly and from graphs; every
block's prefix keys and values stay its own and its branch's. diffusers' enable_cache configs: TaylorSeerCacheConfig
on its default pattern runs stock's own hooks on the fast blocks' `attn` (against stock); the others refused as
stock refuses them on 2.1, or saying what runs instead."""

from dataclasses import replace

import pytest
import torch
from helpers import assert_close, rel_rms_error
from test_qwen21 import latents, tiny_pipeline
from test_step_caches import ReferenceDBCache

from qwen_image_fast import FastConfig, optimize
from qwen_image_fast.pipelines.core.config import DBCache

# the tiny model's random weights make its residuals change by ~100% a step: a threshold of 0.9 skips 1 step in 8
BLOCKS, STEPS = 4, 8
RULES = {"threshold": DBCache(Fn=1, Bn=1, threshold=0.9, warmup=1, max_consecutive=1),
         "every2-taylorseer": DBCache.parse("every:2,1,1,w=1,ts=1"),
         # no warm-up: step 1 reuses the prefill's residuals (of the target's rows: the prefill kept them)
         "every3": DBCache.parse("every:3,1,1")}


class Wrapped21(torch.nn.Module):
    """A stock Qwen-Image-2.1 block under ReferenceDBCache: one stream; the residual r over the first Fn blocks, and
    the decision, on the target's rows (the last T of a prefill's joint sequence, all of a cached step's); a
    prefill (kv_cache_mode "extract") keeps its target rows' residual, which the cached steps after it reuse."""

    def __init__(self, cache: ReferenceDBCache, index: int, block):
        super().__init__()
        self.cache, self.index, self.block = [cache], index, block

    @property
    def attn(self):  # the stock forward reads each block's attention processor
        return self.block.attn

    def forward(self, hidden_states, **kwargs):
        cache, i = self.cache[0], self.index
        c, last_middle = cache.config, cache.n - cache.config.Bn - 1
        target_rows = kwargs["target_token_mask"]
        target = int(target_rows.sum())
        assert target_rows[-target:].all(), "the target's tokens are the last rows"
        if i == 0:
            cache.embedded = hidden_states
        if c.Fn <= i <= last_middle and not cache.compute:
            if i < last_middle:
                return hidden_states
            s = cache.states[cache.branch]
            return cache.front + (s["calibrator"].approximate("img") if c.taylorseer else s["res_img"])
        out = self.block(hidden_states=hidden_states, **kwargs)
        if i == c.Fn - 1:
            cache.front, cache.r = out, (out - cache.embedded)[:, -target:]
            cache.compute = cache.decide(cache.r)
        if i == last_middle and cache.compute:
            s = cache.states[cache.branch]
            residual = out - cache.front
            s["res_img"] = residual[:, -target:] if kwargs["kv_cache_mode"] == "extract" else residual
            s["ref"] = cache.r
            if c.taylorseer:
                s["calibrator"].update(s["res_img"], name="img")
        return out


def reference_run(rule: str, **call) -> tuple[torch.Tensor, dict]:
    """Stock's latents under the reference rule, and its decisions by branch."""
    stock = tiny_pipeline(num_layers=BLOCKS)
    reference = ReferenceDBCache(stock.transformer, RULES[rule], wrapper=Wrapped21)
    expected = latents(stock, **call)
    assert any(not computed for _, computed in reference.log), "the rule skipped nothing here"
    return expected, {name: [c for branch, c in reference.log if branch == name] for name in ("cond", "uncond")}


def decisions(pipe) -> dict:
    return {name: [c for c, _ in branch.decisions] for name, branch in pipe._last_step_cache.branches.items()}


@pytest.mark.parametrize("use_kv_cache", [True, False], ids=["prefix-cache", "no-prefix-cache"])
@pytest.mark.parametrize("rule", list(RULES))
def test_step_cache_decides_and_computes_as_its_reference(rule, use_kv_cache):
    """fp32, FP8 off, CFG (a branch per cache_context), two prompts of different lengths: the same decisions and
    latents (1e-5) as the reference on stock; blocks_computed and applied say what ran; the uncached call differs."""
    config, call = RULES[rule], dict(num_inference_steps=STEPS, use_kv_cache=use_kv_cache)
    expected, branches = reference_run(rule, **call)
    fast = optimize(tiny_pipeline(num_layers=BLOCKS), FastConfig(fp8=False, cache=config))
    assert_close(latents(fast, **call), expected, 1e-5, f"{rule} use_kv_cache={use_kv_cache}")
    assert decisions(fast) == branches
    ran = sum(BLOCKS if c else config.Fn + config.Bn for name in branches for c in branches[name])
    assert fast.blocks_computed == ran / (BLOCKS * 2 * STEPS)
    assert f"step_cache:{config.label()}" in fast.applied, fast.applied
    fast.fast_config = fast.fast_config.replace(cache=None)
    uncached = latents(fast, **call)
    assert fast.blocks_computed == 1.0 and not any(x.startswith("step_cache") for x in fast.applied)
    assert rel_rms_error(uncached, expected) > 1e-4, "the step cache changed nothing: the test would not see it"


def test_step_cached_pieces_replay_from_graphs_across_calls(stand_in_graphs):
    """CUDA graphs (the stand-in for capture): a cached step's three pieces (front, middle, back) are each captured
    at their second use per branch and replayed; the next call replays them all; both calls equal the reference.
    every:2 with one warm-up step over 8 steps: the middle runs at steps 0 (the prefill), 1, 3, 5 and 7."""
    call = dict(num_inference_steps=STEPS, use_kv_cache=True)
    expected, branches = reference_run("every2-taylorseer", **call)
    assert branches["cond"] == [True, True, False, True, False, True, False, True], branches
    fast = optimize(tiny_pipeline(num_layers=BLOCKS), FastConfig(fp8=False, cache=RULES["every2-taylorseer"]))
    for n in range(2):
        captures, replays = len(stand_in_graphs["captures"]), len(stand_in_graphs["replays"])
        assert_close(latents(fast, **call), expected, 1e-5, f"call {n}")
        assert decisions(fast) == branches and "cuda_graphs" in fast.applied, fast.applied
        # per branch, 7 cached steps: front and back 7 times, the middle 4; call 0 runs each piece eagerly once
        assert len(stand_in_graphs["captures"]) - captures == (2 * 3 if n == 0 else 0), stand_in_graphs
        assert len(stand_in_graphs["replays"]) - replays == 2 * (6 + 3 + 6 if n == 0 else 7 + 4 + 7)


def test_a_step_cache_leaves_every_blocks_prefix_as_its_branchs_prefill_wrote_it():
    """After a call with the step cache, each block's prefix keys and values, in the cond and the uncond slot, are
    bit for bit those of the same call without it (the prefill runs every block; a cached step writes only the
    target's rows of the blocks it runs), and the two branches' buffers are their own (other memory, other
    prefixes: the negative prompt's)."""
    call = dict(num_inference_steps=STEPS, use_kv_cache=True)
    plain = optimize(tiny_pipeline(num_layers=BLOCKS), FastConfig(fp8=False))
    cached = optimize(tiny_pipeline(num_layers=BLOCKS), FastConfig(fp8=False, cache=RULES["every2-taylorseer"]))
    latents(plain, **call)
    latents(cached, **call)
    assert not all(decisions(cached)["cond"])
    target = {layout.target for layout in cached.transformer.layouts.values()}.pop()

    def slots(pipe) -> dict:
        return {key[0]: buffers for key, (_, buffers, _) in pipe.transformer.prefix_cache.slots.items()}

    got, want = slots(cached), slots(plain)
    assert sorted(got) == ["cond", "uncond"] == sorted(want)
    for branch in got:
        for block, (kv, kv_plain) in enumerate(zip(got[branch], want[branch])):
            for t, t_plain in zip(kv, kv_plain):  # [B, T + P, H, D] in the [target, prefix] order
                assert torch.equal(t[:, target:], t_plain[:, target:]), (branch, block)
    for block in range(BLOCKS):
        cond, uncond = got["cond"][block][0], got["uncond"][block][0]
        assert cond.data_ptr() != uncond.data_ptr() and not torch.equal(cond[:, target:], uncond[:, target:])


def test_a_rule_deeper_than_the_model_is_refused_when_set():
    """Fn + Bn must leave a middle block (the tiny model has 2): refused at optimize and at pipe.fast_config = ...,
    before anything is converted."""
    source = tiny_pipeline()
    with pytest.raises(ValueError, match=r"Fn=1 \+ Bn=1 leaves no middle block to cache in the transformer of 2"):
        optimize(source, FastConfig(fp8=False, cache=DBCache(Fn=1, Bn=1)))
    assert type(source.transformer).__name__ == "QwenImage21Transformer2DModel"
    fast = optimize(source, FastConfig(fp8=False))
    with pytest.raises(ValueError, match="leaves no middle block"):
        fast.fast_config = fast.fast_config.replace(cache="every:2,1,1")
    assert fast.fast_config.cache is None


@pytest.mark.gpu
def test_step_cached_pieces_replay_real_graphs_on_gpu():
    """Real CUDA graphs: the tiny pipeline with CFG and every:2,1,0 (4 steps: the middle at steps 0 and 2) renders
    the same latents with graphs as without, bit for bit, in two calls in a row, with the same decisions; the
    runner keeps each branch's front and back (the middle runs once a call after the prefill: eagerly, as a key's
    first forward in a call always does)."""
    from diffusers import QwenImage21Pipeline

    from qwen_image_fast.pipelines.tiny import tiny_qwen21_components

    call = dict(prompt=["a cat", "a large dog in the park"], negative_prompt=["blurry", "dark"], true_cfg_scale=2.0,
                height=64, width=64, num_inference_steps=4, output_type="latent")

    def run(pipe):
        return pipe(**call, generator=torch.Generator("cuda").manual_seed(0)).images

    config = FastConfig(fp8=False, cache="every:2,1,0")
    eager = optimize(QwenImage21Pipeline(**tiny_qwen21_components()).to("cuda"), config.replace(cuda_graphs=False))
    expected = run(eager)
    assert "cuda_graphs" not in eager.applied, eager.applied
    assert decisions(eager) == {"cond": [True, False, True, False], "uncond": [True, False, True, False]}
    graphed = optimize(QwenImage21Pipeline(**tiny_qwen21_components()).to("cuda"), config)
    for n in range(2):
        assert torch.equal(run(graphed), expected), f"call {n}"
        assert decisions(graphed) == decisions(eager) and "cuda_graphs" in graphed.applied, graphed.applied
    assert len(graphed.runner.graphs) == 4 and graphed.runner.graphs_failed is None


def test_diffusers_caches_refused_as_stock_refuses_or_with_what_runs_instead():
    """diffusers' enable_cache on the fast 2.1 transformer: the configs stock refuses on 2.1 (their hooks find no
    registered block class) with stock's own ValueError; TextKVCacheConfig (which stock takes and runs nothing
    with: no 2.1 block is hooked) and TaylorSeer's lite mode and custom identifiers (they hook modules whose outputs
    the fast block does not have) with a NotImplementedError saying what runs instead."""
    from diffusers import (FirstBlockCacheConfig, MagCacheConfig, SeaCacheConfig, TaylorSeerCacheConfig,
                           TextKVCacheConfig)

    fast = optimize(tiny_pipeline(num_layers=BLOCKS), FastConfig(fp8=False))
    for config in (FirstBlockCacheConfig(threshold=0.2), MagCacheConfig(mag_ratios=[1.0] * 4), SeaCacheConfig()):
        with pytest.raises(ValueError) as stock_refusal:
            tiny_pipeline(num_layers=BLOCKS).transformer.enable_cache(config)
        with pytest.raises(ValueError) as ours:
            fast.transformer.enable_cache(config)
        assert str(ours.value) == str(stock_refusal.value) and "not registered" in str(ours.value)
    for config in (TextKVCacheConfig(), TaylorSeerCacheConfig(use_lite_mode=True),
                   TaylorSeerCacheConfig(cache_identifiers=["^transformer_blocks.*attn"])):
        tiny_pipeline(num_layers=BLOCKS).transformer.enable_cache(config)  # stock takes them
        with pytest.raises(NotImplementedError, match=r"TaylorSeerCacheConfig runs on its default pattern .* "
                                                      r"FastConfig\(cache=\.\.\.\) runs the DBCache rules"):
            fast.transformer.enable_cache(config)
    assert not fast.transformer.is_cache_enabled


TAYLORSEER = dict(cache_interval=2, disable_cache_before_step=2, max_order=2)
TAYLORSEER_COMPUTES = [True, True, False, True, False, True, False, True]  # 8 steps: warm-up 2, then 1 in 2


@pytest.mark.parametrize("use_kv_cache", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_taylorseer_runs_stock_s_hooks_on_the_fast_blocks(use_kv_cache):
    """TaylorSeerCacheConfig on the fast 2.1 transformer: diffusers' own hooks on every block's `attn`
    (block.AttentionPart), per CFG branch; the latents equal stock's with the same config (fp32, FP8 off; with the
    prefix cache the prefill's attention outputs have the prefix's rows too, and stock's hooks restart the expansion
    at the next step, as they do here), and differ from the uncached ones by far more; each block's attention runs
    on the computing steps only; a second call decides anew; `applied` names it; disable_cache is exact again;
    with FastConfig(cache=...) too, the call refuses."""
    from diffusers import TaylorSeerCacheConfig

    from qwen_image_fast.pipelines.qwen_image21.block import FastBlock21

    config = TaylorSeerCacheConfig(**TAYLORSEER, taylor_factors_dtype=torch.float32)
    call = dict(num_inference_steps=STEPS, use_kv_cache=use_kv_cache)
    stock = tiny_pipeline(num_layers=BLOCKS)
    uncached = latents(stock, **call)
    stock.transformer.enable_cache(config)
    expected = latents(stock, **call)
    fast = optimize(tiny_pipeline(num_layers=BLOCKS), FastConfig(fp8=False))
    fast.transformer.enable_cache(config)
    calls = []
    original = FastBlock21.attention

    def counted(block, *args):
        calls.append(fast.transformer._cache_name)
        return original(block, *args)

    FastBlock21.attention = counted
    try:
        got = latents(fast, **call)
        assert_close(got, expected, 1e-5, "TaylorSeer, fast against stock")
        assert rel_rms_error(expected, uncached) > 100 * rel_rms_error(got, expected), "the cache changes nothing"
        computing = sum(TAYLORSEER_COMPUTES)
        assert calls.count("cond") == calls.count("uncond") == computing * BLOCKS, (calls, computing)
        assert torch.equal(latents(fast, **call), got), "a second call"
    finally:
        FastBlock21.attention = original
    assert "step_cache:TaylorSeerCacheConfig" in fast.applied, fast.applied
    fast.fast_config = fast.fast_config.replace(cache="every:2,1,1")
    with pytest.raises(ValueError, match="are two step caches: use one"):
        latents(fast, **call)
    fast.fast_config = fast.fast_config.replace(cache=None)
    fast.transformer.disable_cache()
    assert_close(latents(fast, **call), uncached, 1e-5, "after disable_cache")


def test_taylorseer_plans_no_graphs_on_qwen21():
    """Under diffusers' hooks (they decide on the host inside each forward) a 2.1 forward runs eagerly: the plan
    says so where graphs would otherwise run."""
    from qwen_image_fast.pipelines.core.optimizations import QWEN21, Facts, plan_cuda_graphs

    facts = Facts(pipeline=QWEN21, fused=True, device="cuda", fp8=True, fast_accum=True, attention="fa4",
                  offload_hooks=False, vae_2d=None, enhancer=False)
    assert plan_cuda_graphs(FastConfig(), facts).values == (True,)
    plan = plan_cuda_graphs(FastConfig(), replace(facts, diffusers_cache="TaylorSeerCacheConfig"))
    assert plan.values == () and "Qwen-Image-2.1's forwards run eagerly under them" in plan.why_not


@pytest.mark.gpu
def test_taylorseer_on_gpu_runs_eagerly_and_matches_stock():
    """On CUDA (graphs planned for the pipeline): under TaylorSeer's hooks the forwards run eagerly (`applied` has
    no cuda_graphs), the latents of two calls equal each other and stock's with the same config within 1e-5 (the
    tiny model in fp32, FP8 off)."""
    from diffusers import QwenImage21Pipeline, TaylorSeerCacheConfig

    from qwen_image_fast.pipelines.tiny import tiny_qwen21_components

    config = TaylorSeerCacheConfig(**TAYLORSEER, taylor_factors_dtype=torch.float32)
    call = dict(prompt="a cat on a mat", negative_prompt="blurry", true_cfg_scale=2.0, num_inference_steps=STEPS,
                height=64, width=64, output_type="latent", output_resolution=64)

    def run(pipe):
        return pipe(**call, generator=torch.Generator("cuda").manual_seed(0)).images

    stock = QwenImage21Pipeline(**tiny_qwen21_components()).to("cuda")
    stock.transformer.enable_cache(config)
    expected = run(stock)
    fast = optimize(QwenImage21Pipeline(**tiny_qwen21_components()).to("cuda"), FastConfig(fp8=False))
    fast.transformer.enable_cache(config)
    first = run(fast)
    assert torch.equal(run(fast), first)
    assert_close(first, expected, 1e-5, "TaylorSeer on the GPU, fast against stock")
    assert "cuda_graphs" not in fast.applied and "step_cache:TaylorSeerCacheConfig" in fast.applied, fast.applied
