"""Step caches on the fast pipelines, against stock diffusers (fp32 tiny configs of 4 blocks, FP8 off):
- each diffusers cache config through transformer.enable_cache: the same decisions (which blocks and attention
  modules ran, in order, cond and uncond) and the same latents as the stock pipeline with the same config, for
  text-to-image, Edit-2511 (two condition images, zero_cond_t) and img2img;
- FastConfig(cache=DBCache(...)): the same decisions and latents as a plain-PyTorch reference of the rule run on the
  stock transformer's own blocks, paired (batched CFG) and not, graphed (stand-in) and not;
- disable_cache() gives back exactly the uncached output; what cannot run is refused with the reason."""

import contextlib
import copy
import gc
from dataclasses import replace

import diffusers
import pytest
import torch
from diffusers import (
    FasterCacheConfig,
    FirstBlockCacheConfig,
    MagCacheConfig,
    PyramidAttentionBroadcastConfig,
    SeaCacheConfig,
    TaylorSeerCacheConfig,
    TextKVCacheConfig,
)
from diffusers.models.attention_processor import Attention
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformerBlock
from helpers import assert_close, rel_rms_error
from test_family import IMAGE, IMAGE_2, MASK, RGBA
from test_pipeline import EXACT, FIXTURE_TOKENIZER, tiny_controlnet
from transformers import Qwen2Tokenizer

from qwen_image_fast import FastConfig, optimize
from qwen_image_fast.pipelines.core.config import DBCache
from qwen_image_fast.pipelines.qwen_image.model.block import FastBlock, JointAttention
from qwen_image_fast.pipelines.core.optimizations import planned_labels
from qwen_image_fast.pipelines.tiny import tiny_components, tiny_pipeline

# Prompts of one length: PyramidAttentionBroadcast and FasterCache keep one state for cond and uncond in diffusers
# (not one per cache_context), which fails on the stock model when the two texts differ in length.
COMMON = dict(prompt="a cat on a mat", negative_prompt="a dog on a rug", true_cfg_scale=3.0, height=32, width=32)
CASES = {  # id -> (pipeline, transformer config, call)
    "text_to_image": ("QwenImagePipeline", {}, dict(num_inference_steps=3)),
    "edit_2511": ("QwenImageEditPlusPipeline", dict(zero_cond_t=True),
                  dict(image=[IMAGE, IMAGE_2], num_inference_steps=2)),
    "img2img": ("QwenImageImg2ImgPipeline", {}, dict(image=IMAGE, strength=1.0, num_inference_steps=3)),
    "inpaint": ("QwenImageInpaintPipeline", {}, dict(image=IMAGE, mask_image=MASK, strength=1.0, num_inference_steps=3)),
    "controlnet": ("QwenImageControlNetPipeline", {}, dict(control_image=IMAGE, controlnet_conditioning_scale=0.8,
                                                           num_inference_steps=3)),
    "layered": ("QwenImageLayeredPipeline", {}, dict(image=RGBA, layers=2, height=None, width=None,
                                                     num_inference_steps=3)),
}
MAG_RATIOS = [1.0, 0.92, 1.04]
BLOCKS = 4


def diffusers_configs(pipe, steps: int) -> dict:
    """Each diffusers cache with settings under which it skips work on these random tiny models (SeaCache runs
    fail-open on Qwen-Image in diffusers 0.42: its pipelines pass no step index; it skips nothing, here as there)."""
    now = lambda: pipe.current_timestep  # noqa: E731
    return {
        "FirstBlockCache": FirstBlockCacheConfig(threshold=0.6),
        "TaylorSeer": TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1,
                                            taylor_factors_dtype=torch.float32),
        "TaylorSeer-lite": TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1, use_lite_mode=True,
                                                 taylor_factors_dtype=torch.float32),
        "MagCache": MagCacheConfig(mag_ratios=MAG_RATIOS, num_inference_steps=steps, threshold=0.1,
                                   retention_ratio=0.2),
        "PyramidAttentionBroadcast": PyramidAttentionBroadcastConfig(
            spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(0, 1000),
            current_timestep_callback=now),
        "FasterCache": FasterCacheConfig(is_guidance_distilled=True, spatial_attention_block_skip_range=2,
                                         spatial_attention_timestep_skip_range=(0, 1000), current_timestep_callback=now),
        # cond approximates too, from uncond's outputs and from approximations; a weight of the config's
        "FasterCache-3": FasterCacheConfig(is_guidance_distilled=True, spatial_attention_block_skip_range=3,
                                           spatial_attention_timestep_skip_range=(0, 1000),
                                           attention_weight_callback=lambda module: 0.3, current_timestep_callback=now),
        "SeaCache": SeaCacheConfig(),
    }


def stock(case_id: str):
    name, transformer_config, _ = CASES[case_id]
    transformer_config = transformer_config | dict(num_layers=BLOCKS)
    if "ControlNet" not in name:
        return tiny_pipeline(getattr(diffusers, name), transformer_config=transformer_config)
    components = tiny_components(0, transformer_config=transformer_config)  # as test_family's ControlNet cases
    components["tokenizer"] = Qwen2Tokenizer.from_pretrained(FIXTURE_TOKENIZER)
    return getattr(diffusers, name)(**components, controlnet=tiny_controlnet(components["transformer"]))


def run(pipe, case_id: str) -> torch.Tensor:
    """The final latents (the layered pipeline has no output_type="latent": its decoded layers)."""
    call = {k: v for k, v in (COMMON | CASES[case_id][2]).items() if v is not None}
    output_type = "pt" if case_id == "layered" else "latent"
    images = pipe(**call, output_type=output_type, generator=torch.Generator().manual_seed(0)).images
    return torch.stack(list(images)) if isinstance(images, list) else images


def decisions(monkeypatch, transformer, classes, graphs=None) -> list:
    """The list, filled as they run, of the blocks and attention modules of `transformer` that run, by name, in
    order. Patches the classes' forward before a cache hooks them (the hooks keep the forward they found, and put
    it back on the instance when removed: one list for the test). graphs: stand_in_graphs' log (its captures run
    nothing that a real one would)."""
    names = {id(m): name for name, m in transformer.named_modules() if isinstance(m, classes)}
    ran = []
    for cls in classes:
        def forward(self, *args, _forward=cls.forward, **kwargs):
            if id(self) in names and not (graphs and graphs["capturing"]):
                ran.append(names[id(self)])
            return _forward(self, *args, **kwargs)

        monkeypatch.setattr(cls, "forward", forward)
    return ran


STOCK_CLASSES, FAST_CLASSES = (QwenImageTransformerBlock, Attention), (FastBlock, JointAttention)


