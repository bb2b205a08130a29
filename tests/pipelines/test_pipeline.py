"""QwenImageFastPipeline against the stock QwenImagePipeline on tiny random components (CPU, offline)."""

import inspect
import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline
from diffusers.pipelines.qwenimage.pipeline_output import QwenImagePipelineOutput
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift
from diffusers.utils import logging as diffusers_logging
from helpers import assert_close
from transformers import Qwen2Tokenizer

from qwen_image_fast import FastConfig, PromptEnhancer, QwenImageFastPipeline, optimize
from qwen_image_fast.kernels._utils import rel_rms_error
from qwen_image_fast.pipelines.core.optimizations import BY_NAME
from qwen_image_fast.pipelines.core.config import DBCache
from qwen_image_fast.pipelines.qwen35.enhance import DEFAULT_ENHANCER_ID
from qwen_image_fast.pipelines.qwen_image.model.transformer import FastQwenImageTransformer
from qwen_image_fast.pipelines.qwen35.enhance import tiny_enhancer
from qwen_image_fast.pipelines.tiny import tiny_components, tiny_tokenizer

FIXTURE_TOKENIZER = Path(__file__).resolve().parents[1] / "fixtures" / "tiny_qwen_tokenizer"
EXACT = FastConfig(fp8=False)  # numerics-neutral options only: BF16 mode (fp32 here), Euler, CFG every step


def stock_pipeline(seed=0) -> QwenImagePipeline:
    components = tiny_components(seed)
    components["tokenizer"] = Qwen2Tokenizer.from_pretrained(FIXTURE_TOKENIZER)
    return QwenImagePipeline(**components)


def fast_pipeline(config=EXACT, seed=0) -> QwenImageFastPipeline:
    return optimize(stock_pipeline(seed), config)


def run(pipe, seed=0, **kwargs):
    defaults = dict(height=32, width=48, num_inference_steps=3, output_type="latent")
    return pipe(**{**defaults, **kwargs}, generator=torch.Generator().manual_seed(seed)).images


def count_forwards(pipe) -> list[int]:
    """Record the batch size of every forward the fast transformer computes."""
    sizes = []
    compute = pipe.transformer.compute

    def counting(**inputs):
        sizes.append(inputs["hidden_states"].shape[0])
        return compute(**inputs)

    pipe.transformer.compute = counting
    return sizes


def test_fixture_tokenizer_is_the_tiny_tokenizer():
    text = "<|im_start|>user\nA red fox, 狐狸<|im_end|>"
    assert Qwen2Tokenizer.from_pretrained(FIXTURE_TOKENIZER)(text).input_ids == tiny_tokenizer()(text).input_ids


def test_template_prefix_is_34_tokens_like_the_real_tokenizer():
    pipe = stock_pipeline()
    ids = pipe.tokenizer(pipe.prompt_template_encode.format("xyz")).input_ids
    assert pipe.tokenizer.decode(ids[pipe.prompt_template_encode_start_idx:][:3]) == "xyz"


def test_call_signature_matches_upstream():
    def params(fn):
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    assert params(QwenImageFastPipeline.__call__) == params(QwenImagePipeline.__call__)


def test_from_pretrained_loads_the_upstream_layout(tmp_path):
    stock_pipeline().save_pretrained(tmp_path)
    pipe = QwenImageFastPipeline.from_pretrained(tmp_path, dtype=torch.float32, fast_config=EXACT)
    assert type(pipe) is QwenImageFastPipeline
    assert pipe.applied == ["fused_transformer", "attention:sdpa", "modulation_table", "batched_cfg", "vae_2d_decode"]
    assert_close(run(pipe, prompt="a cat"), run(QwenImagePipeline.from_pretrained(tmp_path), prompt="a cat"), 1e-5)


@pytest.mark.parametrize("case", [
    dict(prompt="a cat sitting on a mat", negative_prompt="blurry"),
    dict(prompt=["a cat", "a large dog in the park"], negative_prompt=["ugly, low quality", "bad"]),
    dict(prompt=["a cat", "a large dog in the park"], negative_prompt=["bad", "ugly"], num_images_per_prompt=2),
    dict(prompt="no guidance", true_cfg_scale=1.0),
])
def test_latents_match_stock_pipeline(case):
    stock, fast = stock_pipeline(), fast_pipeline()
    sizes = count_forwards(fast)
    expected = run(stock, **case)
    assert_close(run(fast, **case), expected, 1e-5, "fast vs stock latents (fp32)")
    batch = expected.shape[0]
    cfg = case.get("true_cfg_scale", 4.0) > 1
    assert sizes == [2 * batch if cfg else batch] * 3  # batched CFG: one forward of 2N per step


