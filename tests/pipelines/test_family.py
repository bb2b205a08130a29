"""optimize() on Qwen-Image's image-conditioned diffusers pipelines (family.py) against the same stock pipeline:
fp32 with FP8 off to 1e-5, FP8 within its CPU bound, a LoRA through the pipeline's own loader, and the refusals."""

import json

import diffusers
import numpy as np
import pytest
import torch
from diffusers import QwenImageMultiControlNetModel
from helpers import assert_close, forward_batches
from PIL import Image
from test_pipeline import EXACT, FIXTURE_TOKENIZER, tiny_controlnet
from transformers import Qwen2Tokenizer

from qwen_image_fast import FastConfig, QwenImageFastPipeline, optimize
from qwen_image_fast import FastQwenImageEditPlusPipeline, from_pretrained
from qwen_image_fast.pipelines.qwen_image.fast_pipeline import FastPipelineMixin
from qwen_image_fast.kernels._utils import rel_rms_error
from qwen_image_fast.pipelines.core import optimizations
from qwen_image_fast.pipelines.core.optimizations import BY_NAME
from qwen_image_fast.pipelines.tiny import tiny_components, tiny_pipeline


# id -> (pipeline, transformer config overrides, call arguments beyond COMMON). Input images of other sizes than
# the output; EditPlus with two condition images of different sizes, with and without Edit-2511's zero_cond_t.
RNG = np.random.default_rng(0)
IMAGE = Image.fromarray(RNG.integers(0, 256, (32, 48, 3), dtype=np.uint8))
IMAGE_2 = Image.fromarray(RNG.integers(0, 256, (40, 24, 3), dtype=np.uint8))
RGBA = Image.fromarray(RNG.integers(0, 256, (32, 48, 4), dtype=np.uint8))
MASK = Image.fromarray(((RNG.random((32, 48)) > 0.5) * 255).astype(np.uint8))
COMMON = dict(prompt="a cat", negative_prompt="blurry", true_cfg_scale=3.0, num_inference_steps=2)
CASES = {
    "img2img": ("QwenImageImg2ImgPipeline", {}, dict(image=IMAGE, strength=0.7)),
    "inpaint": ("QwenImageInpaintPipeline", {}, dict(image=IMAGE, mask_image=MASK, strength=0.7)),
    "edit": ("QwenImageEditPipeline", {}, dict(image=IMAGE)),
    "edit_plus": ("QwenImageEditPlusPipeline", {}, dict(image=[IMAGE, IMAGE_2])),
    "edit_plus_2511": ("QwenImageEditPlusPipeline", dict(zero_cond_t=True), dict(image=[IMAGE, IMAGE_2])),
    "edit_inpaint": ("QwenImageEditInpaintPipeline", {}, dict(image=IMAGE, mask_image=MASK, strength=0.7)),
    "layered": ("QwenImageLayeredPipeline", {}, dict(image=RGBA, layers=2, height=None, width=None)),  # its size
    "controlnet": ("QwenImageControlNetPipeline", {}, dict(control_image=IMAGE, controlnet_conditioning_scale=0.8)),
    "controlnet_two": ("QwenImageControlNetPipeline", {},
                       dict(control_image=[IMAGE, IMAGE_2.resize((48, 32))], controlnet_conditioning_scale=[0.8, 0.5])),
    "controlnet_inpaint": ("QwenImageControlNetInpaintPipeline", {}, dict(control_image=IMAGE, control_mask=MASK)),
}


# Rel-RMS of FP8 latents against fp32 stock after 2-3 steps: 1.5e-3 to 1.1e-2 here (layered, three noisy layers, the
# most); the registry declares the bound (optimizations.FP8_BOUND).
FP8_BOUND = BY_NAME["fp8"].bound.tiny


def stock(case_id: str):
    name, transformer_config, _ = CASES[case_id]
    pipeline_class = getattr(diffusers, name)
    if "ControlNet" not in name:
        return tiny_pipeline(pipeline_class, transformer_config=transformer_config)
    components = tiny_components(0)
    components["tokenizer"] = Qwen2Tokenizer.from_pretrained(FIXTURE_TOKENIZER)
    extra = 4 if "Inpaint" in name else 0
    controlnet = tiny_controlnet(components["transformer"], extra)
    if case_id == "controlnet_two":  # diffusers runs several control images through one (union) ControlNet only
        controlnet = QwenImageMultiControlNetModel([controlnet])
    return pipeline_class(**components, controlnet=controlnet)


