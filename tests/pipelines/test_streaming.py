"""FastConfig(memory="low", max_memory_gib=...): a budget's buffer smaller than the weights taking turns, the layers
that do not fit streamed through two slots (core/runtime/streaming.py). On the CPU the copies run in order where
they are issued: the layout, the order of the copies, the plan and the images are what these tests check (the
side stream and the graphs: test_streaming_on_gpu)."""

import pytest
import torch
from test_lora import lightning_format
from test_modulation import CFG
from test_pipeline import run

from qwen_image_fast import FastConfig, optimize
from qwen_image_fast.pipelines.core.runtime import memory
from qwen_image_fast.pipelines.core.runtime.offload import HostArena, TakingTurns
from qwen_image_fast.pipelines.core.runtime.streaming import SLOTS, LayerStream, streamed_layers
from qwen_image_fast.pipelines.tiny import tiny_pipeline

FP8 = FastConfig(fp8=True)  # FP8 on: the weights that move are the FP8 codes and scales (FP8 off: test_modulation)
BLOCKS, TEXT_LAYERS = 5, 20  # 20 text layers: more bytes than the buffer of 1 block and 2 slots


def pipelines(config: FastConfig, device="cpu"):
    """(the fast pipeline, a memory='low' one with `config`'s budget) of the same tiny model with 5 blocks and a
    20-layer text encoder (BF16 on CUDA)."""
    def build(c):
        stock = tiny_pipeline(transformer_config={"num_layers": BLOCKS}, text_layers=TEXT_LAYERS)
        if device == "cuda":  # BF16 on the GPU (_scaled_mm takes no bias with an fp32 output)
            stock = stock.to(torch.bfloat16)
        return optimize(stock, c, device=device)
    fast = build(FP8)  # memory="fast": the components are where .to puts them
    return (fast.to(device) if device == "cuda" else fast), build(config)


def budget_for(pipe, resident_blocks: int, device=torch.device("cpu")) -> float:
    """The max_memory_gib whose buffer keeps `resident_blocks` of the transformer's blocks (the plan's arithmetic,
    memory.place_low_memory's, on a memory='low' pipeline without a budget)."""
    blocks = pipe._turns.arenas["transformer"]
    buffer = blocks.streaming_floor() + resident_blocks * blocks.layer_stride
    return (memory.context_bytes(device) + memory.placed_bytes(pipe) + memory.workspace_bytes(pipe) + buffer) / memory.GIB


def test_streamed_layers_are_spread_with_compute_before_the_first():
    assert streamed_layers(60, 60) == ()
    assert streamed_layers(60, 48) == (2, 7, 12, 17, 22, 27, 32, 37, 42, 47, 52, 57)
    assert streamed_layers(28, 17) == (1, 3, 6, 8, 11, 14, 16, 19, 21, 24, 26)
    assert streamed_layers(5, 0) == (0, 1, 2, 3, 4)
    for n, resident in ((60, 1), (28, 0), (7, 3)):
        spread = streamed_layers(n, resident)
        assert len(set(spread)) == n - resident and all(0 <= i < n for i in spread)


def test_an_arena_streams_what_its_buffer_cannot_hold():
    """Layout, values and the order of the copies: a streamed layer's slot is refilled only after the layer that
    used it ran, and every layer reads its own values when it runs, skipped layers included."""
    fixed = [torch.randn(10)]
    layers = [[torch.full((33,), float(i)), torch.arange(5, dtype=torch.int32) + i] for i in range(6)]
    arena = HostArena(fixed, pin=False, layers=layers)
    stride = arena.layer_stride
    assert arena.streaming_floor() == arena.fixed_nbytes + SLOTS * stride
    with pytest.raises(ValueError, match="cannot hold this arena's fixed part and 2 layer slots"):
        TakingTurns({"a": arena}, torch.device("cpu"), main="a", buffer_bytes=arena.streaming_floor() - 1)
    turns = TakingTurns({"a": arena}, torch.device("cpu"), main="a", buffer_bytes=arena.streaming_floor() + 2 * stride)
    turns.use("a")
    assert arena.streamed == streamed_layers(6, 2) == (0, 2, 3, 5) and turns.streams("a")
    buffer = turns.buffer
    for t, _, _, layer in arena.entries:  # every tensor inside the buffer
        assert buffer.data_ptr() <= t.data_ptr() < buffer.data_ptr() + buffer.numel()
    stream = arena.stream
    for skipped in (set(), {1, 3}):
        stream.begin(0, 6)
        for i in range(6):
            stream.before(i)
            if i not in skipped:
                assert torch.equal(layers[i][0], torch.full((33,), float(i))), (i, skipped)
                assert torch.equal(layers[i][1], torch.arange(5, dtype=torch.int32) + i)
        stream.end()
    assert stream.copied == 8 * stride
    stream.begin(1, 4)  # a run of some layers only (a step cache's piece): its streamed layers, 2 and 3
    for i in range(1, 4):
        stream.before(i)
    assert torch.equal(layers[3][0], torch.full((33,), 3.0))
    stream.end()
    assert stream.copied == 10 * stride
    with pytest.raises(RuntimeError, match="streamed layer 3 ran before its copy"):
        stream.begin(0, 2)
        stream.before(3)
    stream.end()


