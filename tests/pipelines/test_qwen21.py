"""Qwen-Image-2.1 on the fast path (pipelines/qwen_image21/): the fast transformer against diffusers'
QwenImage21Transformer2DModel on a tiny fp32 config, FP8 off (1e-5) and on (the FP8 bound), over the denoising
loop the pipeline runs (prefix KV cache extracted at the first step, then cached; or off), with and without a
condition image, one prompt or two of different lengths (right-padded, masked); and optimize(QwenImage21Pipeline)
against the stock pipeline."""

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, QwenImage21Pipeline, QwenImage21Transformer2DModel
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache
from helpers import assert_close, rel_rms_error

from qwen_image_fast import FastConfig, optimize
from qwen_image_fast.pipelines.core.config import FastTransformerConfig
from qwen_image_fast.pipelines.core.optimizations import FP8_BOUND
from qwen_image_fast.pipelines.qwen_image21.model import FastQwenImage21Transformer
from qwen_image_fast.pipelines.qwen_image21.pipeline import FastQwenImage21Pipeline
from qwen_image_fast.pipelines.tiny import (
    QWEN21_CHAT_TEMPLATE,
    QWEN21_SCHEDULER_CONFIG,
    TINY_QWEN21_TRANSFORMER,
    tiny_tokenizer,
    tiny_vl_processor,
)

TINY = TINY_QWEN21_TRANSFORMER  # 2 blocks of 2 heads x 16 (32 x 128 in the real model)