# Every config on text-to-image; on every diffusers-loop pipeline (the same hooks, other inputs: condition images,
# zero_cond_t's per-token modulation, a strength schedule, a mask, ControlNet residuals added between blocks, the
# layered model's extra timestep condition) the block-level FirstBlockCache, on Edit-2511, img2img and ControlNet
# the attention-level TaylorSeer too.
PAIRS = [("text_to_image", name) for name in diffusers_configs(None, 4)] + [
    ("edit_2511", "FirstBlockCache"), ("edit_2511", "TaylorSeer"), ("edit_2511", "FasterCache"),
    ("edit_2511", "SeaCache"), ("img2img", "FirstBlockCache"), ("img2img", "TaylorSeer"),
    ("inpaint", "FirstBlockCache"), ("controlnet", "FirstBlockCache"), ("controlnet", "TaylorSeer"),
    ("layered", "FirstBlockCache")]


# The module whose running says that a forward computed, per config the runner makes the decisions of by its rule
# (model/step_caches.native_rule): FirstBlockCache the blocks after the first, the attention-level ones the attention
# modules; SeaCache runs fail-open (every block).
COMPUTED_WHEN_RAN = {"FirstBlockCache": "transformer_blocks.1", "TaylorSeer": "transformer_blocks.0.attn",
                     "PyramidAttentionBroadcast": "transformer_blocks.0.attn", "FasterCache": "transformer_blocks.0.attn",
                     "FasterCache-3": "transformer_blocks.0.attn", "SeaCache": "transformer_blocks.1"}
# where batched CFG runs under a rule: text-to-image; SeaCache (fail-open, nothing to undo) paired by speculation in
# diffusers' loops too
PAIRED_UNDER = {"SeaCache": ("text_to_image", "edit_2511")}


def stock_decisions(ran: list, name: str) -> dict:
    """Per CFG branch, whether each forward computed, from the modules a stock pipeline ran (a forward begins at
    block 0; "cond" then "uncond" each step)."""
    forwards = []
    for module in ran:
        if module == "transformer_blocks.0":
            forwards.append(False)
        elif module == COMPUTED_WHEN_RAN[name]:
            forwards[-1] = True
    return {"cond": forwards[0::2], "uncond": forwards[1::2]}


def rule_decisions(pipe) -> dict:
    """Per CFG branch, whether each forward of the last call computed, as the runner's rule decided."""
    return {b: [c if isinstance(c, bool) else c[0] for c in branch.decisions]
            for b, branch in pipe._last_step_cache.branches.items()}


@pytest.mark.usefixtures("small_condition_images")
@pytest.mark.parametrize("case_id,name", PAIRS)
def test_diffusers_cache_decides_and_computes_as_on_stock(case_id, name, monkeypatch, request):
    """The same modules run in the same order on both pipelines, the same latents; each config but SeaCache
    skipped something. The fast pipeline runs its blocks from graphs (stand-in), but with (text-to-image,
    FirstBlockCache), where it runs them eagerly and disable_cache() gives back the uncached output exactly.
    FirstBlockCache (but in the ControlNet pipeline), TaylorSeer, PAB, FasterCache and SeaCache run by the runner's
    rules (model/step_caches.py): the same decisions per branch, its forwards graphed (FirstBlockCache in three
    pieces, the others whole, per variant), CFG batched in text-to-image (and SeaCache's in the edit pipeline)."""
    steps = CASES[case_id][2]["num_inference_steps"]
    eager = (case_id, name) == ("text_to_image", "FirstBlockCache")
    rule = (name, case_id) != ("FirstBlockCache", "controlnet") and name in COMPUTED_WHEN_RAN
    graphs = None if eager else request.getfixturevalue("stand_in_graphs")
    ref, fast = stock(case_id), optimize(stock(case_id), EXACT)
    if graphs is not None:
        capture_leaves_rule_buffers(monkeypatch, fast)
    uncached = run(fast, case_id) if (case_id, name) == ("text_to_image", "FirstBlockCache") else None
    warned = warnings_of_sea_cache(monkeypatch)
    seen = []
    for pipe, classes in ((ref, STOCK_CLASSES), (fast, FAST_CLASSES)):
        ran = decisions(monkeypatch, pipe.transformer, classes, graphs)
        pipe.transformer.enable_cache(diffusers_configs(pipe, steps)[name])
        seen.append((run(pipe, case_id), ran, warned.copy()))
        warned.clear()
    (ref_latents, ref_ran, ref_warned), (latents, ran, fast_warned) = seen
    if rule:
        assert rule_decisions(fast) == stock_decisions(ref_ran, name), (case_id, rule_decisions(fast), ref_ran)
        assert ("batched_cfg" in fast.applied) == (case_id in PAIRED_UNDER.get(name, ("text_to_image",))), \
            fast.applied
        ran = list(ref_ran)  # the blocks ran per branch, as counted on stock (blocks_computed below)
    else:
        assert ran == ref_ran, (case_id, name, ref_ran, ran)
    assert_close(latents, ref_latents, 1e-5, f"{case_id} {name}")
    full = steps * 2 * 2 * BLOCKS  # forwards (CFG) x (blocks + attention modules)
    if name == "SeaCache":  # stock fail-open runs every block; ours: its latents equal stock's (above)
        assert len(ref_ran) == full, (name, "stock fail-open: every block runs")
        assert set(fast_warned) == set(ref_warned) and len(set(ref_warned)) == 1, (ref_warned, fast_warned)
        assert graphs is not None and "cuda_graphs" in fast.applied, fast.applied
        ref.transformer.disable_cache()
        assert torch.equal(ref_latents, run(ref, case_id)), "SeaCache fail-open: stock computes what it does uncached"
    else:
        assert len(ran) < full, (case_id, name, "skipped nothing: the test would not see a wrong decision")
    assert f"step_cache:{type(diffusers_configs(fast, steps)[name]).__name__}" in fast.applied
    if graphs is not None and rule and name == "FirstBlockCache":  # three pieces, once each (cond, uncond share)
        assert "cuda_graphs" in fast.applied and graphs["replays"], graphs
        assert len(graphs["captures"]) == 3, graphs
    elif graphs is not None and not rule:  # blocks (or their pieces around a hooked attention) captured once each
        assert "cuda_graphs:blocks" in fast.applied and graphs["replays"], graphs
        pieces = 1 if name in ("FirstBlockCache", "MagCache", "TaylorSeer-lite") else 3
        # cond and uncond of one shape (the prompts' lengths are equal) share them
        assert len(graphs["captures"]) == BLOCKS * pieces, (name, len(graphs["captures"]))
    blocks_ran = [module for module in ran if not module.endswith(".attn")]
    assert fast.blocks_computed == len(blocks_ran) / (steps * 2 * BLOCKS), (name, blocks_ran)
    fast.transformer.disable_cache()
    if uncached is not None:
        assert torch.equal(run(fast, case_id), uncached), "disable_cache() gives back the uncached output exactly"


def warnings_of_sea_cache(monkeypatch) -> list:
    """The list, filled as they come, of SeaCache's fail-open messages (its hooks' shared state shows each once per
    enable_cache: "... running in fail-open mode ...")."""
    from diffusers.hooks.sea_cache import SeaCacheSharedState

    warned, mark = [], SeaCacheSharedState.mark_fail_open

    def mark_fail_open(self, message):
        warned.append(message)
        return mark(self, message)

    monkeypatch.setattr(SeaCacheSharedState, "mark_fail_open", mark_fail_open)
    return warned