def test_one_negative_string_serves_every_prompt():
    # the stock pipeline fails on this combination (text batch 1 vs latent batch 2); ours repeats the negative
    prompts = ["a cat", "a large dog in the park"]
    ours = run(fast_pipeline(), prompt=prompts, negative_prompt="bad")
    assert_close(ours, run(stock_pipeline(), prompt=prompts, negative_prompt=["bad", "bad"]), 1e-5)


def test_unipc_reproduces_qwen_sigma_ladder():
    fast = fast_pipeline(EXACT.replace(scheduler="unipc"))
    run(fast, prompt="a cat", num_inference_steps=6)
    euler = stock_pipeline().scheduler
    run(stock_pipeline(), prompt="a cat", num_inference_steps=6)  # sets nothing on `euler`: a fresh object
    sigmas = np.linspace(1.0, 1 / 6, 6)
    mu = calculate_shift(24, 256, 8192, 0.5, 0.9)
    euler.set_timesteps(6, sigmas=sigmas, mu=mu)
    torch.testing.assert_close(fast.sampler.sigmas, euler.sigmas, atol=2e-6, rtol=0)


def test_config_presets_and_tag():
    assert FastConfig.preset("fast") == FastConfig()
    assert FastConfig().tag() == "fused-fp8-fastacc-auto-bcfg-graphs-table-euler-vae2d"
    assert FastConfig(fp8_fast_accum=False, modulation_table=False).tag() == "fused-fp8-auto-bcfg-graphs-euler-vae2d"
    assert FastConfig(memory="low").tag() == "fused-fp8-fastacc-auto-bcfg-graphs-table-lowmem-euler-vae2d"
    assert FastConfig.preset("baseline").tag() == "stock-euler"
    assert FastConfig(scheduler="dpm++2m", cfg_fraction=0.5, vae_2d_decode=False).tag() == \
        "fused-fp8-fastacc-auto-bcfg-graphs-table-dpmpp2m-cfg0.5"
    with pytest.raises(ValueError, match="preset='turbo'; allowed: fast, baseline"):
        FastConfig.preset("turbo")


def test_default_output_is_the_upstream_class_with_images():
    out = fast_pipeline()(prompt="a cat", negative_prompt="blurry", height=32, width=32, num_inference_steps=2)
    assert isinstance(out, QwenImagePipelineOutput) and out.images[0].size == (32, 32)


def test_from_pipe_leaves_the_source_pipeline_stock():
    stock = stock_pipeline()
    fast = QwenImageFastPipeline.from_pipe(stock, fast_config=EXACT)
    assert type(fast) is QwenImageFastPipeline and type(stock) is QwenImagePipeline
    assert type(stock.transformer).__name__ == "QwenImageTransformer2DModel"
    assert_close(run(fast, prompt="a cat", negative_prompt="x"), run(stock, prompt="a cat", negative_prompt="x"), 1e-5)


def test_from_pipe_keeps_the_dtype_of_a_bf16_pipeline():
    # diffusers' from_pipe alone would cast the shared components (and so the source pipeline) to float32
    stock = stock_pipeline().to(torch.bfloat16)
    fast = QwenImageFastPipeline.from_pipe(stock, fast_config=FastConfig(fp8=False))
    assert stock.transformer.dtype == stock.text_encoder.dtype == stock.vae.dtype == torch.bfloat16
    assert fast.transformer.dtype == torch.bfloat16


def test_bad_input_names_the_value():
    pipe = fast_pipeline()
    with pytest.raises(ValueError, match=r"prompt=\[\] is empty"):
        run(pipe, prompt=[])
    with pytest.raises(ValueError, match="negative_prompt has 1 entries but prompt has 2"):
        run(pipe, prompt=["a", "b"], negative_prompt=["c"])
    # the tiny scheduler keeps Qwen-Image's shift_terminal, which refuses 1 step as well (check_not_one_step)
    with pytest.raises(ValueError, match=r"num_inference_steps=0; allowed: an integer >= 2 \(this scheduler's "
                                         r"shift_terminal refuses 1 step too\)"):
        run(pipe, prompt="a", num_inference_steps=0)
    with pytest.raises(ValueError, match="num_inference_steps=1: FlowMatchEulerDiscreteScheduler's shift_terminal"):
        run(pipe, prompt="a", num_inference_steps=1)
    with pytest.raises(ValueError, match="scheduler='ddim'; allowed: euler, dpm\\+\\+2m, unipc"):
        FastConfig(scheduler="ddim")
    with pytest.raises(ValueError, match="sigmas is not supported with scheduler='dpm\\+\\+2m'"):
        run(fast_pipeline(FastConfig(scheduler="dpm++2m")), prompt="a", sigmas=[1.0, 0.5])
    with pytest.raises(ValueError, match="already optimized"):
        optimize(pipe)