def run_case(pipe, case_id: str | None, seed: int = 0, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """(the latents after the last step, as the callback sees them: what the transformer and the loop computed,
    before the VAE (the layered pipeline has no output_type="latent"); the images, as tensors). The call:
    CASES[case_id]'s, or kwargs."""
    seen = {}

    def keep(pipe, step, t, tensors):
        seen["latents"] = tensors["latents"].float().clone()
        return {}

    kwargs = dict(height=32, width=48, output_type="pt") | COMMON | (CASES[case_id][2] if case_id else kwargs)
    images = pipe(**{k: v for k, v in kwargs.items() if v is not None}, generator=torch.Generator().manual_seed(seed),
                  callback_on_step_end=keep).images
    return seen["latents"], torch.stack(list(images)) if isinstance(images, list) else images


def final_latents(pipe, case_id: str | None, seed: int = 0, **kwargs) -> torch.Tensor:
    return run_case(pipe, case_id, seed, **kwargs)[0]


@pytest.mark.usefixtures("small_condition_images")
@pytest.mark.parametrize("case_id", CASES)
def test_optimize_matches_the_stock_pipeline(case_id):
    name = CASES[case_id][0]
    ref, ref_images = run_case(stock(case_id), case_id)
    fast = optimize(stock(case_id), EXACT)
    assert isinstance(fast, FastPipelineMixin) and isinstance(fast, getattr(diffusers, name))
    assert fast.applied == ["fused_transformer", "attention:sdpa", "batched_cfg", "vae_2d_decode"]
    batches = forward_batches(fast)
    latents, images = run_case(fast, case_id)
    assert_close(latents, ref, 1e-5, case_id)
    torch.testing.assert_close(images, ref_images, atol=1e-5, rtol=0)  # the 2D decode: <= 7e-7 here
    if "controlnet" in case_id or case_id == "layered":  # residuals per text, additional_t_cond: never paired
        assert batches == [1] * 4 and fast.applied == ["fused_transformer", "attention:sdpa", "vae_2d_decode"]
    else:  # the first step unpaired, then one forward of batch 2 per step
        assert batches == [1, 1] + [2] * (len(batches) - 2) and len(batches) >= 3, batches
        assert fast.applied == ["fused_transformer", "attention:sdpa", "batched_cfg", "vae_2d_decode"]
    fp8 = optimize(stock(case_id), FastConfig())
    assert "fp8" in fp8.applied
    assert 0 < rel_rms_error(final_latents(fp8, case_id), ref) < FP8_BOUND


@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")  # stock's 0/0
@pytest.mark.usefixtures("small_condition_images")
def test_one_step_gives_nan_on_stock_and_is_refused_here():
    """As in the text-to-image pipeline (test_pipeline.py): stock's one step is NaN, ours refuses it, naming why."""
    latents, _ = run_case(stock("img2img"), None, **CASES["img2img"][2], num_inference_steps=1)
    assert torch.isnan(latents).all()
    with pytest.raises(ValueError, match="num_inference_steps=1: .* returns a black image; use 2 or more steps"):
        run_case(optimize(stock("edit"), EXACT), None, num_inference_steps=1, image=IMAGE)


@pytest.mark.usefixtures("small_condition_images")
def test_unbatched_cfg_matches_stock_too():
    ref = final_latents(stock("edit_plus_2511"), "edit_plus_2511")
    fast = optimize(stock("edit_plus_2511"), EXACT.replace(batched_cfg=False))
    batches = forward_batches(fast)
    assert_close(final_latents(fast, "edit_plus_2511"), ref, 1e-5)
    assert batches == [1] * 4 and fast.applied == ["fused_transformer", "attention:sdpa", "vae_2d_decode"]


@pytest.mark.usefixtures("small_condition_images")
def test_graphs_replay_from_a_signatures_second_forward_in_a_call(stand_in_graphs):
    """CallGraphs in diffusers' own loop, with a stand-in for the CUDA-graph capture so that it runs here (the
    stand-in's replay runs the captured function on the captured static inputs; test_graphs_on_gpu replays real
    graphs): the first forward of a signature in a call runs eagerly, the second captures (no warm-up), the others
    replay; the latents are those of the pipeline without graphs, bit for bit. ControlNet forwards never replay."""
    captured, replays = stand_in_graphs["captures"], stand_in_graphs["replays"]
    call = CASES["img2img"][2] | dict(num_inference_steps=3, strength=1.0)  # 3 steps (test_graphs_on_gpu: Edit-2511)
    eager = optimize(stock("img2img"), EXACT.replace(cuda_graphs=False, vae_2d_decode=False))
    graphed = optimize(stock("img2img"), EXACT.replace(text_bucket=1))  # unpadded text: bit for bit
    assert "cuda_graphs" not in eager.applied and "cuda_graphs" in graphed.applied
    ref = final_latents(eager, None, **call)
    assert eager.applied == ["fused_transformer", "attention:sdpa", "batched_cfg"]  # both options off: neither ran
    # steps 1 (unpaired cond, uncond) and 2 (the first paired forward) eager, 3 captures and replays
    assert torch.equal(final_latents(graphed, None, **call), ref)
    assert captured == [2] and replays == [2]
    assert graphed.applied == ["fused_transformer", "attention:sdpa", "batched_cfg", "cuda_graphs", "vae_2d_decode"]
    assert torch.equal(final_latents(graphed, None, **call), ref)  # the next call replays from its first pair
    assert captured == [2] and replays == [2] * 3
    controlnet = optimize(stock("controlnet"), EXACT)
    final_latents(controlnet, "controlnet")
    assert captured == [2] and "cuda_graphs" not in controlnet.applied


def test_cfg_pairing_returns_the_kept_half_only_for_the_inputs_it_was_computed_from():
    """Calls as a pipeline's loop makes them, then ones that differ from what the "cond" call speculated: another
    latents tensor, latents changed in place, another negative text. Each "uncond" answer must be the unpaired
    forward of its own inputs. Another timestep's values (compared on the device, not at each step): the call ends
    in a ValueError saying to turn batched CFG off."""
    from qwen_image_fast.pipelines.core.runtime.forward_hook import hook_on
    from qwen_image_fast.pipelines.core.runtime.runner import Runner

    fast = optimize(stock("img2img"), EXACT).transformer
    batches = forward_batches(type("Pipe", (), {"transformer": fast}))
    torch.manual_seed(0)
    h = torch.randn(1, 24, 16)
    text, negative, other_negative = torch.randn(1, 7, 16), torch.randn(1, 4, 16), torch.randn(1, 4, 16)
    t = torch.tensor([0.5])

    def call(context, hidden, embeds, timestep):
        with fast.cache_context(context):
            return fast(hidden_states=hidden, encoder_hidden_states=embeds, encoder_hidden_states_mask=None,
                        timestep=timestep, img_shapes=[[(1, 4, 6)]], return_dict=False)[0]

    def unpaired(hidden, embeds, timestep):
        with hook_on(fast, None):
            return call(None, hidden, embeds, timestep)

    paired_call = Runner().call(fast, optimizations.CallRecord(), graphs=False, pair_cfg=True, bucket=1)
    paired_call.__enter__()
    call("cond", h, text, t)
    call("uncond", h, negative, t)  # records the negative text
    h2 = torch.randn_like(h)
    misses = {
        "as speculated": (h2, negative, t.clone(), None),
        "other latents": (h2, negative, t, torch.randn_like(h)),
        "latents changed in place": (h2.clone(), negative, t, "in place"),
        "other negative text": (h2, other_negative, t, None),
    }
    for what, (hidden, embeds, timestep, change) in misses.items():
        assert_close(call("cond", hidden, text, t), unpaired(hidden, text, t), 1e-5, what)
        if change == "in place":
            hidden.mul_(0.5)
        uncond_hidden = change if isinstance(change, torch.Tensor) else hidden
        assert_close(call("uncond", uncond_hidden, embeds, timestep), unpaired(uncond_hidden, embeds, timestep),
                     1e-5, what)
        call("uncond", h2, negative, t)  # the loop's negative text again, for the next case
    paired_call.__exit__(None, None, None)
    assert batches.count(2) == len(misses)
    paired_call = Runner().call(fast, optimizations.CallRecord(), graphs=False, pair_cfg=True, bucket=1)
    paired_call.__enter__()
    for timestep in (t, torch.tensor([0.25])):  # the loop's, then another for the "uncond" call of a paired step
        call("cond", h, text, t)
        call("uncond", h, negative, timestep)
    with pytest.raises(ValueError, match="passed another timestep: this loop needs FastConfig\\(batched_cfg=False\\)"):
        paired_call.__exit__(None, None, None)


@pytest.mark.usefixtures("small_condition_images")
def test_lora_through_the_pipelines_own_loader():
    from test_lora import LORA_A, LORA_B, lightning_format

    # Edit-2511 (zero_cond_t: LORA_B's img_mod.1 adapter under per-token modulation), one condition image
    case_id = "edit_plus_2511"
    call = CASES[case_id][2] | dict(image=[IMAGE])
    reference, fast = stock(case_id), optimize(stock(case_id), EXACT)
    for pipe in (reference, fast):
        pipe.load_lora_weights(lightning_format(LORA_A + LORA_B), adapter_name="a")
        pipe.set_adapters(["a"], [0.7])
    assert fast.get_active_adapters() == ["a"]
    unscaled = final_latents(fast, None, **call)
    assert_close(unscaled, final_latents(reference, None, **call), 1e-5, "LoRA on Edit-2511")
    scaled = call | dict(attention_kwargs={"scale": 0.4})
    fast_scaled = final_latents(fast, None, **scaled)
    assert_close(fast_scaled, final_latents(reference, None, **scaled), 1e-5, "attention_kwargs scale")
    assert rel_rms_error(fast_scaled, unscaled) > 1e-3  # the scale changes what the LoRA adds
    for pipe in (reference, fast):
        pipe.fuse_lora()
    assert_close(final_latents(fast, None, **call), final_latents(reference, None, **call), 1e-5,
                 "fused LoRA on Edit-2511")


def test_what_it_cannot_do_is_refused(tmp_path):
    with pytest.raises(ValueError, match="scheduler='dpm\\+\\+2m': supported by the text-to-image"):
        optimize(stock("img2img"), EXACT.replace(scheduler="dpm++2m"))
    with pytest.raises(ValueError, match="enhance_prompt is supported by the text-to-image"):
        optimize(stock("img2img"), EXACT, enhance_prompt="tiny-random")
    fast = optimize(stock("img2img"), EXACT)
    with pytest.raises(ValueError, match="already optimized"):
        optimize(fast)
    flux = diffusers.FluxPipeline.__new__(diffusers.FluxPipeline)
    with pytest.raises(TypeError, match="QwenImageControlNetInpaintPipeline, QwenImage21Pipeline; got FluxPipeline"):
        optimize(flux)
    with pytest.raises(TypeError, match="optimize\\(\\) takes one of diffusers' QwenImagePipeline, "
                                        "QwenImageImg2ImgPipeline"):
        optimize(torch.nn.Linear(2, 2))


@pytest.mark.usefixtures("small_condition_images")
def test_from_pretrained_picks_the_fast_class_from_model_index(tmp_path):
    """An Edit-2511-style folder (EditPlus, zero_cond_t) gives FastQwenImageEditPlusPipeline, as diffusers'
    DiffusionPipeline.from_pretrained gives the stock class; it computes what the stock pipeline it was saved from
    computes. A text-to-image folder gives QwenImageFastPipeline; another pipeline class is refused."""
    saved = stock("edit_plus_2511")
    saved.save_pretrained(tmp_path / "edit")
    assert read_json(tmp_path / "edit" / "model_index.json")["_class_name"] == "QwenImageEditPlusPipeline"
    fast = from_pretrained(tmp_path / "edit", EXACT, dtype=torch.float32)
    assert type(fast) is FastQwenImageEditPlusPipeline and fast.transformer.zero_cond_t
    assert_close(final_latents(fast, "edit_plus_2511"), final_latents(saved, "edit_plus_2511"), 1e-5, "loaded")
    tiny_pipeline().save_pretrained(tmp_path / "t2i")
    assert type(from_pretrained(tmp_path / "t2i", EXACT, dtype=torch.float32)) is QwenImageFastPipeline
    index = read_json(tmp_path / "t2i" / "model_index.json")
    (tmp_path / "t2i" / "model_index.json").write_text(json.dumps(index | {"_class_name": "FluxPipeline"}))
    with pytest.raises(TypeError, match="is a FluxPipeline checkpoint; qwen-image-fast accelerates QwenImagePipeline"):
        from_pretrained(tmp_path / "t2i")


def read_json(path):
    return json.loads(path.read_text())


def real_width_edit_plus():
    """Edit-2511's QwenImageEditPlusPipeline at the real widths (2 of the 60 blocks: 3072 = 24 x 128, MLP 12288,
    text 3584, zero_cond_t) with the real VAE, random weights, fp32 on CUDA; a 1-layer text encoder of the real
    width with a 1-block vision tower of the real output width."""
    from diffusers import AutoencoderKLQwenImage, QwenImageEditPlusPipeline, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from qwen_image_fast.pipelines.tiny import VISION_TOKENS

    torch.manual_seed(0)
    components = tiny_components(0, vision=True)
    transformer = QwenImageTransformer2DModel(num_layers=2, zero_cond_t=True)
    with torch.no_grad():
        for p in transformer.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.02)
    tokenizer = components["tokenizer"]
    text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=dict(hidden_size=3584, intermediate_size=512, num_hidden_layers=1, num_attention_heads=28,
                         num_key_value_heads=4, vocab_size=len(tokenizer),
                         rope_scaling=dict(mrope_section=[16, 24, 24], rope_type="default", type="default")),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=3584),
        vocab_size=len(tokenizer), **dict(zip(("vision_start_token_id", "vision_end_token_id", "image_token_id",
                                               "video_token_id"), tokenizer.convert_tokens_to_ids(VISION_TOKENS)))))
    components |= dict(transformer=transformer, vae=AutoencoderKLQwenImage(), text_encoder=text_encoder.eval())
    return QwenImageEditPlusPipeline(**components).to("cuda")