def capture_leaves_rule_buffers(monkeypatch, pipe):
    """The stand-in capture (stand_in_graphs) runs what it captures, where a real one launches nothing: the buffers
    the attention-level rules write (pipe.runner's) are put back after it, as a real capture leaves them."""
    from qwen_image_fast.pipelines.core.runtime.cuda_graph import Graphs

    stand_in = Graphs.capture

    def capture(store, *args, **kwargs):
        runner = pipe.runner
        buffers = [t for f in runner.taylor_factors.values() for ts in f.tensors.values() for t in ts]
        buffers += [t for last in runner.last_attention.values() for t in last.tensors.values()]
        buffers += [t for slots in runner.attention_slots.values() for ts in slots.tensors.values() for t in ts]
        kept = [t.clone() for t in buffers]
        result = stand_in(store, *args, **kwargs)
        for t, value in zip(buffers, kept):
            t.copy_(value)
        return result

    monkeypatch.setattr(Graphs, "capture", capture)


def graphed_rule_cases() -> dict:
    """id -> (config, batched, per-branch decisions over 6 steps, graphs captured in the first call, replays in the
    two calls). A variant (its decisions and branches) used twice in a call is captured at its second use."""
    taylorseer = dict(cache_interval=2, disable_cache_before_step=1, taylor_factors_dtype=torch.float32)
    alternate = [True, False] * 3
    # PAB: outside (0, 1000) at t = 1000, then cond computes (its iterations are even), uncond takes cond's output
    pab = {"cond": [True] * 6, "uncond": [True] + [False] * 5}
    return {
        # update (1 factor) and predict (2) used twice each: 2 graphs; replays 1 + 1, then 2 + 2
        "taylorseer": (TaylorSeerCacheConfig(**taylorseer), True, alternate, 2, 6),
        "taylorseer-unbatched": (TaylorSeerCacheConfig(**taylorseer), False, alternate, 4, 12),
        # the factors grow to three: each variant once a call, eager
        "taylorseer-order2": (TaylorSeerCacheConfig(**taylorseer, max_order=2), True, alternate, 0, 0),
        # (computes, reuses) 5 times: replays 4, then 5
        "pab": ("PyramidAttentionBroadcast", True, pab, 1, 9),
        # cond 6 times (5 + 6), uncond reusing 5 times (4 + 5)
        "pab-unbatched": ("PyramidAttentionBroadcast", False, pab, 2, 20),
        # FasterCache decides as PAB does here (cond computes, uncond extrapolates from cond's output and its own)
        "faster": ("FasterCache", True, pab, 1, 9),
        # cond computing (5 + 5: its first forward fills both slots, another variant), uncond extrapolating (4 + 5)
        "faster-unbatched": ("FasterCache", False, pab, 2, 18),
    }


@pytest.mark.parametrize("case", list(graphed_rule_cases()))
def test_attention_rules_graphed_across_calls(case, stand_in_graphs, monkeypatch):
    """TaylorSeer and Pyramid Attention Broadcast by the runner's rules over 6 steps, CFG batched or not: the
    variants used twice in a call are captured at their second use and replayed, in the next call from its start;
    both calls equal stock with the same config (the graphs write and read buffers the runner keeps: TaylorSeer's
    factors, PAB's last outputs). Batched PAB attends to the cond half only where the uncond half reuses it."""
    config, batched, decisions, captured, replayed = graphed_rule_cases()[case]
    call = dict(COMMON, num_inference_steps=6, output_type="latent")
    ref, fast = stock("text_to_image"), optimize(stock("text_to_image"), EXACT.replace(batched_cfg=batched))
    capture_leaves_rule_buffers(monkeypatch, fast)
    attended, attend = [], JointAttention.attend  # the batch of each attention the fast blocks ran

    def counted(self, hidden_states, *args, **kwargs):
        attended.append(hidden_states.shape[0])
        return attend(self, hidden_states, *args, **kwargs)

    monkeypatch.setattr(JointAttention, "attend", counted)
    for pipe in (ref, fast):
        pipe.transformer.enable_cache(diffusers_configs(pipe, 6)[config] if isinstance(config, str) else config)
    expected = ref(**call, generator=torch.Generator().manual_seed(0)).images
    label = f"step_cache:{type(fast.transformer._cache_config).__name__}"
    for n in range(2):
        captures = len(stand_in_graphs["captures"])
        latents = fast(**call, generator=torch.Generator().manual_seed(0)).images
        assert_close(latents, expected, 1e-5, f"call {n}")
        want = decisions if isinstance(decisions, dict) else {b: decisions for b in ("cond", "uncond")}
        assert rule_decisions(fast) == want, rule_decisions(fast)
        assert label in fast.applied and ("batched_cfg" in fast.applied) == batched, fast.applied
        assert ("cuda_graphs" in fast.applied) == (captured > 0), fast.applied
        assert len(stand_in_graphs["captures"]) - captures == (captured if n == 0 else 0), stand_in_graphs
    assert len(stand_in_graphs["replays"]) == replayed, stand_in_graphs
    # batched PAB: where uncond reuses cond's output, the attention runs for the cond half of the batch only
    assert set(attended) == ({2, 1} if case in ("pab", "faster") else {2} if batched else {1}), set(attended)
    if case == "taylorseer-order2":  # 4 blocks x 2 streams but the last block's text (discarded, not computed)
        assert [len(f) for f in next(iter(fast.runner.taylor_factors.values())).tensors.values()] == [3] * 7


@pytest.mark.parametrize("interval, order", [(3, 1), (4, 2), (4, 3)])
def test_taylorseer_every_offset_and_order_as_stock(interval, order, monkeypatch, stand_in_graphs):
    """TaylorSeer over intervals longer than 2 (a prediction at every offset 1 .. interval-1 from its last update)
    at orders 1-3, by the runner's rule, CFG batched and graphed: stock's decisions, read off the attention modules
    stock ran, and its latents, over two whole intervals after the warm-up and one step into the next."""
    config = TaylorSeerCacheConfig(cache_interval=interval, disable_cache_before_step=1, max_order=order,
                                   taylor_factors_dtype=torch.float32)
    call = dict(COMMON, num_inference_steps=2 + 2 * interval, output_type="latent")
    ref, fast = stock("text_to_image"), optimize(stock("text_to_image"), EXACT)
    capture_leaves_rule_buffers(monkeypatch, fast)
    ran = decisions(monkeypatch, ref.transformer, STOCK_CLASSES)
    for pipe in (ref, fast):
        pipe.transformer.enable_cache(config)
    expected = ref(**call, generator=torch.Generator().manual_seed(0)).images
    assert_close(fast(**call, generator=torch.Generator().manual_seed(0)).images, expected, 1e-5,
                 f"interval {interval}, order {order}")
    want = stock_decisions(ran, "TaylorSeer")
    assert rule_decisions(fast) == want, (rule_decisions(fast), want)
    runs = "".join("p" if not computed else "c" for computed in want["cond"]).split("c")
    assert max(len(r) for r in runs) == interval - 1, want  # predictions at every offset of an interval
    assert "batched_cfg" in fast.applied and "cuda_graphs" in fast.applied, fast.applied


