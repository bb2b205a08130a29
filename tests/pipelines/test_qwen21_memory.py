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
    assert sorted(planned) == sorted(fast.applied + ["memory:low"]) and "batched_cfg" in planned, (planned,
                                                                                                  fast.applied)
    resident = latents(fast, **extra)
    assert_close(resident, expected, 1e-5, f"resident, condition={condition}")
    assert torch.equal(latents(low, **extra), resident), "memory='low' differs from the resident pipeline"
    assert low.applied == [label for label in planned if label != "vae_2d_decode"], low.applied  # latents: no decode
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
    the placement's retirement: core/runtime/offload.py). The first one's prefix caches, which the transformer keeps
    across calls, go back when the second is built: its calls bind their own (on a GPU, under a budget, the first
    one's would take the room its plan counts on)."""
    from qwen_image_fast.pipelines.qwen_image21.pipeline import FastQwenImage21Pipeline

    resident = latents(optimize(QwenImage21Pipeline(**tiny_qwen21_components()), FastConfig(fp8=False)))
    first = optimize(QwenImage21Pipeline(**tiny_qwen21_components()), FastConfig(fp8=False, memory="low"))
    assert torch.equal(latents(first), resident) and first._turns.resident == "transformer"
    assert first.transformer.prefix_cache.slots
    second = FastQwenImage21Pipeline(**first.components, fast_config=FastConfig(fp8=False, memory="low"))
    assert not second.transformer.prefix_cache.slots
    with pytest.raises(RuntimeError, match="placed again by another pipeline built from the same components"):
        latents(first)
    assert torch.equal(latents(second), resident)


# ---- a memory budget (FastConfig(max_memory_gib=...)): what does not fit the buffer streams

BLOCKS, TEXT_LAYERS = 5, 12
ONE = dict(prompt="a cat on a mat", negative_prompt="blurry", true_cfg_scale=2.0, num_inference_steps=3, height=64,
           width=64, output_resolution=64)


def components() -> dict:
    return tiny_qwen21_components(num_layers=BLOCKS, text_layers=TEXT_LAYERS)


def budget_for(resident_blocks: int, config: FastConfig = FastConfig(fp8=False)) -> float:
    """The max_memory_gib whose buffer keeps `resident_blocks` of the 5 blocks (and is at least the text encoder's
    floor: its fixed part and 2 layer slots), by memory.place_low_memory's arithmetic (no CUDA context on the CPU)."""
    from qwen_image_fast.pipelines.core.runtime.memory import placed_bytes
    from qwen_image_fast.pipelines.qwen_image21 import memory
    from qwen_image_fast.pipelines.qwen_image21.model import SHARED_MODULES

    probe = optimize(QwenImage21Pipeline(**components()), config.replace(memory="low"))
    blocks, text = probe._turns.arenas["transformer"], probe._turns.arenas["text_encoder"]
    buffer = max(blocks.streaming_floor() + resident_blocks * blocks.layer_stride, text.streaming_floor())
    return (placed_bytes(probe, SHARED_MODULES) + memory.workspace_bytes(probe) + buffer) / 2**30


def images(pipe, **extra):
    return pipe(**ONE | extra, generator=torch.Generator().manual_seed(0)).images


def test_a_budget_streams_blocks_and_text_layers_with_the_same_images():
    """2 of the 5 blocks stay in the buffer and 3 stream through its two slots; the text encoder (12 decoder layers:
    more bytes than that buffer) streams the layers that do not fit. With CFG the images (decoded: the prefix caches
    go back before the VAE decode, and the next call extracts them anew) equal the resident pipeline's bit for bit,
    call after call, and stock's within 1e-5; `applied` names the budget."""
    gib = budget_for(resident_blocks=2)
    expected = images(optimize(QwenImage21Pipeline(**components()), FastConfig(fp8=False)), output_type="np")
    assert_close(torch.from_numpy(expected), torch.from_numpy(images(QwenImage21Pipeline(**components()),
                                                                       output_type="np")), 1e-5, "resident vs stock")
    low = optimize(QwenImage21Pipeline(**components()), FastConfig(fp8=False, memory="low", max_memory_gib=gib))
    planned = low.applied
    assert f"memory:low{gib:g}gib" in planned and "batched_cfg" not in planned, planned
    turns = low._turns
    blocks, text = turns.arenas["transformer"], turns.arenas["text_encoder"]
    assert turns.streams("transformer") and turns.streams("text_encoder")
    for call in range(2):
        assert np.array_equal(images(low, output_type="np"), expected), f"call {call}"
        assert blocks.streamed == (0, 2, 4) and blocks.stream.copied > 0
        assert not low.transformer.prefix_cache.slots, "the prefix caches were kept through the decode"
        assert low.applied == planned, low.applied
    low._get_qwen_prompt_embeds("a red fox", device=torch.device("cpu"))
    assert turns.resident == "text_encoder" and text.streamed and text.stream.copied == len(text.streamed) * (
        text.layer_stride), "one forward of the text encoder copies each streamed layer once"


def test_a_step_cache_s_pieces_stream_their_own_blocks():
    """FastConfig(cache=...) runs a step in pieces (front, middle, back; the middle skipped on cached steps), each a
    run of blocks with its own copies: the latents equal the resident pipeline's with the same cache."""
    cached = FastConfig(fp8=False, cache="every:2,1,1")
    expected = images(optimize(QwenImage21Pipeline(**components()), cached), output_type="latent",
                      num_inference_steps=4)
    low = optimize(QwenImage21Pipeline(**components()),
                   cached.replace(memory="low", max_memory_gib=budget_for(resident_blocks=1)))
    assert torch.equal(images(low, output_type="latent", num_inference_steps=4), expected)
    assert low._turns.arenas["transformer"].streamed and "step_cache:dbcache:F1B1:every2:w0" in low.applied


def test_a_budget_s_plan_refuses_calls_beyond_it():
    """What the budget is planned for (memory.PLAN): one image a call, at most 1024x1024, 50 steps, no condition
    image, a prefix of at most PLANNED_TEXT_TOKENS; each refused before anything runs (the prefix at its prefill),
    naming what to do. A budget below the plan's floor is refused when the pipeline is built."""
    from qwen_image_fast.pipelines.qwen_image21.memory import PLANNED_TEXT_TOKENS

    gib = budget_for(resident_blocks=1)
    low = optimize(QwenImage21Pipeline(**components()), FastConfig(fp8=False, memory="low", max_memory_gib=gib))
    plan = r"planned for one image a call of at most 1024x1024 pixels and 50 steps; this call has "
    for extra, has in ((dict(prompt=["a cat", "a dog"]), r"2 image\(s\) of 64x64 and 3 steps"),
                       (dict(num_images_per_prompt=2), r"2 image\(s\) of 64x64 and 3 steps"),
                       (dict(num_inference_steps=51), r"1 image\(s\) of 64x64 and 51 steps"),
                       (dict(sigmas=[1.0 - i / 60 for i in range(60)]), r"1 image\(s\) of 64x64 and 60 steps"),
                       (dict(height=1056, width=1024), r"1 image\(s\) of 1024x1056 and 3 steps"),
                       (dict(height=None, width=None, output_resolution=1056), r"1 image\(s\) of 1056x1056")):
        with pytest.raises(ValueError, match=plan + has):
            images(low, **extra)
    with pytest.raises(ValueError, match=r"planned for text-to-image calls; this call has 1 condition image\(s\)"):
        images(low, image=CONDITION)
    assert low._turns.loads == 0, "a refused call brought a component onto the device"
    with pytest.raises(ValueError, match=rf"the prefix .* has \d+ tokens; the memory budget .* is planned for at most "
                                         rf"{PLANNED_TEXT_TOKENS}: shorten the prompt"):
        images(low, prompt="a cat " * PLANNED_TEXT_TOKENS)
    assert low._turns.loads >= 1  # the prompt was encoded before the prefill refused it; the next call runs
    images(low, output_type="latent")
    with pytest.raises(ValueError, match=r"max_memory_gib=.* is too small for this pipeline: it needs at least .* "
                                         r"one 1024x1024 image's prefix caches \(both CFG branches"):
        optimize(QwenImage21Pipeline(**components()), FastConfig(fp8=False, memory="low", max_memory_gib=gib / 2))


def test_the_plan_counts_the_target_tokens_the_transformer_sees():
    """memory.planned_target_tokens: the tokens of the target image the transformer reads in a call of the plan's
    size (the prefix caches and activations of the denoising loop scale with them)."""
    from qwen_image_fast.pipelines.qwen_image21 import memory

    pipe = QwenImage21Pipeline(**components())
    seen = []
    pipe.transformer.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs["hidden_states"].shape),
                                               with_kwargs=True)
    side = memory.PLAN.side
    pipe(prompt="a cat", height=side, width=side, num_inference_steps=1, output_type="latent")
    assert seen[0][1] == memory.planned_target_tokens(pipe) == (side // 16) ** 2, seen


def test_a_budget_plans_the_decode_that_runs():
    """The plan's workspace holds the decode the VAE will run: the 2D decode's (vae_2d_decode, the default) or, with
    it switched off, diffusers' (memory.DECODE_BYTES_PER_PIXEL). At the tiny size the decode's term is the larger one
    (the plan is for a 1024x1024 image), so a budget that fits with the 2D decode is refused without it."""
    from qwen_image_fast.pipelines.qwen_image21 import memory

    gib = budget_for(resident_blocks=1)
    low = optimize(QwenImage21Pipeline(**components()), FastConfig(fp8=False, memory="low", max_memory_gib=gib))
    assert memory.workspace_bytes(low) == memory.DECODE_2D_BYTES_PER_PIXEL * 1024 ** 2
    assert images(low, output_type="np").shape == (1, 64, 64, 4) and "vae_2d_decode" in low.applied, low.applied
    with pytest.raises(ValueError, match=r"max_memory_gib=.* is too small for this pipeline: .* or its decode"):
        optimize(QwenImage21Pipeline(**components()),
                 FastConfig(fp8=False, vae_2d_decode=False, memory="low", max_memory_gib=gib))
    stock_decode = FastConfig(fp8=False, vae_2d_decode=False, memory="low", max_memory_gib=gib + 5)
    assert memory.workspace_bytes(optimize(QwenImage21Pipeline(**components()), stock_decode)) == (
        memory.DECODE_BYTES_PER_PIXEL * 1024 ** 2)


@pytest.mark.gpu
def test_a_budget_on_gpu_streams_inside_the_graphs(monkeypatch):
    """On CUDA with graphs: the blocks' copies on the side stream from pinned memory inside the cached steps' graphs,
    the prefix caches released before each decode and the graphs captured anew; three calls' images equal the
    resident pipeline's bit for bit, CFG's branches one by one in both (the CUDA context taken as 0 bytes: its
    measure moves by more than the tiny model weighs)."""
    from qwen_image_fast.pipelines.core.runtime.streaming import LayerStream
    from qwen_image_fast.pipelines.core.runtime import memory

    monkeypatch.setattr(memory, "context_bytes", lambda device: 0)  # what the budget's plan reads
    device = torch.device("cuda")

    def decoded(pipe):
        return pipe(**ONE, output_type="np", generator=torch.Generator("cuda").manual_seed(0)).images

    # the branches one by one, as a budget runs them (batched CFG's batch of two takes other GEMM kernels on a GPU)
    fast = optimize(QwenImage21Pipeline(**components()).to(device), FastConfig(fp8=False, batched_cfg=False))
    expected = decoded(fast)
    del fast
    low = optimize(QwenImage21Pipeline(**components()), FastConfig(fp8=False, memory="low",
                                                                   max_memory_gib=budget_for(resident_blocks=2)),
                   device=device)
    for call in range(3):
        assert np.array_equal(decoded(low), expected), f"call {call}"
        assert not low.transformer.prefix_cache.slots
    blocks = low._turns.arenas["transformer"]
    assert blocks.streamed == (0, 2, 4) and isinstance(blocks.stream, LayerStream)
    assert blocks.stream.side is not None and blocks.host.is_pinned()
    assert "cuda_graphs" in low.applied, low.applied