def edit_call(n_images: int, steps: int) -> dict:
    """1024x1024 output from one or two 1024x1024 condition images (4096 noisy + 4096 or 8192 condition tokens),
    CFG, the same starting noise in every run (drawn in the pipeline's dtype, fp32 and bf16 noise would differ)."""
    noise = torch.randn(1, 64 * 64, 64, generator=torch.Generator().manual_seed(1))
    return dict(image=[IMAGE.resize((1024, 1024)), IMAGE_2.resize((1024, 1024))][:n_images], height=1024,
                width=1024, num_inference_steps=steps, latents=noise)


@pytest.mark.gpu
@pytest.mark.parametrize("n_images", [1, 2])
def test_edit_2511_at_real_shapes_on_gpu(n_images):
    """real_width_edit_plus(), two steps of edit_call(n_images). The latents after the last step against the fp32
    stock pipeline: FP8 no worse than 1.1x stock with emulated FP8 linears; BF16 mode within 2x stock's own bf16
    error."""
    from diffusers import QwenImageEditPlusPipeline
    from test_transformer import emulate_fp8

    stock32 = real_width_edit_plus()
    call = edit_call(n_images, steps=2)
    ref32 = final_latents(stock32, None, **call)
    stock = stock32.to(torch.bfloat16)
    err_bf16 = rel_rms_error(final_latents(stock, None, **call), ref32)
    assert err_bf16 < 0.05, err_bf16  # the runs compute the same thing (bf16 rounding apart)
    emulated = QwenImageEditPlusPipeline(**stock.components | {"transformer": emulate_fp8(stock.transformer)})
    err_emulated = rel_rms_error(final_latents(emulated, None, **call), ref32)
    fp8 = optimize(QwenImageEditPlusPipeline(**stock.components), FastConfig())
    assert "fp8" in fp8.applied and fp8.transformer.zero_cond_t
    err_fp8 = rel_rms_error(final_latents(fp8, None, **call), ref32)
    assert 0 < err_fp8 <= 1.1 * err_emulated, (err_fp8, err_emulated)
    bf16 = optimize(QwenImageEditPlusPipeline(**stock.components), FastConfig(fp8=False))
    # a forward signature's second forward in the call (text bucketed) is captured and replayed
    assert fp8.applied == ["fused_transformer", "fp8", "fp8_fast_accum", "attention:fa4", "batched_cfg",
                           "cuda_graphs", "vae_2d_decode"]
    err_ours_bf16 = rel_rms_error(final_latents(bf16, None, **call), ref32)
    assert err_ours_bf16 <= 2 * err_bf16 + 1e-3, (err_ours_bf16, err_bf16)
    print(f"edit-2511 x{n_images}: rel-RMS vs fp32 stock: stock bf16 {err_bf16:.2e}, ours bf16 {err_ours_bf16:.2e}, "
          f"stock emulated FP8 {err_emulated:.2e}, ours FP8 {err_fp8:.2e}")