@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")  # stock's 0/0
def test_one_step_gives_nan_on_stock_and_is_refused_here():
    """Stock diffusers turns one step into NaN latents (a black image); ours says why instead of running it. If a
    diffusers release fixes its scheduler, the first assertion fails: then ours should run one step as stock does."""
    assert torch.isnan(run(stock_pipeline(), prompt="a cat", num_inference_steps=1)).all()
    with pytest.raises(ValueError, match=r"num_inference_steps=1: FlowMatchEulerDiscreteScheduler's shift_terminal="
                                         r"0.02 .* stock diffusers denoises with NaN and returns a black image; use 2"):
        run(fast_pipeline(), prompt="a cat", num_inference_steps=1)
    with pytest.raises(ValueError, match=r"sigmas=\[1.0\]: .* returns a black image"):
        run(fast_pipeline(), prompt="a cat", num_inference_steps=1, sigmas=[1.0])
    one_sigma = dict(prompt="a cat", num_inference_steps=1, sigmas=[0.5])  # a last sigma below 1 runs, as on stock
    assert_close(run(fast_pipeline(), **one_sigma), run(stock_pipeline(), **one_sigma), 1e-5, "sigmas=[0.5]")


def test_size_not_multiple_of_16_is_rounded_like_diffusers(caplog):
    # The real VAE downsamples 8x, so sizes round to multiples of 16; the tiny VAE 4x, so multiples of 8 here.
    pipe = fast_pipeline()
    multiple = 2 * pipe.vae_scale_factor
    diffusers_logging.enable_propagation()  # diffusers' own check_inputs warns through its logger
    with caplog.at_level(logging.WARNING):
        out = run(pipe, prompt="a", height=5 * multiple + 3, width=6 * multiple + 5)
    assert f"divisible by {multiple}" in caplog.text
    assert out.shape[1] == 5 * 6  # rounded down to 5 x 6 patches


def test_cfg_scale_without_negative_prompt_warns_and_skips_cfg(caplog):
    pipe = fast_pipeline()
    sizes = count_forwards(pipe)
    with caplog.at_level(logging.WARNING):
        run(pipe, prompt="a cat", true_cfg_scale=4.0)
    assert "classifier-free guidance is not enabled" in caplog.text and sizes == [1, 1, 1]


# ---- prompt enhancement


class Rewriter:
    """A stand-in prompt enhancer: appends ", detailed"; records what it was given."""

    def __init__(self):
        self.calls = []

    def enhance(self, prompts):
        self.calls.append(prompts)
        return [p + ", detailed" for p in ([prompts] if isinstance(prompts, str) else prompts)]


def spy_encode_prompt(pipe) -> list:
    """Record the `prompt` of every encode_prompt call."""
    seen, encode = [], pipe.encode_prompt

    def spying(*args, **kwargs):
        seen.append(kwargs["prompt"])
        return encode(*args, **kwargs)

    pipe.encode_prompt = spying
    return seen


def test_enhance_prompt_adds_exactly_its_applied_entry():
    base = fast_pipeline(FastConfig()).applied
    rewriter = Rewriter()
    pipe = optimize(stock_pipeline(), FastConfig(), enhance_prompt=rewriter)
    assert pipe.applied == base[:-1] + ["enhance_prompt", "vae_2d_decode"] and pipe.prompt_enhancer is rewriter
    for off in (None, False):
        pipe = optimize(stock_pipeline(), FastConfig(), enhance_prompt=off)
        assert pipe.applied == base and pipe.prompt_enhancer is None
    assert optimize(stock_pipeline(), "baseline", enhance_prompt=rewriter).applied == ["enhance_prompt"]
    assert QwenImageFastPipeline.from_pipe(stock_pipeline(), EXACT, enhance_prompt=rewriter).prompt_enhancer is rewriter