def test_taylorseer_cool_down_as_stock():
    """TaylorSeer with disable_cache_after_step (its cool-down: every step from it computes) by the runner's rule,
    CFG batched and graphed: stock's decisions (6 steps: warm-up 1, an update every 2nd step, cool-down from step 4)
    and latents."""
    config = TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1, disable_cache_after_step=4,
                                   taylor_factors_dtype=torch.float32)
    call = dict(COMMON, num_inference_steps=6, output_type="latent")
    ref, fast = stock("text_to_image"), optimize(stock("text_to_image"), EXACT)
    for pipe in (ref, fast):
        pipe.transformer.enable_cache(config)
    expected = ref(**call, generator=torch.Generator().manual_seed(0)).images
    assert_close(fast(**call, generator=torch.Generator().manual_seed(0)).images, expected, 1e-5, "cool-down")
    want = [True, False, True, False, True, True]
    assert rule_decisions(fast) == {"cond": want, "uncond": want}, rule_decisions(fast)
    assert "batched_cfg" in fast.applied, fast.applied


def test_attention_rule_buffers_follow_the_config(stand_in_graphs, monkeypatch):
    """TaylorSeer with fp32 factors, graphed, then with bf16 factors (the model in fp32): the second config equals
    stock with it (its factors rounded to bf16), not the first's graphs and buffers replayed; no buffers are kept
    once no rule runs."""
    configs = [TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1, taylor_factors_dtype=dtype)
               for dtype in (torch.float32, torch.bfloat16)]
    call = dict(COMMON, num_inference_steps=6, output_type="latent")
    fast = optimize(stock("text_to_image"), EXACT)
    capture_leaves_rule_buffers(monkeypatch, fast)
    for config in configs:
        ref = stock("text_to_image")
        ref.transformer.enable_cache(config)
        fast.transformer.enable_cache(config)
        latents = fast(**call, generator=torch.Generator().manual_seed(0)).images
        assert "cuda_graphs" in fast.applied
        assert_close(latents, ref(**call, generator=torch.Generator().manual_seed(0)).images, 1e-5,
                     str(config.taylor_factors_dtype))
        fast.transformer.disable_cache()
    assert fast.runner.taylor_factors
    fast(**call)
    assert not fast.runner.taylor_factors and not fast.runner.last_attention


@pytest.mark.parametrize("name,batched", [("PyramidAttentionBroadcast", True), ("PyramidAttentionBroadcast", False),
                                          ("FasterCache", True)])
def test_one_state_rules_fail_where_stock_fails(name, batched):
    """Prompts of two lengths under PAB or FasterCache: stock fails at the first reuse (one state for cond and
    uncond: the uncond forward takes, or extrapolates from, the cond's attention output); the rule refuses with the
    reason there too, paired (where padding would have hidden it) or not."""
    call = dict(COMMON, negative_prompt="a dog", num_inference_steps=3, output_type="latent")
    ref, fast = stock("text_to_image"), optimize(stock("text_to_image"), EXACT.replace(batched_cfg=batched))
    for pipe in (ref, fast):
        pipe.transformer.enable_cache(diffusers_configs(pipe, 3)[name])
    with pytest.raises(RuntimeError):
        ref(**call)
    with pytest.raises(ValueError, match="the prompt and the negative prompt the same length"):
        fast(**call)


def test_faster_cache_rule_fails_where_stock_fails_at_its_first_forward():
    """A timestep range holding the first step: FasterCache would approximate at its first forward, from nothing;
    stock fails there (its cache is None), and so does the rule, with the reason."""
    ref, fast = stock("text_to_image"), optimize(stock("text_to_image"), EXACT)
    for pipe in (ref, fast):
        pipe.transformer.enable_cache(FasterCacheConfig(
            is_guidance_distilled=True, spatial_attention_timestep_skip_range=(0, 1001),
            current_timestep_callback=lambda pipe=pipe: pipe.current_timestep))
    with pytest.raises(TypeError):
        run(ref, "text_to_image")
    with pytest.raises(ValueError, match="at its first forward"):
        run(fast, "text_to_image")


def test_mag_cache_calibration_as_on_stock(capsys):
    """MagCacheConfig(calibrate=True) computes every block and prints the magnitude ratios it measured per branch:
    on the fast pipeline the same ratios as on stock (to fp32 rounding), and the uncached latents."""
    import ast

    def calibrated(pipe):
        pipe.transformer.enable_cache(MagCacheConfig(calibrate=True, num_inference_steps=3))
        latents = run(pipe, "text_to_image")
        lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[") and "]" == line[-1:]
                 and not line.startswith("[MagCache]")]
        return latents, [ast.literal_eval(line) for line in lines]

    fast = optimize(stock("text_to_image"), EXACT)
    uncached = run(fast, "text_to_image")
    (ref_latents, ref_ratios), (latents, ratios) = calibrated(stock("text_to_image")), calibrated(fast)
    assert len(ref_ratios) == 2 and all(len(r) == 3 for r in ref_ratios), ref_ratios  # cond, uncond
    assert torch.allclose(torch.tensor(ratios), torch.tensor(ref_ratios), rtol=1e-5), (ratios, ref_ratios)
    assert_close(latents, ref_latents, 1e-5, "MagCache calibration")
    assert_close(latents, uncached, 1e-6, "calibration skips nothing")


def test_one_state_caches_refused_with_cfg_parallel():
    """PAB and FasterCache keep one state for cond and uncond: a rank that sees one branch would decide otherwise
    than stock, so parallel='cfg' refuses them (the caches with a state per branch run there)."""
    from qwen_image_fast.pipelines.core.optimizations import Facts, step_cache_conflict

    facts = Facts(pipeline="QwenImagePipeline", fused=True, device="cuda", fp8=True, fast_accum=True,
                  attention="fa4", offload_hooks=False, vae_2d=None, enhancer=False, parallel=("cfg2",))
    for name in ("PyramidAttentionBroadcastConfig", "FasterCacheConfig"):
        assert "keeps one state for cond and uncond" in step_cache_conflict(
            FastConfig(), replace(facts, diffusers_cache=name))
    for name in ("FirstBlockCacheConfig", "TaylorSeerCacheConfig"):
        assert step_cache_conflict(FastConfig(), replace(facts, diffusers_cache=name)) is None
        assert step_cache_conflict(FastConfig(), replace(facts, diffusers_cache=name, parallel=("ulysses2",)))