@pytest.mark.gpu
def test_graphs_on_gpu():
    """Real CUDA graphs in Edit-2511's loop at the real widths (two condition images, FP8, five steps, twice): the
    latents equal the eager pipeline's bit for bit; a LoRA scale change keys new graphs; ControlNet-free forwards
    only."""
    from diffusers import QwenImageEditPlusPipeline

    stock = real_width_edit_plus().to(torch.bfloat16)
    call = edit_call(2, steps=5)
    eager = optimize(QwenImageEditPlusPipeline(**stock.components), FastConfig(cuda_graphs=False))
    graphed = optimize(QwenImageEditPlusPipeline(**stock.components), FastConfig(text_bucket=1))  # bit for bit
    ref = final_latents(eager, None, **call)
    for run in ("first call", "second call"):
        assert torch.equal(final_latents(graphed, None, **call), ref), run
        assert "cuda_graphs" in graphed.applied and "cuda_graphs" not in eager.applied
    assert len(graphed.runner.graphs) == 1  # the paired forward's; the unpaired first step's ran eagerly
    scaled = dict(call, attention_kwargs={"scale": 0.5})
    assert torch.equal(final_latents(graphed, None, **scaled), final_latents(eager, None, **scaled))
    assert len(graphed.runner.graphs) == 2