def test_enhance_prompt_values(monkeypatch, tmp_path):
    loads = []

    def from_pretrained(cls, path_or_id, device=None):
        loads.append((path_or_id, device))
        return Rewriter()

    monkeypatch.setattr(PromptEnhancer, "from_pretrained", classmethod(from_pretrained))
    assert isinstance(optimize(stock_pipeline(), EXACT, enhance_prompt=True).prompt_enhancer, Rewriter)
    optimize(stock_pipeline(), EXACT, device="cpu", enhance_prompt="someone/qwen35")
    optimize(stock_pipeline(), EXACT, enhance_prompt=tmp_path)
    assert loads == [(DEFAULT_ENHANCER_ID, None), ("someone/qwen35", "cpu"), (str(tmp_path), None)]
    tiny = optimize(stock_pipeline(), EXACT, enhance_prompt="tiny-random").prompt_enhancer
    assert isinstance(tiny, PromptEnhancer) and tiny.name == "tiny-random" and len(loads) == 3
    stock = stock_pipeline()
    with pytest.raises(TypeError, match="enhance_prompt=3; allowed"):
        optimize(stock, EXACT, enhance_prompt=3)
    assert type(stock) is QwenImagePipeline  # nothing converted
    monkeypatch.setattr(QwenImagePipeline, "from_pretrained", lambda *args, **kwargs: stock_pipeline())
    pipe = QwenImageFastPipeline.from_pretrained("someone/anything", fast_config=EXACT, enhance_prompt=True)
    assert "enhance_prompt" in pipe.applied and loads[-1] == (DEFAULT_ENHANCER_ID, None)


def test_tiny_enhancer_goes_to_cuda_when_available_and_no_device_is_given(monkeypatch):
    import qwen_image_fast.pipelines.qwen35.enhance

    devices = []
    monkeypatch.setattr(qwen_image_fast.pipelines.qwen35.enhance, "tiny_enhancer", lambda device: devices.append(device) or Rewriter())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    optimize(stock_pipeline(), EXACT, enhance_prompt="tiny-random")
    optimize(stock_pipeline(), EXACT, device="cpu", enhance_prompt="tiny-random")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    optimize(stock_pipeline(), EXACT, enhance_prompt="tiny-random")
    assert devices == ["cuda", "cpu", "cpu"]


class Dropper:
    """A broken prompt enhancer: returns one prompt fewer than it was given."""

    def enhance(self, prompts):
        return ([prompts] if isinstance(prompts, str) else prompts)[1:]


@pytest.mark.parametrize("prompt, message", [("a cat", "returned 0 prompts for the 1"),
                                             (["a cat", "a dog"], "returned 1 prompts for the 2")])
def test_enhancer_returning_another_count_raises(prompt, message):
    pipe = optimize(stock_pipeline(), EXACT, enhance_prompt=Dropper())
    with pytest.raises(ValueError, match=message):
        run(pipe, prompt=prompt)


def test_enhance_prompt_rewrites_prompts_not_negative_prompts_or_embeddings():
    rewriter = Rewriter()
    pipe = optimize(stock_pipeline(), EXACT, enhance_prompt=rewriter)
    seen = spy_encode_prompt(pipe)
    run(pipe, prompt="a cat", negative_prompt="blurry")
    assert seen == ["a cat, detailed", "blurry"] and pipe.last_enhanced_prompts == ["a cat, detailed"]
    embeds, mask = pipe.encode_prompt(prompt="a cat", device="cpu")
    seen.clear()
    run(pipe, prompt_embeds=embeds, prompt_embeds_mask=mask, true_cfg_scale=1.0)
    assert seen == [None] and pipe.last_enhanced_prompts is None and rewriter.calls == ["a cat"]


def test_enhance_prompt_with_the_tiny_enhancer_renders_the_rewrites():
    enhancer = tiny_enhancer(max_new_tokens=3)
    pipe = optimize(stock_pipeline(), EXACT, enhance_prompt=enhancer)
    seen = spy_encode_prompt(pipe)
    prompts = ["a cat", "a large dog in the park"]
    latents = run(pipe, prompt=prompts, negative_prompt="blurry")
    rewrites = pipe.last_enhanced_prompts
    assert len(rewrites) == 2 and all(isinstance(r, str) and r for r in rewrites) and rewrites != prompts
    assert seen == [rewrites, ["blurry", "blurry"]]
    assert_close(latents, run(fast_pipeline(EXACT), prompt=rewrites, negative_prompt="blurry"), 1e-6)