def test_a_changed_streamed_weight_is_refused_not_lost():
    layers = [[torch.zeros(8)] for _ in range(4)]
    arena = HostArena([], pin=False, layers=layers)
    turns = TakingTurns({"a": arena, "b": HostArena([torch.zeros(4)], pin=False)}, torch.device("cpu"), main="a",
                        buffer_bytes=arena.streaming_floor())
    turns.use("a")
    layers[arena.streamed[0]][0].add_(1)
    with pytest.raises(RuntimeError, match="streamed layer 0 was changed in place"):
        turns.use("b")


def test_a_budget_streams_blocks_and_text_layers_with_the_same_latents():
    """The transformer keeps 1 of its 5 blocks and streams 4 through the two slots; the text encoder's 20 layers do
    not fit the same buffer either and 4 of them stream. The latents equal memory='fast' bit for bit (FP8 on), with
    CFG and with prompt embeddings encoded ahead; `applied` names the budget."""
    probe = pipelines(FP8.replace(memory="low"))[1]
    gib = budget_for(probe, resident_blocks=1)
    fast, low = pipelines(FP8.replace(memory="low", max_memory_gib=gib))
    expected = run(fast, **CFG)
    assert torch.equal(run(low, **CFG), expected)
    turns = low._turns
    blocks, text = turns.arenas["transformer"], turns.arenas["text_encoder"]
    assert turns.resident == "transformer" and blocks.streamed == streamed_layers(BLOCKS, 1) == (0, 1, 3, 4)
    assert blocks.stream.copied > 0 and turns.streams("text_encoder")
    assert f"memory:low{gib:g}gib" in low.applied and low.transformer.modulation_tables.capacity == 1
    low.encode_prompt("a red fox in snow", device=torch.device("cpu"))
    assert turns.resident == "text_encoder" and text.streamed == streamed_layers(TEXT_LAYERS, 16)
    assert text.stream.copied == 4 * text.layer_stride  # one forward, its 4 streamed layers
    embeds, mask = low.encode_prompt("a red fox in snow", device=torch.device("cpu"))
    assert torch.equal(embeds, fast.encode_prompt("a red fox in snow", device=torch.device("cpu"))[0])
    assert torch.equal(run(low, prompt_embeds=embeds, prompt_embeds_mask=mask),
                       run(fast, prompt_embeds=embeds, prompt_embeds_mask=mask))


def test_a_step_cache_s_pieces_stream_their_own_blocks():
    """FastConfig(cache=...) runs a step in pieces (front, middle, back; the middle skipped on cached steps), each a
    run of blocks with its own copies: the same latents as the fast pipeline with the same cache."""
    probe = pipelines(FP8.replace(memory="low"))[1]
    cached = FP8.replace(cache="every:2,1,1")
    fast, low = pipelines(cached.replace(memory="low", max_memory_gib=budget_for(probe, resident_blocks=1)))
    fast.fast_config = cached
    assert torch.equal(run(low, **CFG, num_inference_steps=4), run(fast, **CFG, num_inference_steps=4))
    assert low._turns.arenas["transformer"].streamed and "step_cache:dbcache:F1B1:every2:w0" in low.applied


def test_placing_the_components_again_gives_them_to_the_new_pipeline():
    """A second memory='low' pipeline from the same components, with another budget (as bench_memory builds one per
    budget), built while the first one's transformer is on its turn with 4 of 5 blocks in the two slots: the new
    pipeline's latents equal memory='fast' (each streamed block's weights came from the host, not from a slot holding
    another block), the text encoder's streaming hooks are the new arena's only, the first pipeline refuses to run
    (its weights are the new one's now) and its buffer is not kept alive. A memory='fast' pipeline from them gets the
    weights back too. Each new pipeline starts without the modulation tables the earlier one's calls built (under a
    budget the plan counts one, its own) and with its own capacity for them."""
    import gc
    import weakref

    from qwen_image_fast import QwenImageFastPipeline

    probe = pipelines(FP8.replace(memory="low"))[1]
    fast, low = pipelines(FP8.replace(memory="low", max_memory_gib=budget_for(probe, resident_blocks=1)))
    expected = run(fast, **CFG)
    assert torch.equal(run(low, **CFG), expected) and low._turns.resident == "transformer"
    vision = {id(t) for t in low.text_encoder.model.visual.parameters()}
    decoder, _ = memory.text_encoder_layers(low.text_encoder, vision)
    hooks = len(decoder._forward_pre_hooks) + len(decoder._forward_hooks)
    first = weakref.ref(low._turns.arenas["transformer"])
    components = {name: getattr(low, name) for name in ("scheduler", "vae", "text_encoder", "tokenizer", "transformer")}
    tables = low.transformer.modulation_tables
    assert tables.tables and tables.capacity == 1
    again = QwenImageFastPipeline(**components, fast_config=FP8.replace(
        memory="low", max_memory_gib=budget_for(probe, resident_blocks=0)))
    assert not tables.tables and tables.capacity == 1
    assert len(decoder._forward_pre_hooks) + len(decoder._forward_hooks) == hooks
    with pytest.raises(RuntimeError, match="placed again by another pipeline built from the same components"):
        run(low, **CFG)
    assert torch.equal(run(again, **CFG), expected)
    assert again._turns.arenas["transformer"].streamed == streamed_layers(BLOCKS, 0)
    embeds, _ = again.encode_prompt("a red fox in snow", device=torch.device("cpu"))
    assert again._turns.arenas["text_encoder"].stream.copied > 0
    del low
    gc.collect()
    assert first() is None
    run(again, **CFG)  # the transformer's turn again, its blocks in the slots
    back = QwenImageFastPipeline(**components, fast_config=FP8)
    assert not tables.tables and tables.capacity == tables.DEFAULT_CAPACITY
    assert torch.equal(run(back, **CFG), expected)
    assert back.transformer.block_arena is None