def test_diffusers_caches_plan_pairing_and_refuse_what_cannot_run():
    fast = optimize(stock("text_to_image"), EXACT)
    assert "batched_cfg" in fast.applied
    configs = diffusers_configs(None, 3)
    # hooks: TaylorSeer's lite mode; TaylorSeer's default pattern with cfg_fraction < 1 (its forwards change branches)
    for config, fraction in ((configs["TaylorSeer-lite"], 1.0), (configs["TaylorSeer"], 0.5)):
        fast.fast_config = fast.fast_config.replace(cfg_fraction=fraction)
        fast.transformer.enable_cache(config)
        plans = {opt.name: plan for opt, plan in fast_plans(fast)}
        assert "TaylorSeerCacheConfig keeps a state per cache_context" in plans["batched_cfg"].why_not
        assert plans["step_cache"].values == ("TaylorSeerCacheConfig",)
        fast.transformer.disable_cache()
    fast.fast_config = fast.fast_config.replace(cfg_fraction=1.0)
    for config in (FirstBlockCacheConfig(threshold=0.4), configs["TaylorSeer"]):  # the runner's rule: paired
        fast.transformer.enable_cache(config)
        plans = {opt.name: plan for opt, plan in fast_plans(fast)}
        assert plans["batched_cfg"].values == (True,) and plans["step_cache"].values == (type(config).__name__,)
        fast.transformer.disable_cache()
    fast.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.4))
    fast.fast_config = fast.fast_config.replace(cache=DBCache(Fn=1))
    with pytest.raises(ValueError, match="two step caches"):
        run(fast, "text_to_image")
    fast.transformer.disable_cache()
    for config, reason in ((TextKVCacheConfig(), "NucleusMoE-Image"),
                           (FasterCacheConfig(current_timestep_callback=lambda: 0), "is_guidance_distilled=True")):
        with pytest.raises(ValueError, match=reason):
            fast.transformer.enable_cache(config)
        assert not fast.transformer.is_cache_enabled


def fast_plans(pipe):
    from qwen_image_fast.pipelines.core.optimizations import plans

    return plans(pipe.fast_config, pipe.facts())


class CacheDitState:
    """What cache-dit's CachedContextManager.similarity reads of its state, for one branch without separate-CFG
    steps or important-token thresholds (DBCache's settings): the differences it logs are dropped."""

    def add_residual_diff(self, diff):
        pass

    def enable_separate_cfg(self) -> bool:
        return False

    def is_separate_cfg_step(self) -> bool:
        return False

    def cfg_diff_compute_separate(self) -> bool:
        return False

    def get_current_step_residual_diff(self):
        return None

    def get_important_condition_threshold(self) -> float:
        return 0.0


class ReferenceDBCache:
    """config.DBCache's rule in plain PyTorch on the stock transformer's own blocks: each wrapped; the branch is the
    cache_context the stock pipeline enters. log: per forward (branch, whether the middle ran). With
    config.taylorseer, cache-dit's own TaylorSeerCalibrator per branch extrapolates the cached residuals (its states
    made up front, as cache-dit has them from its second call on). wrapper: the block wrapper (Qwen-Image-2.1's
    single-stream blocks have their own: test_qwen21_step_cache.py)."""

    def __init__(self, transformer, config: DBCache, wrapper=None):
        self.config, self.n = config, len(transformer.transformer_blocks)
        self.branch, self.states, self.log = None, {}, []
        enter = transformer.cache_context

        @contextlib.contextmanager
        def cache_context(name, **kwargs):
            self.branch = name
            with enter(name, **kwargs):
                yield

        transformer.cache_context = cache_context
        transformer.transformer_blocks = torch.nn.ModuleList(
            (wrapper or Wrapped)(self, i, block) for i, block in enumerate(transformer.transformer_blocks))

    def decide(self, r: torch.Tensor) -> bool:
        c, s = self.config, self.states.setdefault(self.branch, dict(step=0, ref=None, cached=0, run=0))
        step, s["step"] = s["step"], s["step"] + 1
        if c.taylorseer:
            from cache_dit.caching.cache_contexts.calibrators.taylorseer import TaylorSeerCalibrator

            if "calibrator" not in s:
                s["calibrator"] = TaylorSeerCalibrator(n_derivatives=c.taylorseer)
                for stream in ("img", "txt"):
                    s["calibrator"].maybe_init_state(stream)
            s["calibrator"].mark_step_begin()
        if step < c.warmup or s["ref"] is None:
            compute = True
        elif c.every:
            compute = (step - c.warmup) % c.every == 0
        elif 0 <= c.max_cached <= s["cached"] or 0 <= c.max_consecutive <= s["run"]:
            compute = True
        else:  # cache-dit's own similarity (its manager's method, on a stand-in for the state it reads)
            from cache_dit.caching.cache_contexts.cache_manager import CachedContextManager

            compute = not CachedContextManager.similarity(CacheDitState(), s["ref"], r, threshold=c.threshold)
        s["cached"], s["run"] = s["cached"] + (not compute), 0 if compute else s["run"] + 1
        self.log.append((self.branch, compute))
        return compute


class Wrapped(torch.nn.Module):
    def __init__(self, cache: ReferenceDBCache, index: int, block):
        super().__init__()
        self.cache, self.index, self.block = [cache], index, block

    def forward(self, hidden_states, encoder_hidden_states, **kwargs):
        cache, i = self.cache[0], self.index
        c, last_middle = cache.config, cache.n - cache.config.Bn - 1
        if i == 0:
            cache.embedded = hidden_states
        if c.Fn <= i <= last_middle and not cache.compute:
            if i < last_middle:
                return encoder_hidden_states, hidden_states
            s = cache.states[cache.branch]
            if c.taylorseer:
                return (cache.front[1] + s["calibrator"].approximate("txt"),
                        cache.front[0] + s["calibrator"].approximate("img"))
            return cache.front[1] + s["res_txt"], cache.front[0] + s["res_img"]
        txt, img = self.block(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states, **kwargs)
        if i == c.Fn - 1:
            cache.front = (img, txt)
            cache.r = img - cache.embedded
            cache.compute = cache.decide(cache.r)
        if i == last_middle and cache.compute:
            s = cache.states[cache.branch]
            s["res_img"], s["res_txt"], s["ref"] = img - cache.front[0], txt - cache.front[1], cache.r
            if c.taylorseer:
                s["calibrator"].update(s["res_img"], name="img")
                s["calibrator"].update(s["res_txt"], name="txt")
        return txt, img


DBCACHES = {"threshold": DBCache(Fn=1, Bn=1, threshold=0.6, warmup=1, max_consecutive=2),
            "every3": DBCache.parse("every:3,2,1")}


@pytest.mark.usefixtures("small_condition_images")
@pytest.mark.parametrize("case_id,rule", [("text_to_image", "threshold"), ("text_to_image", "every3"),
                                          ("edit_2511", "threshold"), ("img2img", "every3")])