@pytest.mark.gpu
def test_cuda_graph_replay_matches_eager_on_gpu():
    case = dict(prompt=["a cat", "a large dog in the park"], negative_prompt="bad", num_inference_steps=4)
    graphed = optimize(stock_pipeline().to("cuda"), FastConfig(fp8=False))
    eager = optimize(stock_pipeline().to("cuda"), FastConfig(fp8=False, cuda_graphs=False))
    assert "cuda_graphs" in graphed.applied and "cuda_graphs" not in eager.applied

    def latents(pipe):
        return pipe(**case, height=64, width=64, output_type="latent",
                    generator=torch.Generator("cuda").manual_seed(0)).images

    assert_close(latents(graphed), latents(eager), 1e-5, "graph replay vs eager (fp32)")
    assert len(graphed.runner.graphs) == 1


# ---- diffusers' contract: constructor, replaced scheduler, callbacks, save/load, casts, what `applied` reports


def test_diffusers_constructor_gives_a_working_fast_pipeline():
    components = tiny_components(0)
    components["tokenizer"] = Qwen2Tokenizer.from_pretrained(FIXTURE_TOKENIZER)
    pipe = QwenImageFastPipeline(**components, fast_config=EXACT)
    assert isinstance(pipe.transformer, FastQwenImageTransformer)
    assert pipe.applied == ["fused_transformer", "attention:sdpa", "modulation_table", "batched_cfg", "vae_2d_decode"]
    case = dict(prompt="a cat", negative_prompt="blurry")
    assert_close(run(pipe, **case), run(stock_pipeline(), **case), 1e-5)
    assert type(QwenImageFastPipeline(**stock_pipeline().components).transformer) is FastQwenImageTransformer


def lightning_scheduler(pipe):
    """The few-step (Lightning) recipe's scheduler, built from the pipeline's own config as users do."""
    return FlowMatchEulerDiscreteScheduler.from_config(
        pipe.scheduler.config, base_shift=math.log(3), max_shift=math.log(3), shift_terminal=None)


def test_replaced_scheduler_is_used_as_in_stock():
    stock, fast = stock_pipeline(), fast_pipeline()
    case = dict(prompt="a cat", true_cfg_scale=1.0, num_inference_steps=4)
    before = run(fast, **case)
    stock.scheduler, fast.scheduler = lightning_scheduler(stock), lightning_scheduler(fast)
    expected = run(stock, **case)
    assert rel_rms_error(expected, before) > 1e-3  # the replacement matters
    assert_close(run(fast, **case), expected, 1e-5, "replaced scheduler")
    assert fast.sampler is fast.scheduler


def test_derived_sampler_follows_the_replaced_scheduler():
    """FastConfig(scheduler="unipc") derives its solver from the scheduler the pipeline holds at the call: after the
    scheduler is replaced, as stock diffusers does with a UniPC built from the replacement's config."""
    from diffusers import UniPCMultistepScheduler

    fast = fast_pipeline(EXACT.replace(scheduler="unipc"))
    before = run(fast, prompt="a cat", num_inference_steps=4, true_cfg_scale=1.0)
    stock = stock_pipeline()
    for pipe in (fast, stock):
        pipe.scheduler = lightning_scheduler(pipe)
    stock.scheduler = UniPCMultistepScheduler.from_config(stock.scheduler.config, prediction_type="flow_prediction",
                                                          use_flow_sigmas=True)
    after = run(fast, prompt="a cat", num_inference_steps=4, true_cfg_scale=1.0)
    assert rel_rms_error(after, before) > 1e-3  # mu comes from the replaced scheduler's shifts
    assert_close(after, run(stock, prompt="a cat", num_inference_steps=4, true_cfg_scale=1.0), 1e-5, "replaced")