def tiny_stock(seed: int = 0, **overrides) -> QwenImage21Transformer2DModel:
    torch.manual_seed(seed)
    model = QwenImage21Transformer2DModel(**{**TINY, **overrides}).eval()
    with torch.no_grad():  # non-trivial norm weights (zero-centred ones start at 0), so a dropped one shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def inputs(batch: int, text_lengths: tuple, condition: tuple | None, target=(4, 6), seed: int = 1, config=TINY,
           device="cpu", dtype=torch.float32) -> dict:
    """What QwenImage21Pipeline hands the transformer: the VL encoder's hidden states [B, L, C] (right-padded, with
    a condition image's 2x2-token slots after the 3 first tokens), img_mask [B, L + T/4] (its slots and the
    target's appended), the latents [B, cond + T, C_in] (the condition image's first), img_shapes."""
    g = torch.Generator().manual_seed(seed)
    slots = 0 if condition is None else condition[0] * condition[1] // 4
    length = max(text_lengths) + slots
    text = torch.randn(batch, length, config["context_in_dim"], generator=g)
    mask = torch.zeros(batch, length, dtype=torch.long)
    for b, n in enumerate(text_lengths):
        mask[b, : n + slots] = 1
        text[b, n + slots:] = 0  # the pipeline pads with zeros
    img = torch.zeros(length, dtype=torch.bool)
    img[3: 3 + slots] = True
    t_tokens = target[0] * target[1]
    img_mask = torch.cat([img, torch.ones(t_tokens // 4, dtype=torch.bool)])[None].expand(batch, -1)
    shapes = ([(1, *condition)] if condition else []) + [(1, *target)]
    latents = torch.randn(batch, 4 * slots + t_tokens, config["in_channels"], generator=g)
    padded = len(set(text_lengths)) > 1
    return dict(hidden_states=latents.to(device, dtype), encoder_hidden_states=text.to(device, dtype),
                img_shapes=[shapes] * batch, img_mask=img_mask.to(device),
                encoder_hidden_states_mask=mask.bool().to(device) if padded else None)


def denoise(model, args: dict, steps: int, cache: bool) -> list[torch.Tensor]:
    """The pipeline's loop around the transformer (Euler steps on the target latents): each step's output."""
    args = dict(args)
    kv = QwenImage21KVCache(len(model.transformer_blocks)) if cache else None
    target = args["img_shapes"][0][-1][1] * args["img_shapes"][0][-1][2]
    outs = []
    with torch.no_grad():
        for i in range(steps):
            t = torch.full((args["hidden_states"].shape[0],), 1 - i / steps, device=args["hidden_states"].device,
                           dtype=args["hidden_states"].dtype)
            with model.cache_context("cond"):
                out = model(**args, timestep=t, kv_cache=kv, kv_cache_mode=("extract" if i == 0 else "cached")
                            if cache else None, return_dict=False)[0]
            outs.append(out)
            latents = args["hidden_states"]
            args["hidden_states"] = torch.cat([latents[:, :-target], latents[:, -target:] - out[:, -target:] / steps],
                                              dim=1)
    return outs


CASES = {  # id -> (batch, text lengths, condition image (h, w) in latent tokens)
    "t2i": (1, (7,), None),
    "t2i-two-lengths": (2, (7, 4), None),
    "condition": (1, (5,), (2, 4)),
    "condition-two-lengths": (2, (6, 3), (4, 2)),
}


@pytest.mark.parametrize("cache", [True, False], ids=["prefix-cache", "no-cache"])
@pytest.mark.parametrize("case", list(CASES))
def test_fast_transformer_matches_stock(case, cache):
    """fp32, FP8 off: every step's output equals stock's (1e-5): the prefill (block-causal prefix, segment by
    segment), the cached steps (the target's tokens against the cached prefix keys), the prefix's padding masked."""
    batch, lengths, condition = CASES[case]
    stock = tiny_stock()
    fast = FastQwenImage21Transformer.from_diffusers(stock, FastTransformerConfig(fp8=False))
    args = inputs(batch, lengths, condition)
    expected = denoise(stock, args, 3, cache)
    for i, (out, ref) in enumerate(zip(denoise(fast, args, 3, cache), expected)):
        assert_close(out, ref, 1e-5, f"{case} step {i}")


@pytest.mark.parametrize("case", ["t2i", "condition-two-lengths"])
def test_fast_transformer_fp8_within_bound(case):
    """FP8 block linears: the target's rows of every step's output (what the pipeline steps with) within the FP8
    bound of stock's. (A prefill's padded prompt rows, near zero and never read, differ more in relative terms.)"""
    stock = tiny_stock()
    fast = FastQwenImage21Transformer.from_diffusers(stock, FastTransformerConfig(fp8=True))
    args = inputs(*CASES[case])
    target = args["img_shapes"][0][-1][1] * args["img_shapes"][0][-1][2]
    for i, (out, ref) in enumerate(zip(denoise(fast, args, 3, True), denoise(stock, args, 3, True))):
        error = rel_rms_error(out[:, -target:], ref[:, -target:])
        assert 1e-5 < error <= FP8_BOUND.tiny, (i, error)  # FP8 ran (not exact) and within the bound


REAL = dict(TINY, attention_head_dim=128, num_attention_heads=32, in_channels=64, out_channels=64, context_in_dim=4096,
            axes_dims_rope=(16, 56, 56))


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_real_width_on_gpu(fp8):
    """2 blocks at the real width (32 heads x 128), bf16, random weights: the target's rows of every step of the
    cached loop (a condition image, two prompt lengths: the prefix's padding masked by the key count) against stock
    (its SDPA processor): bf16 rounding (fp8=False), the FP8 bound (fp8=True)."""
    from qwen_image_fast.pipelines.core.optimizations import FP8_BOUND

    stock = tiny_stock(**REAL).to("cuda", torch.bfloat16)
    fast = FastQwenImage21Transformer.from_diffusers(stock, FastTransformerConfig(fp8=fp8))
    args = inputs(2, (40, 23), (16, 16), target=(32, 48), config=REAL, device="cuda", dtype=torch.bfloat16)
    target = 32 * 48
    for i, (out, ref) in enumerate(zip(denoise(fast, args, 3, True), denoise(stock, args, 3, True))):
        error = rel_rms_error(out[:, -target:].float(), ref[:, -target:].float())
        assert error <= (FP8_BOUND.full if fp8 else 2e-2), (fast.attention_backend, i, error)


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["model", "group-block", "group-block-stream", "group-leaf"])
def test_offload_on_gpu(how):
    """diffusers' offload on the fast 2.1 pipeline (enable_model_cpu_offload; the transformer's group offload by
    block or leaf): the whole tiny pipeline's latents equal the resident fast pipeline's, and no CUDA graphs run
    while hooks move the weights."""
    from qwen_image_fast.pipelines.tiny import tiny_qwen21_components

    call = dict(prompt=["a cat", "a large dog in the park"], height=64, width=64, num_inference_steps=3,
                output_type="latent")

    def latents(pipe):
        return pipe(**call, generator=torch.Generator("cuda").manual_seed(0)).images

    resident = optimize(QwenImage21Pipeline(**tiny_qwen21_components()).to("cuda"),
                        FastConfig(fp8=False, cuda_graphs=False))
    expected = latents(resident)
    pipe = optimize(QwenImage21Pipeline(**tiny_qwen21_components()), FastConfig(fp8=False), device="cuda")
    if how == "model":
        pipe.enable_model_cpu_offload()
    else:
        kind, *stream = how.removeprefix("group-").split("-")
        pipe.text_encoder.to("cuda")
        pipe.vae.to("cuda")
        pipe.transformer.enable_group_offload(
            onload_device=torch.device("cuda"), offload_device=torch.device("cpu"), offload_type=f"{kind}_level",
            num_blocks_per_group=1 if kind == "block" else None, use_stream=bool(stream))
    assert_close(latents(pipe), expected, 1e-6, f"{how} offload vs resident")
    assert "cuda_graphs" not in pipe.applied and "fused_transformer" in pipe.applied


def test_left_padded_mask_is_refused():
    """The fast attention counts each sample's valid keys (the padding at the end): a mask with padding elsewhere
    is refused, not attended otherwise than stock."""
    fast = FastQwenImage21Transformer.from_diffusers(tiny_stock(), FastTransformerConfig(fp8=False))
    args = inputs(2, (7, 4), None)
    args["encoder_hidden_states_mask"] = args["encoder_hidden_states_mask"].flip(1)
    with pytest.raises(ValueError, match="right padding"):
        fast(**args, timestep=torch.ones(2))


def test_prefix_cache_slots_follow_their_handles():
    """Two caches in one call (cond, uncond) hold their own prefix; a cache never extracted fails as on stock; a
    later call's cache reuses a slot whose handle is gone."""
    stock = tiny_stock()
    fast = FastQwenImage21Transformer.from_diffusers(stock, FastTransformerConfig(fp8=False))
    cond, uncond = inputs(1, (7,), None, seed=1), inputs(1, (7,), None, seed=2)
    t = torch.ones(1)
    for model in (stock, fast):
        with pytest.raises(RuntimeError, match="not been populated"):
            model(**cond, timestep=t, kv_cache=QwenImage21KVCache(2), kv_cache_mode="cached")
    outs = {}
    for model in (stock, fast):
        caches = QwenImage21KVCache(2), QwenImage21KVCache(2)
        for args, kv in zip((cond, uncond), caches):
            model(**args, timestep=t, kv_cache=kv, kv_cache_mode="extract")
        outs[model] = [model(**args, timestep=t / 2, kv_cache=kv, kv_cache_mode="cached").sample
                       for args, kv in zip((cond, uncond), caches)]
    for out, ref in zip(outs[fast], outs[stock]):
        assert_close(out, ref, 1e-5, "two caches")
    assert len(fast.prefix_cache.slots) == 2
    del caches
    kv = QwenImage21KVCache(2)
    fast(**cond, timestep=t, kv_cache=kv, kv_cache_mode="extract")
    assert len(fast.prefix_cache.slots) == 2, "a gone handle's slot is reused"


# ---- the pipeline: optimize(QwenImage21Pipeline) keeps its own __call__

def tiny_pipeline(**transformer_overrides) -> QwenImage21Pipeline:
    """The pipeline around the tiny transformer, given prompt embeddings (no text encoder or VAE: output_type
    "latent"); its processor (the byte-level tiny tokenizer with Qwen's special tokens and a chat template) only
    serves the constructor's template arithmetic. Qwen-Image-2.1's scheduler config (dynamic exponential shift)."""
    processor = tiny_vl_processor(tiny_tokenizer(vision=True))
    processor.chat_template = QWEN21_CHAT_TEMPLATE
    scheduler = FlowMatchEulerDiscreteScheduler(**QWEN21_SCHEDULER_CONFIG)
    return QwenImage21Pipeline(scheduler=scheduler, vae=None, text_encoder=None, processor=processor,
                               transformer=tiny_stock(**transformer_overrides))


def pipeline_call(**extra) -> dict:
    """Two prompts of different lengths (right-padded, masked) and a negative prompt of a third length, CFG."""
    g = torch.Generator().manual_seed(3)
    embeds = torch.randn(2, 9, TINY["context_in_dim"], generator=g)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    embeds[1, 6:] = 0
    negative = torch.randn(2, 5, TINY["context_in_dim"], generator=g)
    return dict(prompt_embeds=embeds, prompt_embeds_mask=mask, negative_prompt_embeds=negative, true_cfg_scale=2.0,
                height=64, width=96, num_inference_steps=3, output_type="latent") | extra


def latents(pipe, **extra) -> torch.Tensor:
    return pipe(**pipeline_call(**extra), generator=torch.Generator().manual_seed(0)).images


@pytest.mark.parametrize("use_kv_cache", [True, False])
def test_optimized_pipeline_matches_stock(use_kv_cache):
    """optimize(QwenImage21Pipeline): the fast pipeline class with the stock __call__; its latents equal stock's
    (fp32, FP8 off) with the prefix cache on (cond and uncond each their own) and off; applied says what ran (batched
    CFG: the cached steps paired, so only with the prefix cache) and the plan why CUDA graphs do not."""
    from qwen_image_fast.pipelines.core.optimizations import plans

    expected = latents(tiny_pipeline(), use_kv_cache=use_kv_cache)
    fast = optimize(tiny_pipeline(), FastConfig(fp8=False))
    assert isinstance(fast, FastQwenImage21Pipeline) and isinstance(fast.transformer, FastQwenImage21Transformer)
    assert_close(latents(fast, use_kv_cache=use_kv_cache), expected, 1e-5, f"use_kv_cache={use_kv_cache}")
    assert fast.applied == ["fused_transformer", "attention:sdpa"] + (["batched_cfg"] if use_kv_cache else []), \
        fast.applied
    why_not = {opt.name: plan.why_not for opt, plan in plans(fast.fast_config, fast.facts())}
    assert why_not["batched_cfg"] is None
    assert why_not["cuda_graphs"] and why_not["modulation_table"], why_not
    assert why_not["vae_2d_decode"] == "the pipeline has no VAE", why_not
    assert len(fast.transformer.prefix_cache.slots) == (2 if use_kv_cache else 0)


@pytest.mark.parametrize("batched_cfg", [True, False], ids=["paired", "one-by-one"])
def test_cached_steps_replay_from_graphs_across_calls(stand_in_graphs, batched_cfg):
    """CUDA graphs (the stand-in for capture): a cached step's graph is captured at its second use, per cache (cond,
    uncond), or one for both paired by batched CFG, and replayed; the next call's caches take the same slots, so its
    cached steps all replay; both calls equal stock."""
    call = dict(num_inference_steps=4, use_kv_cache=True)
    expected = latents(tiny_pipeline(), **call)
    fast = optimize(tiny_pipeline(), FastConfig(fp8=False, batched_cfg=batched_cfg))
    graphs = 1 if batched_cfg else 2  # the pair's, or cond's and uncond's
    for n in range(2):
        captures, replays = len(stand_in_graphs["captures"]), len(stand_in_graphs["replays"])
        assert_close(latents(fast, **call), expected, 1e-5, f"call {n}")
        assert "cuda_graphs" in fast.applied and ("batched_cfg" in fast.applied) == batched_cfg, fast.applied
        # 3 cached steps a call for each graph: call 0 runs one eagerly, captures at the next
        assert len(stand_in_graphs["captures"]) - captures == (graphs if n == 0 else 0), stand_in_graphs
        assert len(stand_in_graphs["replays"]) - replays == (2 if n == 0 else 3) * graphs, stand_in_graphs
    assert len(fast.transformer.layouts) == 2  # the prompts' and the negative prompts' (another text length)
    # another size: its caches take new slots, which free the first size's (their handles are gone) and the graphs
    # that read them
    assert_close(latents(fast, **call, height=96), latents(tiny_pipeline(), **call, height=96), 1e-5, "96 high")
    assert len(fast.transformer.prefix_cache.slots) == 2 and len(fast.runner.graphs) == graphs


def test_a_slot_freed_without_graphs_never_replays_its_graphs(stand_in_graphs):
    """The graphs live in the pipeline's runner, keyed by the prefix slot's serial number: a call without CUDA graphs
    that frees a size's slots (another size) leaves their graphs behind, and when that size comes back its new slots
    (the same shape, so the same place among the slots) capture anew instead of replaying graphs that read the
    freed buffers; the stale graphs are dropped, and every call equals stock."""
    call = dict(num_inference_steps=3, use_kv_cache=True)
    expected = {height: latents(tiny_pipeline(), **call, height=height) for height in (64, 96)}
    fast = optimize(tiny_pipeline(), FastConfig(fp8=False, batched_cfg=False))  # a graph per slot
    assert_close(latents(fast, **call, height=64), expected[64], 1e-5, "64 high, graphs")
    assert len(stand_in_graphs["captures"]) == 2 and len(fast.runner.graphs) == 2
    fast.fast_config = FastConfig(fp8=False, cuda_graphs=False, batched_cfg=False)
    assert_close(latents(fast, **call, height=96), expected[96], 1e-5, "96 high, no graphs")
    assert "cuda_graphs" not in fast.applied and len(fast.runner.graphs) == 2  # nothing dropped them yet
    fast.fast_config = FastConfig(fp8=False, batched_cfg=False)
    replays = len(stand_in_graphs["replays"])
    assert_close(latents(fast, **call, height=64), expected[64], 1e-5, "64 high again, graphs")
    assert len(stand_in_graphs["captures"]) == 4, "the new slots' steps are captured anew"
    assert len(stand_in_graphs["replays"]) - replays == 2, stand_in_graphs
    serials = {slot[2] for slot in fast.transformer.prefix_cache.slots.values()}
    assert {serial for key in fast.runner.graphs.graphs for serial in key[2][1]} == serials, \
        "the freed slots' graphs are dropped"


def test_a_failed_capture_turns_the_steps_graphs_off_for_the_pipeline(stand_in_graphs, monkeypatch, caplog):
    """A cached step's capture that fails warns, the step runs eagerly with the same result, and the pipeline's
    runner captures and replays no more (the 2512 pipelines' policy: one runner, one policy)."""
    from qwen_image_fast.pipelines.core.runtime import cuda_graph

    def failing_capture(store, run, inputs, static=None, pool=None):
        raise RuntimeError("stand-in capture failure")

    monkeypatch.setattr(cuda_graph.Graphs, "capture", failing_capture)
    call = dict(num_inference_steps=4, use_kv_cache=True)
    expected = latents(tiny_pipeline(), **call)
    fast = optimize(tiny_pipeline(), FastConfig(fp8=False))
    with caplog.at_level("WARNING", logger="qwen_image_fast.pipelines.core.runtime"):
        assert_close(latents(fast, **call), expected, 1e-5, "the call whose capture failed")
    assert any("CUDA graph capture failed" in r.getMessage() for r in caplog.records), caplog.records
    assert fast.runner.graphs_failed == "RuntimeError: stand-in capture failure"
    assert_close(latents(fast, **call), expected, 1e-5, "the next call")
    assert "cuda_graphs" not in fast.applied and len(fast.runner.graphs) == 0, fast.applied


@pytest.mark.gpu
def test_cached_steps_replay_real_graphs_on_gpu():
    """Real CUDA graphs (the pipeline's runner's store): the tiny pipeline with CFG renders the same latents with
    graphs as without, bit for bit, in two calls in a row (the second replays every cached step of both branches,
    in the first call's slots), and applied says cuda_graphs."""
    from qwen_image_fast.pipelines.tiny import tiny_qwen21_components

    # one negative prompt per prompt: diffusers 0.42.1's QwenImage21Pipeline fails on a single string for two prompts
    call = dict(prompt=["a cat", "a large dog in the park"], negative_prompt=["blurry", "dark"], true_cfg_scale=2.0,
                height=64, width=64, num_inference_steps=4, output_type="latent")

    def latents(pipe):
        return pipe(**call, generator=torch.Generator("cuda").manual_seed(0)).images

    eager = optimize(QwenImage21Pipeline(**tiny_qwen21_components()).to("cuda"),
                     FastConfig(fp8=False, cuda_graphs=False))
    expected = latents(eager)
    assert "cuda_graphs" not in eager.applied
    graphed = optimize(QwenImage21Pipeline(**tiny_qwen21_components()).to("cuda"), FastConfig(fp8=False))
    for n in range(2):
        assert torch.equal(latents(graphed), expected), f"call {n}"
        assert "cuda_graphs" in graphed.applied, graphed.applied
    assert len(graphed.runner.graphs) == 1 and graphed.runner.graphs_failed is None  # the paired steps'
    assert "batched_cfg" in graphed.applied and "batched_cfg" in eager.applied


def test_optimized_pipeline_fp8_and_baseline():
    """FP8 block linears: within the FP8 bound of stock, and recorded; the baseline preset keeps the stock
    transformer and equals stock exactly."""
    expected = latents(tiny_pipeline())
    fp8 = optimize(tiny_pipeline(), FastConfig(fp8=True))
    error = rel_rms_error(latents(fp8), expected)
    assert 1e-6 < error <= FP8_BOUND.tiny, error
    assert fp8.applied == ["fused_transformer", "fp8", "fp8_fast_accum", "attention:sdpa", "batched_cfg"], fp8.applied
    baseline = optimize(tiny_pipeline(), "baseline")
    assert isinstance(baseline.transformer, QwenImage21Transformer2DModel)
    assert torch.equal(latents(baseline), expected) and baseline.applied == [], baseline.applied


def test_a_few_step_sigma_schedule_through_diffusers_api_matches_stock(stand_in_graphs):
    """A few-step LoRA's own schedule (6 sigmas, as the community's turbo LoRA for 2.1 passes them) through the stock
    __call__'s sigmas=: the fast pipeline's latents equal stock's, with its cached steps replaying from graphs in a
    second call."""
    sigmas = [1.0, 0.92, 0.8, 0.62, 0.4, 0.15]
    call = dict(num_inference_steps=len(sigmas), sigmas=sigmas, use_kv_cache=True)
    expected = latents(tiny_pipeline(), **call)
    fast = optimize(tiny_pipeline(), FastConfig(fp8=False))
    for n in range(2):
        replays = len(stand_in_graphs["replays"])
        assert_close(latents(fast, **call), expected, 1e-5, f"call {n}")
        assert len(stand_in_graphs["replays"]) > replays, f"call {n} replayed no graph"
    assert "cuda_graphs" in fast.applied, fast.applied


def test_sample_sigmas_carried_through_every_build(tmp_path):
    """A pipeline built with the checkpoint's sampling grid (QwenImage21Pipeline's optional sample_sigmas, which
    its __call__ samples on when no sigmas are passed): optimize(), from_pipe() and a fast save / from_pretrained
    keep it, and the latents equal stock's on that grid (diffusers' `components` leaves it out)."""
    from qwen_image_fast import from_pretrained
    from qwen_image_fast.pipelines.tiny import tiny_qwen21_components

    grid = [1.0, 0.7, 0.3]

    def with_grid():
        pipe = tiny_pipeline()
        return QwenImage21Pipeline(**pipe.components, sample_sigmas=grid)

    expected = latents(with_grid())
    assert rel_rms_error(expected, latents(tiny_pipeline())) > 1e-3  # the grid changes the result
    fast = optimize(with_grid(), FastConfig(fp8=False))
    assert list(fast.config.sample_sigmas) == grid
    assert_close(latents(fast), expected, 1e-5, "optimize")
    piped = FastQwenImage21Pipeline.from_pipe(with_grid(), fast_config=FastConfig(fp8=False))
    assert isinstance(piped, FastQwenImage21Pipeline) and list(piped.config.sample_sigmas) == grid
    assert_close(latents(piped), expected, 1e-5, "from_pipe")
    saved = optimize(QwenImage21Pipeline(**tiny_qwen21_components(), sample_sigmas=grid), FastConfig(fp8=False))
    saved.save_pretrained(tmp_path)
    assert list(from_pretrained(tmp_path).config.sample_sigmas) == grid


def test_a_fast_transformer_given_must_match_the_config():
    """A pipeline built around a fast transformer already: a fast_config that contradicts it (the stock
    transformer, or other GEMMs) is refused, as for Qwen-Image-2512, instead of reported and not run."""
    fast = FastQwenImage21Transformer.from_diffusers(tiny_stock(), FastTransformerConfig(fp8=True))
    parts = tiny_pipeline().components
    for config, match in (("baseline", "fused_transformer=False"), (FastConfig(fp8=False), "fp8=False")):
        stored = r"FastQwenImage21Transformer \(fp8=True, bf16_linears=\[\]\)"
        with pytest.raises(ValueError, match=f"{stored}.+{match}"):
            FastQwenImage21Pipeline(**(parts | dict(transformer=fast)), fast_config=config)
    pipe = FastQwenImage21Pipeline(**(parts | dict(transformer=fast)), fast_config=FastConfig(fp8=True))
    assert pipe.transformer is fast and "fp8" in pipe.applied


def test_a_new_batch_with_the_same_masks_gets_its_own_layout():
    """The same img_mask tensor and img_shapes with another batch of hidden states (stock reads the layout from
    row 0 only, so this is valid there): the fast model builds that batch's layout instead of reusing the last."""
    stock = tiny_stock()
    fast = FastQwenImage21Transformer.from_diffusers(stock, FastTransformerConfig(fp8=False))
    args = inputs(2, (5, 5), None)
    for batch in (2, 1, 2):
        call = dict(args, hidden_states=args["hidden_states"][:batch],
                    encoder_hidden_states=args["encoder_hidden_states"][:batch],
                    timestep=torch.full((batch,), 0.5), return_dict=False)
        with torch.no_grad():
            assert_close(fast(**call)[0], stock(**call)[0], 1e-5, f"batch {batch}")


def test_qwen21_refuses_what_it_cannot_run(tmp_path):
    for config, match in ((FastConfig(scheduler="unipc"), "scheduler='unipc'"),
                          (FastConfig(text_bucket=128), "text_bucket=128: FastQwenImage21Pipeline keeps"),
                          (FastConfig(bf16_linears=("img_fc2",)), "names Qwen-Image-2512's linears"),
                          (FastConfig(fp8_attention="cudnn"), "fp8_attention='cudnn' is not available on "
                                                              "Qwen-Image-2.1: .+ use fp8_attention='fa3' or 'auto'")):
        with pytest.raises(ValueError, match=match):
            optimize(tiny_pipeline(), config)
    fast = optimize(tiny_pipeline(), FastConfig(fp8=False))
    with pytest.raises(ValueError, match="already optimized"):
        optimize(fast)
    with pytest.raises(ValueError, match="text_bucket=8"):
        fast.fast_config = fast.fast_config.replace(text_bucket=8)
    with pytest.raises(ValueError, match="scheduler='unipc': supported by the text-to-image QwenImageFastPipeline"):
        fast.fast_config = fast.fast_config.replace(scheduler="unipc")
    # ModelMixin's versions would run on the fast model otherwise (e.g. cast its FP8 weights, compile its forward)
    for method, args in (("enable_cache", (None,)), ("set_attention_backend", ("x",)), ("set_attn_processor", ("x",)),
                         ("enable_gradient_checkpointing", ()), ("fuse_qkv_projections", ()),
                         ("enable_layerwise_casting", ()), ("compile_repeated_blocks", ()), ("dequantize", ()),
                         ("enable_parallelism", (None,)), ("add_adapter", (None,)), ("save_lora_adapter", ("x",))):
        with pytest.raises(NotImplementedError, match=f"FastQwenImage21Transformer.{method}: .+"):
            getattr(fast.transformer, method)(*args)
    with pytest.raises(NotImplementedError, match="not on Qwen-Image-2.1 yet"):
        fast.transformer.enable_parallelism(None)
    with pytest.raises(NotImplementedError, match="FastQwenImage21Transformer.attn_processors: .+"):
        fast.transformer.attn_processors  # noqa: B018


@pytest.mark.parametrize("condition", [False, True], ids=["text-to-image", "condition-image"])
def test_prompts_through_the_whole_pipeline_match_stock(condition):
    """The tiny QwenImage21Pipeline end to end from prompts (its Qwen3-VL text encoder and processor; two prompts
    of different lengths, right-padded; two images each without a condition image), with and without an RGBA
    condition image (the VL encoder reads it, the VAE encodes it into condition tokens): the optimized pipeline's
    latents equal stock's."""
    import numpy as np
    from PIL import Image

    from qwen_image_fast.pipelines.tiny import tiny_qwen21_components

    image = Image.fromarray((np.random.RandomState(0).rand(64, 96, 4) * 255).astype("uint8"), "RGBA")
    call = dict(prompt=["a cat on a mat", "a dog"], num_inference_steps=3, height=64, width=64, output_type="latent",
                output_resolution=64, **(dict(image=image) if condition else dict(num_images_per_prompt=2)))
    expected = QwenImage21Pipeline(**tiny_qwen21_components())(**call, generator=torch.Generator().manual_seed(0))
    fast = optimize(QwenImage21Pipeline(**tiny_qwen21_components()), FastConfig(fp8=False))
    out = fast(**call, generator=torch.Generator().manual_seed(0))
    assert out.images.shape[0] == (2 if condition else 4), out.images.shape
    assert_close(out.images, expected.images, 1e-5, f"condition={condition}")


def test_from_pretrained_loads_a_saved_checkpoint(tmp_path):
    """A QwenImage21Pipeline saved by diffusers (the tiny one): qwen_image_fast.from_pretrained picks the fast class
    from its model_index.json and loads it (without torchvision, its Qwen3VLProcessor as vl_processor.py builds it,
    with the saved chat template); the latents equal the stock pipeline's."""
    from qwen_image_fast import from_pretrained
    from qwen_image_fast.pipelines.tiny import tiny_qwen21_components

    stock = QwenImage21Pipeline(**tiny_qwen21_components())
    stock.save_pretrained(tmp_path)
    fast = from_pretrained(tmp_path, fast_config=FastConfig(fp8=False))
    assert isinstance(fast, FastQwenImage21Pipeline) and type(fast.processor).__name__ == "Qwen3VLProcessor"
    call = dict(prompt="a cat", num_inference_steps=2, height=64, width=64, output_type="latent")
    assert_close(fast(**call, generator=torch.Generator().manual_seed(0)).images,
                 stock(**call, generator=torch.Generator().manual_seed(0)).images, 1e-5, "from_pretrained")


@pytest.mark.parametrize("fp8", [False, True])
def test_save_and_load_back_as_it_was(tmp_path, fp8):
    """A fast 2.1 pipeline's save_pretrained (diffusers' arguments), then qwen_image_fast.from_pretrained: the same
    class, its transformer's state bit for bit (the FP8 weights and scales as stored, not requantized), with the
    options it was saved with, computing what it computed; fp8 asked otherwise than stored is refused, as are
    diffusers' own loaders (the folder holds FP8 weights in the fused layout)."""
    import json

    from qwen_image_fast import from_pretrained
    from qwen_image_fast.pipelines.tiny import tiny_qwen21_components

    pipe = optimize(QwenImage21Pipeline(**tiny_qwen21_components()), FastConfig(fp8=fp8))
    pipe.save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert index["_class_name"] == "FastQwenImage21Pipeline"
    assert index["transformer"][-1] == "FastQwenImage21Transformer"
    assert len(list((tmp_path / "transformer").glob("*.safetensors"))) > 1
    loaded = from_pretrained(tmp_path)
    assert type(loaded) is FastQwenImage21Pipeline and loaded.fast_config.fp8 == fp8
    before, after = pipe.transformer.state_dict(), loaded.transformer.state_dict()
    assert before.keys() == after.keys() and any(k.endswith("weight_q") for k in before) == fp8
    assert all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype for k in before)
    call = dict(prompt="a cat", num_inference_steps=2, height=64, width=64, output_type="latent")
    assert_close(loaded(**call, generator=torch.Generator().manual_seed(0)).images,
                 pipe(**call, generator=torch.Generator().manual_seed(0)).images, 1e-6, "loaded")
    with pytest.raises(ValueError, match=f"stores the block linears with fp8={fp8}"):
        from_pretrained(tmp_path, FastConfig(fp8=not fp8))
    with pytest.raises(ValueError, match="diffusers' own pipelines and loaders cannot load"):
        QwenImage21Pipeline.from_pretrained(tmp_path, processor=loaded.processor)  # (its own needs torchvision)


# ---- LoRA: diffusers' API on the fast 2.1 transformer, against the stock pipeline with the same LoRA through peft

LORA_TARGETS = [f"transformer_blocks.{i}.{m}" for i in (0, 1) for m in
                ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "img_mlp.gate_layer", "img_mlp.proj",
                 "img_mlp.out")] + ["img_in", "proj_out", "txt_in.in_layer", "modulation.1"]