def test_dbcache_decides_and_computes_as_its_reference(case_id, rule):
    config = DBCACHES[rule]
    ref = stock(case_id)
    reference = ReferenceDBCache(ref.transformer, config)
    expected = run(ref, case_id)
    assert any(not computed for _, computed in reference.log), "the rule skipped nothing here"
    branches = {name: [computed for branch, computed in reference.log if branch == name] for name in ("cond", "uncond")}
    for batched in (True, False) if (case_id, rule) == ("text_to_image", "threshold") else (case_id == "text_to_image",):
        fast = optimize(stock(case_id), EXACT.replace(cache=config, batched_cfg=batched))
        assert_close(run(fast, case_id), expected, 1e-5, f"{case_id} {rule} batched={batched}")
        got = {name: [c for c, _ in branch.decisions] for name, branch in fast._last_step_cache.branches.items()}
        assert got == branches, (got, branches)
        blocks = len(fast.transformer.transformer_blocks)
        ran = sum(blocks if c else config.Fn + config.Bn for name in got for c in got[name])
        assert fast.blocks_computed == ran / (blocks * len(reference.log))
        assert f"step_cache:{config.label()}" in fast.applied and ("batched_cfg" in fast.applied) == batched
        if batched:  # switched off: exactly its label goes, from the plan and from what a call ran
            ran, planned = fast.applied, planned_labels(fast.fast_config, fast.facts())
            fast.fast_config = fast.fast_config.replace(cache=None)
            assert planned_labels(fast.fast_config, fast.facts()) == [x for x in planned if x.split(":")[0] != "step_cache"]
            run(fast, case_id)
            assert fast.applied == [x for x in ran if x.split(":")[0] != "step_cache"]
            assert fast.blocks_computed == 1.0


def test_dbcache_threshold_1_and_the_last_computed_residual_as_cache_dit():
    """threshold=1.0 (every step similar, cache-dit's similarity(); only the limits run the middle:
    max_consecutive=1, C - C - C over 5 steps) end to end: each cached step reuses the residual of the step just
    before it, not the first's; the latents equal the reference's, whose similarity is cache-dit's own."""
    config = DBCache(Fn=1, Bn=1, threshold=1.0, warmup=1, max_consecutive=1)
    call = dict(COMMON, num_inference_steps=5, output_type="latent")
    ref = stock("text_to_image")
    reference = ReferenceDBCache(ref.transformer, config)
    expected = ref(**call, generator=torch.Generator().manual_seed(0)).images
    assert [c for b, c in reference.log if b == "cond"] == [True, False, True, False, True], reference.log
    fast = optimize(stock("text_to_image"), EXACT.replace(cache=config))
    assert_close(fast(**call, generator=torch.Generator().manual_seed(0)).images, expected, 1e-5, "threshold 1")
    assert [c for c, _ in fast._last_step_cache.branches["cond"].decisions] == [True, False, True, False, True]


@pytest.mark.parametrize("order", [1, 2])
def test_dbcache_taylorseer_extrapolates_as_cache_dits_calibrator(order):
    """DBCache(taylorseer=n) over 7 steps (warm-up 3, then the middle on one step in 3): the cached steps (4 and 5,
    1 and 2 steps past the last update) add the Taylor extrapolation cache-dit's TaylorSeerCalibrator gives (order 2:
    the second derivative exists from step 3), not the last residual: the latents equal the reference with
    cache-dit's calibrator, batched and not, and differ from the same schedule without it."""
    config = DBCache.parse(f"every:3,1,1,w=3,ts={order}")
    call = dict(COMMON, num_inference_steps=7, output_type="latent")
    ref = stock("text_to_image")
    reference = ReferenceDBCache(ref.transformer, config)
    expected = ref(**call, generator=torch.Generator().manual_seed(0)).images
    assert [c for b, c in reference.log if b == "cond"] == [True] * 4 + [False, False, True], reference.log
    for batched in (True, False):
        fast = optimize(stock("text_to_image"), EXACT.replace(cache=config, batched_cfg=batched))
        latents = fast(**call, generator=torch.Generator().manual_seed(0)).images
        assert_close(latents, expected, 1e-5, f"taylorseer={order} batched={batched}")
        assert f"step_cache:dbcache:F1B1:every3:w3:ts{order}" in fast.applied, fast.applied
    fast.fast_config = fast.fast_config.replace(cache=replace(config, taylorseer=0))
    plain = fast(**call, generator=torch.Generator().manual_seed(0)).images
    assert rel_rms_error(plain, expected) > 1e-3, "the extrapolation changed nothing: the test would not see it"


def test_dbcache_refusals():
    """A rule deeper than the model is refused when it is set (optimize, from_pretrained, pipe.fast_config = ...),
    before anything is converted; then the rest of the grammar."""
    source = stock("text_to_image")
    with pytest.raises(ValueError, match=r"FastConfig\(cache='dbcache:F2B2:0.08'\): Fn=2 \+ Bn=2 leaves no middle "
                                         r"block to cache in the transformer of 4 blocks; allowed: Fn >= 1 and Fn \+ "
                                         r"Bn < 4"):
        optimize(source, EXACT.replace(cache=DBCache(Fn=2, Bn=2)))
    assert type(source.transformer).__name__ == "QwenImageTransformer2DModel"  # nothing converted
    fast = optimize(source, EXACT)
    with pytest.raises(ValueError, match="leaves no middle block"):
        fast.fast_config = EXACT.replace(cache="every:2,3,1")
    assert fast.fast_config.cache is None
    with pytest.raises(ValueError, match="fused_transformer"):
        FastConfig.preset("baseline").replace(cache="dbcache")
    for bad in ("dbcache:x", "every:1", "fbcache:0.2", "dbcache:8,0,0.1,9", "dbcache:8,w=2,0", "dbcache:ts=-1"):
        with pytest.raises(ValueError, match="cache"):
            FastConfig(cache=bad)
    for text, parsed in (("dbcache", DBCache()), ("dbcache:1,2", DBCache(Fn=1, Bn=2)),
                         ("dbcache:8,0,0.12,w=4,mc=10,mcc=3", DBCache(threshold=0.12, warmup=4, max_cached=10,
                                                                      max_consecutive=3)),
                         ("every:3,1,1", DBCache(every=3, Fn=1, Bn=1, warmup=0)),
                         ("every:2,warmup=2", DBCache(every=2, warmup=2)),
                         ("dbcache:8,ts=2", DBCache(taylorseer=2))):
        assert FastConfig(cache=text).cache == parsed, text