@pytest.mark.parametrize("batched_cfg", [True, False])
def test_callback_outputs_honoured_as_in_stock(batched_cfg):
    def callback(pipe, step, timestep, tensors):
        if step == 0:
            return {"latents": tensors["latents"] * 0.9, "prompt_embeds": tensors["prompt_embeds"] * 2}
        return {}

    case = dict(prompt=["a cat", "a large dog in the park"], negative_prompt="bad", callback_on_step_end=callback,
                callback_on_step_end_tensor_inputs=["latents", "prompt_embeds"])
    stock_case = dict(case, negative_prompt=["bad", "bad"])  # the stock pipeline needs one per prompt
    expected = run(stock_pipeline(), **stock_case)
    assert rel_rms_error(expected, run(stock_pipeline(), **dict(stock_case, callback_on_step_end=None))) > 1e-3
    assert_close(run(fast_pipeline(EXACT.replace(batched_cfg=batched_cfg)), **case), expected, 1e-5, "callback")


def test_negative_pass_runs_under_the_uncond_cache_context():
    from qwen_image_fast.pipelines.core.runtime.context import get_context

    fast = fast_pipeline(EXACT.replace(batched_cfg=False))
    names, compute = [], fast.transformer.compute

    def spying(**inputs):
        names.append(get_context().cache_name)
        return compute(**inputs)

    fast.transformer.compute = spying
    run(fast, prompt="a cat", negative_prompt="bad", num_inference_steps=2)
    assert names == ["cond", "uncond"] * 2


@pytest.mark.parametrize("config", [FastConfig(), EXACT], ids=["fp8", "bf16-mode"])
def test_save_pretrained_round_trip(tmp_path, config):
    fast = fast_pipeline(config)
    fast.save_pretrained(tmp_path)
    index = json.loads((tmp_path / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImageFastPipeline" and index["transformer"][1] == "FastQwenImageTransformer"
    saved = json.loads((tmp_path / "transformer" / "config.json").read_text())
    assert saved["fast_config"]["fp8"] == config.fp8
    loaded = QwenImageFastPipeline.from_pretrained(tmp_path, dtype=torch.float32, fast_config=config)
    before, after = fast.transformer.state_dict(), loaded.transformer.state_dict()
    assert all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype for k in before)
    case = dict(prompt="a cat", negative_prompt="blurry")
    assert torch.equal(run(loaded, **case), run(fast, **case))
    with pytest.raises(ValueError, match="qwen_image_fast.from_pretrained"):
        QwenImagePipeline.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="fused_transformer=True"):
        QwenImageFastPipeline.from_pretrained(tmp_path, fast_config="baseline")


@pytest.mark.parametrize("vae_2d_decode", [True, False])
def test_saved_folder_loads_with_the_options_it_was_saved_with(tmp_path, vae_2d_decode):
    """Without fast_config, a saved fast folder loads with its build options: the transformer's stored ones and
    vae_2d_decode (the VAE class model_index.json names), not the defaults."""
    config = EXACT.replace(vae_2d_decode=vae_2d_decode)
    fast_pipeline(config).save_pretrained(tmp_path)
    loaded = QwenImageFastPipeline.from_pretrained(tmp_path, dtype=torch.float32)
    assert loaded.fast_config.vae_2d_decode == vae_2d_decode and loaded.fast_config.fp8 == config.fp8
    assert (type(loaded.vae).__name__ == "FastAutoencoderKLQwenImage") == vae_2d_decode


def test_a_saved_fast_config_comes_back_field_by_field(tmp_path):
    """Every FastConfig field but where it runs (FastConfig.NOT_SAVED: parallel, ulysses degree, memory) comes back
    as saved when the folder loads without fast_config, each set here to something other than its default (so
    dropping any one fails), and the loaded pipeline renders what the saved one did."""
    from dataclasses import fields

    config = FastConfig(bf16_linears=("img_fc2",), fp8_fast_accum=False, attention="sdpa", fp8_attention="auto",
                        batched_cfg=False, cuda_graphs=False, text_bucket=32, scheduler="dpm++2m", cfg_fraction=0.5,
                        vae_2d_decode=False, modulation_table=False, cache=DBCache(Fn=1, every=2, warmup=1))
    default = FastConfig()
    saved_fields = [f.name for f in fields(FastConfig) if f.name not in FastConfig.NOT_SAVED]
    kept_default = [name for name in saved_fields if getattr(config, name) == getattr(default, name)]
    assert kept_default == ["fp8", "fused_transformer"], kept_default  # the two a fast folder cannot change
    fast = fast_pipeline(config)
    fast.save_pretrained(tmp_path)
    loaded = QwenImageFastPipeline.from_pretrained(tmp_path, dtype=torch.float32)
    for name in saved_fields:
        assert getattr(loaded.fast_config, name) == getattr(config, name), name
    case = dict(prompt="a cat", negative_prompt="blurry")
    assert torch.equal(run(loaded, **case), run(fast, **case))