def random_lora(seed: int) -> dict:
    """peft / diffusers keys (test_lora.diffusers_format) on every 2.1 block linear (its fused qkv and gate_up
    parts separately) and some others."""
    from test_lora import diffusers_format

    shapes = {n: (m.in_features, m.out_features) for n, m in tiny_stock().named_modules()
              if isinstance(m, torch.nn.Linear)}
    return diffusers_format(LORA_TARGETS, seed=seed, shapes=shapes)


def test_lora_matches_stock():
    """Two LoRAs loaded after optimize() (one before, carried over), weights, attention_kwargs scale, fuse and
    unfuse: the latents equal the stock pipeline's with the same LoRAs through peft."""
    import peft  # noqa: F401  (a test dependency: missing, the test fails rather than skips)
    stock, before = tiny_pipeline(), tiny_pipeline()
    for pipe in (stock, before):
        pipe.load_lora_weights(random_lora(1), adapter_name="a")
    fast = optimize(tiny_pipeline(), FastConfig(fp8=False))
    fast.load_lora_weights(random_lora(1), adapter_name="a")
    carried = optimize(before, FastConfig(fp8=False))
    plain = latents(tiny_pipeline())
    for name, pipe in (("loaded after", fast), ("carried over", carried)):
        assert_close(latents(pipe), latents(stock), 1e-5, name)
    assert rel_rms_error(latents(stock), plain) > 1e-2, "the LoRA changed nothing: the test would not see it"
    for pipe in (stock, fast):
        pipe.load_lora_weights(random_lora(2), adapter_name="b")
        pipe.set_adapters(["a", "b"], [0.7, 0.4])
    assert_close(latents(fast), latents(stock), 1e-5, "two adapters, weights")
    assert_close(latents(fast, attention_kwargs={"scale": 0.5}), latents(stock, attention_kwargs={"scale": 0.5}), 1e-5,
                 "attention_kwargs scale")
    for pipe in (stock, fast):
        pipe.fuse_lora()
    assert_close(latents(fast), latents(stock), 1e-5, "fused")
    for pipe in (stock, fast):
        pipe.unfuse_lora()
        pipe.unload_lora_weights()
    assert_close(latents(fast), plain, 1e-5, "unfused and unloaded")