def test_dbcache_compares_with_the_last_step_that_ran_the_middle():
    """Residuals drifting by 1/8 a step (r_t = (1 + t/8) r_0, exact in binary): against the last step that ran the
    middle (cache-dit's rule) the drift adds up until the middle runs again (relative differences 0.125, 0.25,
    0.375 -> runs); against the previous step it would stay under 0.125 and never run. Fake pieces: the middle adds
    1 + t to both streams at step t, so a cached step shows which step's residual it reused."""
    from qwen_image_fast.pipelines.core.runtime.step_cache import StepCacheRun

    base, drift = torch.ones(2, 4, 8), [1 / 8]

    def piece(name, inputs, img=None, txt=None, **blocks):
        if name == "front":
            r = base * (1 + inputs["step"] * drift[0])
            return r.clone(), torch.zeros(2, 3, 8), r
        step = inputs["step"]
        return (img + 1 + step, txt + 1 + step) if name == "middle" else img

    def decisions(**config):
        cache = StepCacheRun(DBCache(Fn=1, Bn=0, warmup=1, **config), n_blocks=3)
        outputs = [cache.forward(piece, {"step": step}, ["cond"]) for step in range(8)]
        last = 0
        for step, (out, computes) in enumerate(outputs):
            last = step if computes[0] else last
            assert torch.equal(out, base * (1 + step * drift[0]) + 1 + last), \
                f"step {step}: a cached step adds the middle's residual of the last step that ran it ({last})"
        return "".join("C" if computes[0] else "-" for _, computes in outputs)

    assert decisions(threshold=0.3) == "C--C---C"
    # the limits, with a threshold every difference here is under: max_cached in all, max_consecutive in a row
    assert decisions(threshold=1.0, max_cached=3) == "C---CCCC"
    assert decisions(threshold=1.0, max_consecutive=2) == "C--C--C-"
    # step 2's difference equals the threshold (0.25 exactly): cache-dit's rule runs the middle (FirstBlockCache
    # would reuse it: the next test)
    assert decisions(threshold=0.25) == "C-C--C--"
    # a threshold of 1 or more: every step similar, unmeasured (cache-dit's similarity()), though these residuals
    # drift by 1 a step (relative differences 1, 2, 3 against the last computed one): only the limits run the middle
    drift[0] = 1.0
    assert decisions(threshold=1.0, max_consecutive=3) == "C---C---"
    assert decisions(threshold=0.99, max_consecutive=3) == "CC-C---C"  # measured: a difference of 1 runs it


def test_first_block_rule_decides_as_diffusers_hook():
    """FirstBlockRule against diffusers' FBCHeadBlockHook on the residuals above (r_t = (1 + t/8) r_0): the same
    decisions at thresholds the differences fall on exactly (it reuses at equality) and between them; the hook keeps
    the residual of the steps that ran the rest, as its new_forward does."""
    from diffusers.hooks.first_block_cache import FBCHeadBlockHook, FBCSharedBlockState
    from diffusers.hooks.hooks import CacheContext, StateManager

    from qwen_image_fast.pipelines.core.runtime.step_cache import FirstBlockRule, StepCacheRun

    residuals = [torch.ones(2, 4, 8) * (1 + t / 8) for t in range(8)]
    for threshold in (0.125, 0.25, 0.3, 0.5):
        manager = StateManager(FBCSharedBlockState)
        manager.set_context(CacheContext("cond"))
        hook, expected = FBCHeadBlockHook(manager, threshold), []
        for r in residuals:
            expected.append(hook._should_compute_remaining_blocks(r))
            if expected[-1]:
                manager.get_state().head_block_residual = r

        def piece(name, inputs, img=None, txt=None, **blocks):
            if name == "front":
                return residuals[inputs["step"]].clone(), torch.zeros(2, 3, 8), residuals[inputs["step"]]
            return (img + 1, txt + 1) if name == "middle" else img

        cache = StepCacheRun(FirstBlockRule(threshold), n_blocks=3)
        got = [cache.forward(piece, {"step": step}, ["cond"])[1][0] for step in range(8)]
        assert got == expected, (threshold, got, expected)
        assert not all(expected), threshold


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_diffusers_caches_on_gpu_replay_blocks_from_graphs(fp8, monkeypatch, capsys):
    """On a GPU, at the real block width (24 heads x 128, 4 blocks, random weights), 512^2: each diffusers config
    (the CPU test's settings) on the fast pipeline, its blocks replaying from real CUDA graphs (FirstBlockCache,
    TaylorSeer, PAB, FasterCache, SeaCache: the runner's rules, graphed forwards, CFG batched), against stock with
    the same config. fp32, FP8 off: the same decisions and latents to 1e-5. bf16, FP8 on: the same latents within
    the FP8 bound where the decisions are the same; where FP8 moved a residual across a threshold, the test says so
    and prints both decision sequences (per forward, the blocks and attention modules that ran; under a rule: per
    branch, whether each forward computed). A block replayed whole from its graph runs its attention module's
    Python not: under the block-level caches, which hook no attention module, only the blocks are compared."""
    from qwen_image_fast.pipelines.core.optimizations import FP8_BOUND
    from helpers import rel_rms_error

    dtype = torch.bfloat16 if fp8 else torch.float32
    layers = dict(num_layers=4, attention_head_dim=128, num_attention_heads=24, axes_dims_rope=(16, 56, 56))
    call = dict(COMMON, height=512, width=512, num_inference_steps=3, output_type="latent")

    def latents(pipe):
        return pipe(**call, generator=torch.Generator("cuda").manual_seed(0)).images.float()

    # built once (~13 s on the CPU at this width) and copied on the GPU for each of the 2 x 9 pipelines
    base = tiny_pipeline(diffusers.QwenImagePipeline, transformer_config=layers).to("cuda", dtype)
    flips = []
    for name in diffusers_configs(None, 4):
        seen = []
        for fast in (False, True):
            pipe = copy.deepcopy(base)
            if fast:
                pipe = optimize(pipe, FastConfig(fp8=fp8))
            ran = decisions(monkeypatch, pipe.transformer, FAST_CLASSES if fast else STOCK_CLASSES)
            pipe.transformer.enable_cache(diffusers_configs(pipe, 3)[name])
            seen.append((latents(pipe), ran))
            if fast and name in COMPUTED_WHEN_RAN:  # the runner's rule, CFG batched: FirstBlockCache's pieces graphed
                # (the attention rules' variants run once or twice in 3 steps; bench_cache.py replays them at 50)
                assert "batched_cfg" in pipe.applied and (name != "FirstBlockCache" or "cuda_graphs" in pipe.applied), (
                    name, pipe.applied)
                seen[-1] = (seen[-1][0], rule_decisions(pipe))
            elif fast:
                assert "cuda_graphs:blocks" in pipe.applied, (name, pipe.applied)
            monkeypatch.undo()
            attention_hooked = any(getattr(getattr(module, "_diffusers_hook", None), "hooks", None)
                                   for module in pipe.transformer.modules() if isinstance(module, JointAttention))
            del pipe  # two real-width pipelines and their graphs per config: freed before the next is built
            gc.collect()
            torch.cuda.empty_cache()
        (ref, ref_ran), (out, ran) = seen
        if name in COMPUTED_WHEN_RAN:
            ref_ran = stock_decisions(ref_ran, name)
        elif not attention_hooked:
            ref_ran, ran = ([m for m in names if not m.endswith(".attn")] for names in (ref_ran, ran))
        if ran != ref_ran:  # only a threshold on a measured difference can move with FP8; the others' schedules
            # are fixed by the step count
            assert fp8 and name in ("FirstBlockCache", "MagCache"), (name, "decisions differ", fp8, ref_ran, ran)
            flips.append(f"{name}: FP8 moved a threshold decision:\n  stock {ref_ran}\n  ours  {ran}")
            continue
        if fp8:
            assert rel_rms_error(out, ref) < FP8_BOUND.full, (name, rel_rms_error(out, ref))
        else:
            assert_close(out, ref, 1e-5, name)
    with capsys.disabled():
        print("\n".join(flips) or f"fp8={fp8}: every config made stock's decisions")
    assert len(flips) < len(diffusers_configs(None, 4)), "every config's decisions moved: nothing compared"