def test_budget_errors():
    probe = pipelines(FP8.replace(memory="low"))[1]
    floor = budget_for(probe, resident_blocks=0)
    text_floor = probe._turns.arenas["text_encoder"].streaming_floor()
    with pytest.raises(ValueError, match=r"max_memory_gib=.* is too small for this pipeline: it needs at least "
                                         r".* GiB \(CUDA context 0.00, VAE and transformer parts"):
        pipelines(FP8.replace(memory="low", max_memory_gib=floor * 0.5))
    assert text_floor < probe._turns.arenas["transformer"].streaming_floor()  # the blocks' slots set the floor
    with pytest.raises(ValueError, match="max_memory_gib=16 plans memory='low''s buffer; set memory='low' too"):
        FastConfig(max_memory_gib=16)
    for bad in (0, -1, "16", True):
        with pytest.raises(ValueError, match="allowed: None or a number of GiB > 0"):
            FastConfig(memory="low", max_memory_gib=bad)
    low = pipelines(FP8.replace(memory="low", max_memory_gib=budget_for(probe, resident_blocks=1)))[1]
    with pytest.raises(ValueError, match=r"planned for one image a call of at most 1328x1328 pixels and 50 steps; "
                                         r"this call has 2 image\(s\) of 48x32 and 3 steps"):
        run(low, prompt=["a cat", "a dog"])
    with pytest.raises(ValueError, match="this call has 1 image.s. of 48x32 and 51 steps"):
        run(low, prompt="a cat", num_inference_steps=51)
    low.load_lora_weights(lightning_format([f"transformer_blocks.{i}.attn.to_q" for i in (0, 1)]))
    with pytest.raises(ValueError, match="fuse_lora with FastConfig.max_memory_gib=.*run the adapters unfused"):
        low.fuse_lora()


@pytest.mark.gpu
def test_streaming_on_gpu(monkeypatch):
    """On CUDA: the copies on the side stream from pinned memory, inside the transformer's CUDA graphs (captured
    on the second call, replayed on the third), the same latents as memory='fast' each time. The CUDA context is
    taken as 0 bytes: its measure moves by more than the tiny model's blocks weigh."""
    monkeypatch.setattr(memory, "context_bytes", lambda device: 0)
    probe = pipelines(FP8.replace(memory="low"), device="cuda")[1]
    gib = budget_for(probe, resident_blocks=2, device=torch.device("cuda"))
    del probe
    fast, low = pipelines(FP8.replace(memory="low", max_memory_gib=gib), device="cuda")

    def latents(pipe):
        return pipe(**CFG, height=64, width=64, num_inference_steps=3, output_type="latent",
                    generator=torch.Generator("cuda").manual_seed(0)).images

    expected = latents(fast)
    for _ in range(3):
        assert torch.equal(latents(low), expected)
    blocks = low._turns.arenas["transformer"]
    assert blocks.streamed == (0, 2, 4) and isinstance(blocks.stream, LayerStream)
    assert blocks.stream.side is not None and blocks.host.is_pinned()
    assert "cuda_graphs" in low.applied and low.runner.graphs.graphs


def test_a_budget_too_small_for_a_2512_size_checkpoint_is_refused_before_loading(tmp_path):
    """from_pretrained reads the checkpoint's transformer config first: a Qwen-Image-2512-size model (3072 wide, 60
    blocks) under STREAMING_MIN_GIB is refused before any weight loads (this folder has none to load)."""
    import json

    from qwen_image_fast import QwenImageFastPipeline

    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text(json.dumps(
        {"_class_name": "QwenImageTransformer2DModel", "num_attention_heads": 24, "attention_head_dim": 128,
         "num_layers": 60}))
    with pytest.raises(ValueError, match=r"max_memory_gib=8 is too small for .*: it needs at least 10 GiB"):
        QwenImageFastPipeline.from_pretrained(tmp_path, fast_config=FastConfig(memory="low", max_memory_gib=8))