def test_a_fast_transformer_given_must_match_the_config():
    """A pipeline built around a fast transformer already: a fast_config asking for the stock transformer, other
    GEMMs or other BF16 linears than it stores is refused (pipelines/qwen_image21 shares the check); a matching one
    takes the transformer as it is."""
    parts = fast_pipeline(EXACT).components  # a FastQwenImageTransformer with fp8=False
    stored = r"FastQwenImageTransformer \(fp8=False, bf16_linears=\[\]\)"
    for config, match in (("baseline", "fused_transformer=False"), (FastConfig(), "fp8=True"),
                          (EXACT.replace(bf16_linears=("img_fc2",)), r"bf16_linears=\['img_fc2'\]")):
        with pytest.raises(ValueError, match=f"{stored}.+{match}"):
            QwenImageFastPipeline(**parts, fast_config=config)
    assert QwenImageFastPipeline(**parts, fast_config=EXACT).transformer is parts["transformer"]


def test_cast_to_bf16_after_optimize_keeps_fp8_and_runs():
    fast = fast_pipeline(FastConfig())
    fp8 = {k: v.clone() for k, v in fast.transformer.state_dict().items() if k.endswith(("weight_q", "weight_scale"))}
    fast.to(torch.bfloat16)
    state = fast.transformer.state_dict()
    assert all(torch.equal(state[k], v) and state[k].dtype == v.dtype for k, v in fp8.items())
    assert fast.transformer.dtype == torch.bfloat16
    case = dict(prompt="a cat", negative_prompt="blurry", num_inference_steps=2)
    out = run(fast, **case)
    assert out.dtype == torch.bfloat16
    assert rel_rms_error(out.float(), run(stock_pipeline(), **case)) < 0.1


def test_applied_reports_what_the_last_call_ran():
    pipe = fast_pipeline(EXACT.replace(cfg_fraction=0.5))
    assert pipe.applied == ["fused_transformer", "attention:sdpa", "modulation_table", "batched_cfg",
                            "cfg_fraction:0.5", "vae_2d_decode"]  # planned
    run(pipe, prompt="a cat", true_cfg_scale=1.0)
    assert pipe.applied == ["fused_transformer", "attention:sdpa", "modulation_table"]  # no CFG: neither batched
    # nor selective
    run(pipe, prompt="a cat", negative_prompt="bad", num_inference_steps=4)
    assert pipe.applied == ["fused_transformer", "attention:sdpa", "modulation_table", "batched_cfg",
                            "cfg_fraction:0.5"]
    run(pipe, prompt="a cat", true_cfg_scale=4.0)  # no negative prompt: no CFG
    assert "batched_cfg" not in pipe.applied
    baseline = optimize(stock_pipeline(), "baseline")
    run(baseline, prompt="a cat", negative_prompt="bad")
    assert baseline.applied == []


