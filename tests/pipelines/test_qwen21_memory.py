"""FastConfig(memory="low") on Qwen-Image-2.1 (pipelines/qwen_image21/memory.py): the text encoder and the
transformer's blocks take turns in one buffer on the device; the latents equal stock's and the resident pipeline's,
with CFG and a condition image (the text encoder's vision tower reads it in the encoder's turn)."""

import numpy as np
import pytest
import torch
from diffusers import QwenImage21Pipeline
from helpers import assert_close
from PIL import Image

from qwen_image_fast import FastConfig, optimize
from qwen_image_fast.pipelines.tiny import tiny_qwen21_components

CONDITION = Image.fromarray((np.random.RandomState(0).rand(64, 96, 4) * 255).astype("uint8"), "RGBA")
CALL = dict(prompt=["a cat on a mat", "a dog"], negative_prompt=["blurry", "dark and grainy"], true_cfg_scale=2.0,
            num_inference_steps=3, height=64, width=64, output_type="latent", output_resolution=64)


def latents(pipe, device="cpu", **extra) -> torch.Tensor:
    return pipe(**CALL | extra, generator=torch.Generator(device).manual_seed(0)).images


@pytest.mark.parametrize("condition", [False, True], ids=["text-to-image", "condition-image"])
def test_low_memory_matches_stock_and_the_resident_pipeline(condition):
    extra = dict(image=CONDITION) if condition else {}
    expected = latents(QwenImage21Pipeline(**tiny_qwen21_components()), **extra)
    fast = optimize(QwenImage21Pipeline(**tiny_qwen21_components()), FastConfig(fp8=False))
    low = optimize(QwenImage21Pipeline(**tiny_qwen21_components()), FastConfig(fp8=False, memory="low"))
    planned = low.applied
    assert planned == fast.applied + ["memory:low"], (planned, fast.applied)
    resident = latents(fast, **extra)
    assert_close(resident, expected, 1e-5, f"resident, condition={condition}")
    assert torch.equal(latents(low, **extra), resident), "memory='low' differs from the resident pipeline"
    assert low.applied == planned, low.applied
    turns = low._turns
    # the prompt's and the negative prompt's encodings in one turn of the text encoder, then the blocks'
    assert turns.resident == "transformer" and turns.loads == 2, (turns.resident, turns.loads)
    assert not turns.arenas["text_encoder"].loaded
    assert torch.equal(latents(low, **extra), resident) and turns.loads == 4, "a second call: the same turns again"


def test_low_memory_refuses_to_move_and_keeps_the_blocks_between_turns():
    low = optimize(QwenImage21Pipeline(**tiny_qwen21_components()), FastConfig(fp8=False, memory="low"))
    with pytest.raises(ValueError, match="places its components itself"):
        low.to("cpu")
    block = low.transformer.transformer_blocks[0]
    arena = low._turns.arenas["transformer"]
    latents(low)
    low._get_qwen_prompt_embeds("a cat", device=torch.device("cpu"))  # the text encoder's turn: the blocks go home
    assert low._turns.resident == "text_encoder" and not arena.loaded
    assert all(t.data_ptr() == view.data_ptr() for t, _, view, _ in arena.entries)  # each a view of the host arena
    assert any(t is block.qkv.weight for t, _, _, _ in arena.entries)


@pytest.mark.gpu
def test_low_memory_on_gpu_equals_the_resident_pipeline():
    """On a GPU with CUDA graphs (the cached steps replay across turns: the buffer never moves; FP8 off: the tiny
    model is fp32): the latents of two calls equal the resident pipeline's bit for bit; between calls the text
    encoder is on the host and the blocks on the GPU (the memory saved at the real size: bench_qwen21.py
    --memory-low)."""
    device = torch.device("cuda")

    def twice(pipe) -> torch.Tensor:
        out = [latents(pipe, "cuda") for _ in range(2)]
        assert torch.equal(out[0], out[1])
        return out[1]

    expected = twice(optimize(QwenImage21Pipeline(**tiny_qwen21_components()).to(device), FastConfig(fp8=False)))
    # from the host, as a card too small for the resident pipeline loads it
    low = optimize(QwenImage21Pipeline(**tiny_qwen21_components()), FastConfig(fp8=False, memory="low"),
                   device=device)
    assert torch.equal(twice(low), expected)
    assert "cuda_graphs" in low.applied and "memory:low" in low.applied, low.applied
    assert {t.device.type for t in low.text_encoder.parameters()} == {"cpu"}
    assert {t.device.type for t in low.transformer.parameters()} == {"cuda"}


def test_prompts_encoded_ahead_in_one_turn_give_the_same_latents():
    """The command line's encode-ahead (cli/run.py) on 2.1 with memory="low": the batch's prompts and negative
    prompts encoded in one turn of the text encoder before the call, which then brings only the blocks in; the
    latents equal the resident pipeline's from the prompts themselves."""
    from types import SimpleNamespace

    from qwen_image_fast.cli.run import encode_ahead

    call = dict(true_cfg_scale=2.0, num_inference_steps=3, height=64, width=64, output_type="latent")
    prompts, negatives = ["a cat on a mat", "a dog"], ["blurry", "dark and grainy"]
    fast = optimize(QwenImage21Pipeline(**tiny_qwen21_components()), FastConfig(fp8=False))
    expected = fast(prompt=prompts, negative_prompt=negatives, **call,
                    generator=torch.Generator().manual_seed(0)).images
    low = optimize(QwenImage21Pipeline(**tiny_qwen21_components()), FastConfig(fp8=False, memory="low"))
    assert low.text_encoder_takes_turns
    jobs = [SimpleNamespace(prompt=p, negative_prompt=n, images=()) for p, n in zip(prompts, negatives)]
    encoded, until = encode_ahead(low, [jobs], 0)
    assert until == 1 and sorted(encoded[0]) == ["negative_prompt_embeds", "negative_prompt_embeds_mask",
                                                  "prompt_embeds", "prompt_embeds_mask"]
    assert low._turns.resident == "text_encoder" and low._turns.loads == 1
    got = low(**encoded[0], **call, generator=torch.Generator().manual_seed(0)).images
    assert low._turns.loads == 2, "the call encoded again"
    assert torch.equal(got, expected)


def test_a_second_pipeline_from_the_components_takes_them_over():
    """A memory='low' pipeline built from another one's components (its blocks on their turn in the first one's
    buffer) gives the resident pipeline's latents; the first one refuses to run from then on (both families share
    the placement's retirement: core/runtime/offload.py)."""
    from qwen_image_fast.pipelines.qwen_image21.pipeline import FastQwenImage21Pipeline

    resident = latents(optimize(QwenImage21Pipeline(**tiny_qwen21_components()), FastConfig(fp8=False)))
    first = optimize(QwenImage21Pipeline(**tiny_qwen21_components()), FastConfig(fp8=False, memory="low"))
    assert torch.equal(latents(first), resident) and first._turns.resident == "transformer"
    second = FastQwenImage21Pipeline(**first.components, fast_config=FastConfig(fp8=False, memory="low"))
    with pytest.raises(RuntimeError, match="placed again by another pipeline built from the same components"):
        latents(first)
    assert torch.equal(latents(second), resident)