def test_step_caches_graphed_with_a_lora_and_weights_taking_turns(stand_in_graphs):
    """A LoRA (unfused, scale 0.7, then fused), CUDA graphs (the stand-in for capture): FastConfig(cache=...) equals
    its reference on stock with the same LoRA, its three pieces (first blocks, middle, last blocks and output) captured
    at a signature's second use and replayed after; so does it with memory="low" (weights taking turns); diffusers'
    FirstBlockCache (the step cache's rule, its pieces graphed) and TaylorSeer's lite mode (its hooks, the blocks
    replaying from graphs) with the LoRA equal stock with both."""
    from test_lora import LORA_A, LORA_B, lightning_format

    def with_lora(pipe):
        pipe.load_lora_weights(lightning_format(LORA_A + LORA_B), adapter_name="a")
        pipe.set_adapters(["a"], [0.7])
        return pipe

    config = DBCache.parse("every:2,1,1")
    ref = with_lora(stock("text_to_image"))
    ReferenceDBCache(ref.transformer, config)
    expected = run(ref, "text_to_image")
    fast = with_lora(optimize(stock("text_to_image"), EXACT.replace(cache=config)))
    assert_close(run(fast, "text_to_image"), expected, 1e-5, "DBCache with a LoRA")
    assert len(stand_in_graphs["captures"]) == 3 and stand_in_graphs["replays"], stand_in_graphs
    assert "cuda_graphs" in fast.applied
    fast.fuse_lora()  # merged into the weights: the same rule, the same result
    assert_close(run(fast, "text_to_image"), expected, 1e-5, "DBCache with a fused LoRA")
    low = with_lora(optimize(stock("text_to_image"), EXACT.replace(cache=config, memory="low")))
    assert_close(run(low, "text_to_image"), expected, 1e-5, "DBCache with a LoRA, memory='low'")
    assert "memory:low" in low.applied and f"step_cache:{config.label()}" in low.applied

    fast.fast_config = fast.fast_config.replace(cache=None)
    for config, graphed in ((FirstBlockCacheConfig(threshold=0.6), "cuda_graphs"),
                            (diffusers_configs(None, 3)["TaylorSeer-lite"], "cuda_graphs:blocks")):
        replays = len(stand_in_graphs["replays"])
        ref = with_lora(stock("text_to_image"))
        ref.transformer.enable_cache(config)
        fast.transformer.enable_cache(config)
        assert_close(run(fast, "text_to_image"), run(ref, "text_to_image"), 1e-5, f"{config} with a LoRA")
        assert graphed in fast.applied and len(stand_in_graphs["replays"]) > replays, fast.applied
        fast.transformer.disable_cache()


@pytest.mark.parametrize("blocks", [False, True], ids=["forwards", "blocks"])
def test_a_failed_capture_turns_graphs_off_for_the_pipeline(stand_in_graphs, monkeypatch, caplog, blocks):
    """A CUDA graph capture that fails (of whole forwards; or, under diffusers' TaylorSeer-lite hooks, of blocks)
    warns, its forward runs eagerly with the same result, and the pipeline neither captures nor replays again: the
    next call's `applied` has no cuda_graphs, and neither of the runner's stores keeps a graph."""
    from qwen_image_fast.pipelines.core.runtime import cuda_graph

    def failing_capture(store, run, inputs, static=None, pool=None):
        raise RuntimeError("stand-in capture failure")

    monkeypatch.setattr(cuda_graph.Graphs, "capture", failing_capture)
    ref, fast = stock("text_to_image"), optimize(stock("text_to_image"), EXACT)
    if blocks:
        for pipe in (ref, fast):
            pipe.transformer.enable_cache(diffusers_configs(pipe, 3)["TaylorSeer-lite"])
    expected = run(ref, "text_to_image")
    with caplog.at_level("WARNING", logger="qwen_image_fast.pipelines.core.runtime"):
        assert_close(run(fast, "text_to_image"), expected, 1e-5, "the call whose capture failed")
    assert any("CUDA graph capture failed" in r.getMessage() for r in caplog.records), caplog.records
    assert fast.runner.graphs_failed == "RuntimeError: stand-in capture failure"
    assert_close(run(fast, "text_to_image"), expected, 1e-5, "the next call")
    assert not any(label.startswith("cuda_graphs") for label in fast.applied), fast.applied
    assert not stand_in_graphs["captures"] and not stand_in_graphs["replays"], stand_in_graphs
    assert len(fast.runner.graphs) == len(fast.runner.block_graphs) == 0


def test_cache_context_arguments_reach_the_hooks_as_on_stock(monkeypatch):
    """A denoising loop of one's own around the transformer, passing the scheduler's step, sigma and step count as
    cache_context(name, step_index=..., sigma=..., num_inference_steps=...) (the pipelines pass a name only):
    SeaCache, with a raw-vision callback for Qwen-Image's packed latents, then decides from them on the fast
    transformer as on stock (its hooks: outside a pipeline call), skipping blocks, with the same outputs."""
    from test_transformer import make_inputs, tiny_stock

    from qwen_image_fast.pipelines.core.config import FastTransformerConfig
    from qwen_image_fast.pipelines.qwen_image.model.transformer import FastQwenImageTransformer

    def vision(module, args, kwargs):  # packed latents [B, L, C] of one (1, h, w) frame -> [C, 1, h, w] per sample
        _, h, w = kwargs["img_shapes"][0][0]
        return [x.T.reshape(-1, 1, h, w) for x in kwargs["hidden_states"]]

    steps, outputs, ran_per_model = 6, [], []
    for fast in (False, True):
        model = tiny_stock(num_layers=BLOCKS)
        if fast:
            model = FastQwenImageTransformer.from_diffusers(model, FastTransformerConfig(fp8=False))
        ran = decisions(monkeypatch, model, FAST_CLASSES if fast else STOCK_CLASSES)
        model.enable_cache(SeaCacheConfig(threshold=10.0, retention_steps=1, cache_end_steps=0,
                                          max_consecutive_cached=0, raw_vision_callback=vision))
        torch.manual_seed(0)
        inputs = make_inputs(model, "square", batch=1)
        out = []
        with torch.no_grad():
            for i in range(steps):
                sigma = 1 - i / steps
                inputs["timestep"] = torch.full((1,), sigma)
                with model.cache_context("cond", step_index=i, sigma=sigma, num_inference_steps=steps):
                    out.append(model(**inputs).sample)
                inputs["hidden_states"] = inputs["hidden_states"] - out[-1] / steps
        outputs.append(torch.stack(out))
        ran_per_model.append([m for m in ran if not m.endswith(".attn")])
        monkeypatch.undo()
    assert ran_per_model[0] == ran_per_model[1], ran_per_model
    assert len(ran_per_model[0]) < steps * BLOCKS, "SeaCache skipped nothing: the test would not see a decision"
    assert_close(outputs[1], outputs[0], 1e-5, "SeaCache decided by cache_context's arguments")
