"""optimize() on Qwen-Image's image-conditioned diffusers pipelines (family.py) against the same stock pipeline:
fp32 with FP8 off to 1e-5, FP8 within its CPU bound, a LoRA through the pipeline's own loader, and the refusals."""

import diffusers
import numpy as np
import pytest
import torch
from helpers import assert_close
from PIL import Image
from test_pipeline import EXACT, FIXTURE_TOKENIZER, run, tiny_controlnet
from transformers import Qwen2Tokenizer

from qwen_image_fast import FastConfig, optimize
from qwen_image_fast.family import ACCELERATED, FastFamilyPipeline
from qwen_image_fast.kernels._utils import rel_rms_error
from qwen_image_fast.tiny import tiny_components


def stock(name: str):
    components = tiny_components(0)
    components["tokenizer"] = Qwen2Tokenizer.from_pretrained(FIXTURE_TOKENIZER)
    if "ControlNet" in name:
        components["controlnet"] = tiny_controlnet(components["transformer"], 4 if "Inpaint" in name else 0)
    return getattr(diffusers, name)(**components)


def case(name: str) -> dict:
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (32, 48, 3), dtype=np.uint8))
    mask = Image.fromarray(((rng.random((32, 48)) > 0.5) * 255).astype(np.uint8))
    return dict(prompt="a cat", negative_prompt="blurry", true_cfg_scale=3.0, num_inference_steps=3) | {
        "QwenImageImg2ImgPipeline": dict(image=image, strength=0.7),
        "QwenImageInpaintPipeline": dict(image=image, mask_image=mask, strength=0.7),
        "QwenImageControlNetPipeline": dict(control_image=image, controlnet_conditioning_scale=0.8),
        "QwenImageControlNetInpaintPipeline": dict(control_image=image, control_mask=mask)}[name]


@pytest.mark.parametrize("name", ACCELERATED)
def test_optimize_matches_the_stock_pipeline(name):
    ref = run(stock(name), **case(name))
    fast = optimize(stock(name), EXACT)
    assert isinstance(fast, FastFamilyPipeline) and isinstance(fast, getattr(diffusers, name))
    assert fast.applied == ["fused_transformer", "attention:sdpa"]
    assert_close(run(fast, **case(name)), ref, 1e-5, name)
    fp8 = optimize(stock(name), FastConfig())
    assert "fp8" in fp8.applied
    assert rel_rms_error(run(fp8, **case(name)), ref) < 5e-3


def test_lora_through_the_pipelines_own_loader():
    from test_lora import LORA_A, LORA_B, lightning_format

    name = "QwenImageImg2ImgPipeline"
    reference, fast = stock(name), optimize(stock(name), EXACT)
    for pipe in (reference, fast):
        pipe.load_lora_weights(lightning_format(LORA_A + LORA_B), adapter_name="a")
        pipe.set_adapters(["a"], [0.7])
    assert fast.get_active_adapters() == ["a"]
    assert_close(run(fast, **case(name)), run(reference, **case(name)), 1e-5, "LoRA on img2img")
    for pipe in (reference, fast):
        pipe.fuse_lora()
    assert_close(run(fast, **case(name)), run(reference, **case(name)), 1e-5, "fused LoRA on img2img")


def test_what_it_cannot_do_is_refused(tmp_path):
    name = "QwenImageImg2ImgPipeline"
    with pytest.raises(ValueError, match="scheduler='dpm\\+\\+2m'"):
        optimize(stock(name), EXACT.replace(scheduler="dpm++2m"))
    with pytest.raises(ValueError, match="enhance_prompt is supported by the text-to-image"):
        optimize(stock(name), EXACT, enhance_prompt="tiny-random")
    fast = optimize(stock(name), EXACT)
    with pytest.raises(ValueError, match="already optimized"):
        optimize(fast)
    with pytest.raises(NotImplementedError, match="save_pretrained of an optimized QwenImageImg2ImgPipeline"):
        fast.save_pretrained(tmp_path / "x")
    assert not (tmp_path / "x").exists()
    edit = diffusers.QwenImageEditPipeline.__new__(diffusers.QwenImageEditPipeline)
    with pytest.raises(TypeError, match="does not accelerate QwenImageEditPipeline yet"):
        optimize(edit)
    with pytest.raises(TypeError, match="optimize\\(\\) takes one of diffusers' QwenImagePipeline, "
                                        "QwenImageImg2ImgPipeline"):
        optimize(torch.nn.Linear(2, 2))