def test_conversion_on_a_cpu_without_the_triton_interpreter_says_how_to_fix_it():
    script = ("from qwen_image_fast import optimize\n"
              "from qwen_image_fast.pipelines.tiny import tiny_pipeline\n"
              "optimize(tiny_pipeline(), 'baseline')\n"  # the stock computation needs no Triton
              "try:\n    optimize(tiny_pipeline())\n"
              "except RuntimeError as e:\n    print('raised:', e)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "raised:" in result.stdout and "TRITON_INTERPRET=1" in result.stdout


def tiny_controlnet(transformer, extra_condition_channels: int = 0, seed: int = 3):
    """A 1-layer QwenImageControlNetModel from the tiny transformer, its zero-initialized output projections made
    random (so that its residuals move the result). extra_condition_channels: the inpainting one's mask channels."""
    from diffusers import QwenImageControlNetModel

    torch.manual_seed(seed)
    controlnet = QwenImageControlNetModel.from_transformer(
        transformer, num_layers=1, attention_head_dim=transformer.config.attention_head_dim,
        num_attention_heads=transformer.config.num_attention_heads, extra_condition_channels=extra_condition_channels)
    for p in controlnet.controlnet_blocks.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return controlnet


DROP_IN = ["QwenImagePipeline", "QwenImageImg2ImgPipeline", "QwenImageInpaintPipeline", "QwenImageControlNetPipeline",
           "QwenImageControlNetInpaintPipeline"]


@pytest.mark.parametrize("fp8", [False, True], ids=["exact", "fp8"])
@pytest.mark.parametrize("name", DROP_IN)
def test_fast_transformer_drops_into_diffusers_pipelines(name, fp8):
    """diffusers' own pipelines, unchanged, with the fast transformer in place of the stock one: fp32 BF16 mode to
    1e-5; FP8 within its CPU bound (ControlNet: its residuals added after each block's, as diffusers adds them)."""
    import diffusers
    from PIL import Image

    cls = getattr(diffusers, name)

    def pipeline(fast: bool):
        components = tiny_components(0)
        components["tokenizer"] = Qwen2Tokenizer.from_pretrained(FIXTURE_TOKENIZER)
        if "ControlNet" in name:
            components["controlnet"] = tiny_controlnet(components["transformer"], 4 if "Inpaint" in name else 0)
        if fast:
            components["transformer"] = FastQwenImageTransformer.from_diffusers(
                components["transformer"], FastConfig(fp8=fp8).transformer_config())
        return cls(**components)

    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (32, 48, 3), dtype=np.uint8))
    mask = Image.fromarray(((rng.random((32, 48)) > 0.5) * 255).astype(np.uint8))
    case = dict(prompt="a cat", negative_prompt="blurry", true_cfg_scale=3.0, num_inference_steps=3)
    case |= {"QwenImageImg2ImgPipeline": dict(image=image, strength=0.7),
             "QwenImageInpaintPipeline": dict(image=image, mask_image=mask, strength=0.7),
             "QwenImageControlNetPipeline": dict(control_image=image, controlnet_conditioning_scale=0.8),
             "QwenImageControlNetInpaintPipeline": dict(control_image=image, control_mask=mask)}.get(name, {})
    out, ref = run(pipeline(fast=True), **case), run(pipeline(fast=False), **case)
    if fp8:
        assert 0 < rel_rms_error(out, ref) <= BY_NAME["fp8"].bound.tiny, (name, rel_rms_error(out, ref))
    else:
        assert_close(out, ref, 1e-5, name)


def offload(pipe, how: str):
    if how == "model":
        pipe.enable_model_cpu_offload()
        return
    kind, *stream = how.removeprefix("group-").split("-")
    pipe.text_encoder.to("cuda")
    pipe.vae.to("cuda")
    pipe.transformer.enable_group_offload(onload_device=torch.device("cuda"), offload_device=torch.device("cpu"),
                                          offload_type=f"{kind}_level", num_blocks_per_group=1 if kind == "block" else None,
                                          use_stream=bool(stream))


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["model", "group-block", "group-block-stream", "group-leaf", "group-leaf-stream"])
@pytest.mark.parametrize("fp8", [False, True])
def test_offload_with_the_fast_transformer_on_gpu(how, fp8):
    dtype = torch.bfloat16 if fp8 else torch.float32
    config = FastConfig(fp8=fp8)
    case = dict(prompt=["a cat", "a large dog in the park"], negative_prompt="bad", height=64, width=64,
                num_inference_steps=3, output_type="latent")

    def latents(pipe):
        return pipe(**case, generator=torch.Generator("cuda").manual_seed(0)).images

    resident = optimize(stock_pipeline().to("cuda", dtype), config.replace(cuda_graphs=False))
    expected = latents(resident)
    pipe = optimize(stock_pipeline().to(dtype), config, device="cuda")  # built on the GPU, then offloaded
    offload(pipe, how)
    assert "cuda_graphs" not in pipe.applied  # offload hooks move the weights: no graph replay
    assert_close(latents(pipe), expected, 1e-6, f"{how} offload vs resident")
    assert "cuda_graphs" not in pipe.applied and "fused_transformer" in pipe.applied


@pytest.mark.gpu
def test_graphs_are_recaptured_after_the_weights_move():
    case = dict(prompt="a cat", negative_prompt="bad", height=64, width=64, num_inference_steps=2,
                output_type="latent")
    pipe = optimize(stock_pipeline().to("cuda"), FastConfig(fp8=False))
    first = pipe(**case, generator=torch.Generator("cuda").manual_seed(0)).images
    assert "cuda_graphs" in pipe.applied and len(pipe.runner.graphs) == 1
    pipe.to("cpu")
    pipe.to("cuda")
    again = pipe(**case, generator=torch.Generator("cuda").manual_seed(0)).images
    assert torch.equal(first, again) and len(pipe.runner.graphs) == 1