def test_float16_clips_as_diffusers_blocks_do():
    """float16: diffusers' block clips its output to +-65504; the fast one too (here the MLP's gated output is
    scaled so that the residual stream passes the range: without the clip it overflows to inf)."""
    stock = tiny_stock()
    dim = stock.inner_dim
    with torch.no_grad():  # the MLP's output near the float16 maximum, its gate tanh(.) near +-1: the sum overflows
        for block in stock.transformer_blocks:
            block.img_mlp.out.weight.mul_(1.3e5)
        stock.modulation[1].weight[3 * dim:].mul_(100)
    stock = stock.half()
    fast = FastQwenImage21Transformer.from_diffusers(stock, FastTransformerConfig(fp8=False))
    args = inputs(1, (7,), (2, 4), dtype=torch.float16)
    clipped = []  # stock's block outputs at the float16 maximum: its clip ran on values beyond the range
    for block in stock.transformer_blocks:
        block.register_forward_hook(lambda module, a, output: clipped.extend(
            bool((t.abs() == 65504).any()) for t in (output if isinstance(output, tuple) else (output,))
            if isinstance(t, torch.Tensor)))
    for i, (out, ref) in enumerate(zip(denoise(fast, args, 2, True), denoise(stock, args, 2, True))):
        assert torch.isfinite(ref).all() and torch.isfinite(out).all(), i
        assert_close(out.float(), ref.float(), 2e-2, f"float16 step {i}")
    assert any(clipped), "stock's blocks never reached the float16 range: the test does not exercise the clip"
