"""The modulation table (FastConfig.modulation_table) against the modulation computed in each forward, to the
dtype's last bits (TABLE_TOL), at the transformer (fp32 and bf16, FP8 on and off, zero_cond_t, additional_t_cond)
and through the pipeline (Euler, DPM-Solver++, UniPC, a replaced scheduler, a new resolution, unbatched and
selective CFG, LoRAs on the modulation layers); and memory="low" (the same latents, weights taking turns, changes
made while a turn lasts kept)."""

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from test_lora import LORA_B, diffusers_format, lightning_format
from test_pipeline import EXACT, fast_pipeline, run
from test_transformer import make_inputs, tiny_stock

from helpers import assert_close
from qwen_image_fast import FastConfig
from qwen_image_fast.kernels._utils import rel_rms_error
from qwen_image_fast.pipelines.qwen_image.model.modulation import ModulationTables
from qwen_image_fast.pipelines.core.config import FastTransformerConfig
from qwen_image_fast.pipelines.qwen_image.model.transformer import FastQwenImageTransformer

NO_TABLE = EXACT.replace(modulation_table=False)
CFG = dict(prompt="a red fox in snow", negative_prompt="blurry", true_cfg_scale=3.0)
MOD_LORA = [f"transformer_blocks.{i}.{m}.1" for i in (0, 1) for m in ("img_mod", "txt_mod")]
# A table runs each block's modulation linears once over every step's rows, a forward over its own: the same sums,
# in an order that may follow the row count (CPU fp32: 8e-8 apart in these outputs; CPU bf16: bit-equal). Rel-RMS
# bounds on outputs: fp32 well under EXACT_TOL, bf16 one unit in its last place.
TABLE_TOL = {torch.float32: 1e-6, torch.bfloat16: 2.0 ** -8}


@pytest.mark.parametrize("dtype, fp8, zero_cond_t, shape", [
    (torch.float32, False, False, "square"), (torch.float32, True, True, "edit"),
    (torch.bfloat16, True, False, "square"), (torch.bfloat16, False, True, "edit"),
])
def test_table_row_equals_the_forwards_own_modulation(dtype, fp8, zero_cond_t, shape):
    stock = tiny_stock(zero_cond_t=zero_cond_t).to(dtype)
    fast = FastQwenImageTransformer.from_diffusers(stock, FastTransformerConfig(fp8=fp8))
    inputs = make_inputs(stock, shape, dtype=dtype, padded=True)
    steps = torch.tensor([[0.97, 0.6], [0.5, 0.3], [0.02, 0.01]], dtype=dtype)  # each row its own: layout strict
    table, layout = fast.modulation_table(steps), fast.modulation_layout(2)
    assert table.shape == (3, layout.size)
    for n in range(3):  # every block's vectors where the forward reads them, as the forward computes them
        silu_temb, silu_temb_t = fast.time_embedding(steps[n], None, None, dtype)
        torch.testing.assert_close(layout.out(table[n]), fast.norm_out.linear(silu_temb_t), msg=f"step {n}")
        for i, block in enumerate(fast.transformer_blocks):
            for looked_up, own in zip(layout.block(table[n], i), block.modulation(silu_temb, silu_temb_t)):
                torch.testing.assert_close(looked_up, own, msg=f"step {n}, block {i}")
    for n in range(3):
        own = fast(**{**inputs, "timestep": steps[n]}, return_dict=False)[0]
        looked_up = fast(**{**inputs, "timestep": steps[n]}, modulation=table[n], return_dict=False)[0]
        assert_close(looked_up, own, TABLE_TOL[dtype], f"step {n}")
    other = fast(**{**inputs, "timestep": steps[0]}, modulation=table[2], return_dict=False)[0]
    own = fast(**{**inputs, "timestep": steps[0]}, return_dict=False)[0]
    assert rel_rms_error(other, own) > 10 * TABLE_TOL[dtype], \
        "a row of another step must change the output past the bound for this test to mean anything"


def test_additional_t_cond_is_part_of_the_key():
    stock = tiny_stock(use_additional_t_cond=True)
    fast = FastQwenImageTransformer.from_diffusers(stock, FastTransformerConfig(fp8=False))
    inputs = make_inputs(stock, "square")
    steps = torch.tensor([[0.9, 0.9], [0.3, 0.3]])
    for cond in (torch.tensor([0, 0]), torch.tensor([1, 0])):
        table = fast.modulation_table(steps, additional_t_cond=cond)
        for n in range(2):
            kwargs = {**inputs, "timestep": steps[n], "additional_t_cond": cond}
            own = fast(**kwargs, return_dict=False)[0]
            assert_close(fast(**kwargs, modulation=table[n], return_dict=False)[0], own, TABLE_TOL[torch.float32])
    assert fast.modulation_tables.built == 2


def test_tables_are_cached_bounded_and_follow_the_weights():
    fast = FastQwenImageTransformer.from_diffusers(tiny_stock(), FastTransformerConfig(fp8=False))
    steps = torch.tensor([[0.9], [0.3]])
    first = fast.modulation_table(steps)
    assert fast.modulation_table(steps) is first and fast.modulation_tables.built == 1
    with torch.no_grad():
        fast.transformer_blocks[1].txt_mod[1].bias.add_(1.0)  # an in-place change: a new table
    second = fast.modulation_table(steps)
    assert fast.modulation_tables.built == 2 and not torch.equal(second, first)
    fast.modulation_table(steps, lora_scale=0.5)  # another LoRA scale is another key
    assert fast.modulation_tables.built == 3
    tables = ModulationTables(capacity=2)
    for key in "abc":
        tables.get(key, lambda: torch.zeros(1))
    assert list(tables.tables) == ["b", "c"]


def test_wrong_row_is_refused():
    stock = tiny_stock()
    fast = FastQwenImageTransformer.from_diffusers(stock, FastTransformerConfig(fp8=False))
    table = fast.modulation_table(torch.tensor([[0.5]]))  # batch 1
    with pytest.raises(ValueError, match="batch 2 takes a row of modulation_table"):
        fast(**make_inputs(stock, "square"), modulation=table[0])


@pytest.mark.parametrize("scheduler", ["dpm++2m", "unipc"])
def test_pipeline_with_table_equals_without(scheduler):
    """Other samplers' timesteps (Euler's against stock: test_optimizations.py)."""
    plain, table = fast_pipeline(NO_TABLE.replace(scheduler=scheduler)), fast_pipeline(EXACT.replace(scheduler=scheduler))
    assert "modulation_table" not in plain.applied and "modulation_table" in table.applied
    assert_close(run(table, **CFG), run(plain, **CFG), TABLE_TOL[torch.float32])
    assert "modulation_table" in table.applied


@pytest.mark.parametrize("scheduler", ["euler"])
def test_pipeline_with_table_equals_without_in_bf16(scheduler):
    plain = fast_pipeline(NO_TABLE.replace(scheduler=scheduler)).to(torch.bfloat16)
    table = fast_pipeline(EXACT.replace(scheduler=scheduler)).to(torch.bfloat16)
    out = run(table, **CFG)
    assert out.dtype == torch.bfloat16
    assert_close(out, run(plain, **CFG), TABLE_TOL[torch.bfloat16])


def test_new_resolution_and_replaced_scheduler_build_new_tables():
    plain, table = fast_pipeline(NO_TABLE), fast_pipeline()
    transformer = table.transformer
    assert_close(run(table, **CFG), run(plain, **CFG), TABLE_TOL[torch.float32])
    built = transformer.modulation_tables.built
    assert_close(run(table, **CFG), run(plain, **CFG), TABLE_TOL[torch.float32])
    assert transformer.modulation_tables.built == built, "the same schedule reuses its table"
    assert_close(run(table, height=64, width=32, **CFG), run(plain, height=64, width=32, **CFG),
                 TABLE_TOL[torch.float32])
    assert transformer.modulation_tables.built > built, "another resolution shifts the timesteps: a new table"
    built = transformer.modulation_tables.built
    for pipe in (plain, table):  # Lightning's scheduler: other timesteps at the same resolution
        pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(
            pipe.scheduler.config, base_shift=1.0986, max_shift=1.0986, shift_terminal=None)
    assert_close(run(table, **CFG), run(plain, **CFG), TABLE_TOL[torch.float32])
    assert transformer.modulation_tables.built > built


def test_lora_on_the_modulation_layers_rebuilds_the_tables():
    plain, table = fast_pipeline(NO_TABLE), fast_pipeline()
    no_lora = run(table, **CFG)
    for pipe in (plain, table):
        pipe.load_lora_weights(lightning_format(MOD_LORA), adapter_name="mod")
    with_lora = run(table, **CFG)
    assert_close(with_lora, run(plain, **CFG), TABLE_TOL[torch.float32])
    assert rel_rms_error(with_lora, no_lora) > 10 * TABLE_TOL[torch.float32], \
        "the LoRA must change the modulation past the bound for this test to mean anything"
    for pipe in (plain, table):
        pipe.load_lora_weights(diffusers_format(LORA_B), adapter_name="b")
        pipe.set_adapters(["mod", "b"], [0.7, 1.2])
    assert_close(run(table, **CFG), run(plain, **CFG), TABLE_TOL[torch.float32])
    assert_close(run(table, attention_kwargs={"scale": 0.4}, **CFG), run(plain, attention_kwargs={"scale": 0.4}, **CFG),
                 TABLE_TOL[torch.float32])
    for pipe in (plain, table):
        pipe.fuse_lora(lora_scale=0.5)
    assert_close(run(table, **CFG), run(plain, **CFG), TABLE_TOL[torch.float32])
    for pipe in (plain, table):
        pipe.unfuse_lora()
        pipe.unload_lora_weights()
    assert torch.equal(run(table, **CFG), no_lora)


@pytest.mark.parametrize("fp8", [True])  # FP8 off: test_optimizations.py, against stock
def test_low_memory_gives_the_same_latents(fp8):
    fast, low = fast_pipeline(EXACT.replace(fp8=fp8)), fast_pipeline(EXACT.replace(fp8=fp8, memory="low"))
    after_table = fast.applied.index("modulation_table") + 1
    assert low.applied == fast.applied[:after_table] + ["memory:low"] + fast.applied[after_table:]
    assert torch.equal(run(low, **CFG), run(fast, **CFG))
    turns = low._turns
    assert turns.resident == "transformer" and turns.loads == 2  # text encoder, then the block linears
    embeds, mask = low.encode_prompt("a red fox in snow", device=torch.device("cpu"))
    assert turns.resident == "text_encoder"
    assert embeds.grad_fn is None  # no autograd graph keeping the turn's weights and activations on the device
    assert torch.equal(run(low, prompt_embeds=embeds, prompt_embeds_mask=mask),
                       run(fast, prompt_embeds=embeds, prompt_embeds_mask=mask))
    assert turns.resident == "transformer" and turns.loads == 4
    assert all(t.device.type == "cpu" for t in low.transformer.transformer_blocks[0].img_mod.parameters())


def test_low_memory_keeps_what_changed_during_a_turn():
    """fuse_lora folds adapters into the FP8 weights in place while they are on the device: the next turn of the
    text encoder must not lose that (offload.py copies back what changed)."""
    fast, low = fast_pipeline(FastConfig(fp8=True)), fast_pipeline(FastConfig(fp8=True, memory="low"))
    for pipe in (fast, low):
        pipe.load_lora_weights(lightning_format([f"transformer_blocks.{i}.attn.to_q" for i in (0, 1)]))
        run(pipe, **CFG)  # low: the block linears are on the device now
        pipe.fuse_lora()
    assert torch.equal(run(low, **CFG), run(fast, **CFG))  # a text encoder turn, then the fused weights again


def test_memory_setting_errors():
    from qwen_image_fast.pipelines.tiny import tiny_pipeline
    from diffusers import QwenImageImg2ImgPipeline
    from qwen_image_fast import optimize

    with pytest.raises(ValueError, match="places its components itself"):
        fast_pipeline(EXACT.replace(memory="low")).to("cpu")
    with pytest.raises(ValueError, match="memory='low'.*text-to-image QwenImageFastPipeline only"):
        optimize(tiny_pipeline(QwenImageImg2ImgPipeline), EXACT.replace(memory="low"))
    with pytest.raises(ValueError, match="memory='huge'; allowed: fast, low"):
        FastConfig(memory="huge")
    with pytest.raises(ValueError, match="needs modulation_table=True"):
        FastConfig(memory="low", modulation_table=False)
    with pytest.raises(ValueError, match="not supported"):
        FastConfig(memory="low", parallel="cfg")


@pytest.mark.gpu
@pytest.mark.parametrize("zero_cond_t", [False, True])
def test_table_at_the_real_width_on_gpu(zero_cond_t):
    """Two blocks of the real width (24 heads x 128, FP8, bf16), eager and replayed from a CUDA graph."""
    from test_transformer import compute_inputs

    from qwen_image_fast.pipelines.core.optimizations import CallRecord
    from qwen_image_fast.pipelines.core.runtime.runner import Runner

    stock = tiny_stock(zero_cond_t=zero_cond_t, num_layers=2, attention_head_dim=128, num_attention_heads=24,
                       joint_attention_dim=3584, axes_dims_rope=(16, 56, 56), device="cuda").to(torch.bfloat16)
    fast = FastQwenImageTransformer.from_diffusers(stock, FastTransformerConfig(fp8=True))
    inputs = make_inputs(stock, "edit" if zero_cond_t else "square", device="cuda", dtype=torch.bfloat16)
    # a schedule's length: the table's GEMMs have 100 (or 200) rows where a forward's have 2 (or 4)
    steps = torch.linspace(1.0, 0.02, 50, device="cuda", dtype=torch.bfloat16)[:, None].expand(-1, 2).contiguous()
    table = fast.modulation_table(steps)
    eager = []
    for n in (0, 1, 25, 49):  # eager, outside a call: the transformer's own modulation, and its table row
        kwargs = {**inputs, "timestep": steps[n]}
        looked_up = fast(**kwargs, modulation=table[n], return_dict=False)[0]
        assert_close(looked_up, fast(**kwargs, return_dict=False)[0], TABLE_TOL[torch.bfloat16], f"eager, step {n}")
        eager.append((n, kwargs, looked_up))
    runner = Runner()
    with runner.call(fast, CallRecord(), graphs=True, pair_cfg=False, bucket=1) as call:
        for n, kwargs, looked_up in eager:  # the first forward eager, the second captured, the others replayed
            graphed = call.forward("cond", **compute_inputs(kwargs) | {"modulation": table[n]})
            assert torch.equal(graphed, looked_up), f"graph, step {n}"
    assert len(runner.graphs) == 1


@pytest.mark.gpu
def test_low_memory_on_gpu():
    """Pinned host weights, the shared device buffer and graphs across turns; the transformer called directly while
    the text encoder has the GPU is refused, naming what to do."""
    fast = optimize_on_cuda(FastConfig(fp8=True)).to("cuda")  # memory="fast": the components are where .to puts them
    low = optimize_on_cuda(FastConfig(fp8=True, memory="low"))
    assert low._turns.resident is None
    for weight in (low.transformer.transformer_blocks[0].img_mod[1].weight, low.text_encoder.lm_head.weight,
                   low.transformer.transformer_blocks[0].img_fc1.weight_q):
        assert weight.device.type == "cpu" and weight.is_pinned()

    def latents(pipe, **kwargs):
        return pipe(**CFG, height=64, width=64, num_inference_steps=3, output_type="latent",
                    generator=torch.Generator("cuda").manual_seed(0), **kwargs).images

    expected = latents(fast)
    assert torch.equal(latents(low), expected)
    graphs = dict(low.runner.graphs.graphs)
    assert graphs and "cuda_graphs" in low.applied
    assert torch.equal(latents(low), expected)  # text encoder turn, transformer turn: the same graphs replay
    assert low.runner.graphs.graphs == graphs and low._turns.loads == 4
    low.encode_prompt("a cat", device=torch.device("cuda"))
    config = low.transformer.config
    with pytest.raises(RuntimeError, match="take turns with the text encoder"):
        low.transformer(
            hidden_states=torch.zeros(1, 16, config.in_channels, device="cuda", dtype=torch.bfloat16),
            encoder_hidden_states=torch.zeros(1, 4, config.joint_attention_dim, device="cuda", dtype=torch.bfloat16),
            timestep=torch.ones(1, device="cuda"), img_shapes=[[(1, 4, 4)]])


def optimize_on_cuda(config):
    from test_pipeline import stock_pipeline

    from qwen_image_fast import optimize

    return optimize(stock_pipeline().to(torch.bfloat16), config, device="cuda")


def test_an_arena_larger_than_the_buffer_overflows_for_its_turn_only():
    from qwen_image_fast.pipelines.core.runtime.offload import HostArena, TakingTurns

    small = [torch.randn(100), torch.randn(3, 7)]
    large = [torch.randn(50), torch.randn(200), torch.arange(12, dtype=torch.int32)]
    values = [t.clone() for t in small + large]
    turns = TakingTurns({"small": HostArena(small, pin=False), "large": HostArena(large, pin=False)},
                        torch.device("cpu"), main="small")
    turns.use("large")
    arena = turns.arenas["large"]
    assert arena.overflow is not None and turns.buffer.numel() < arena.nbytes
    assert all(torch.equal(t, v) for t, v in zip(small + large, values))
    large[1].mul_(2)  # changed in place during its turn (it sits in the overflow buffer)
    turns.use("small")
    assert arena.overflow is None
    turns.use("large")
    assert torch.equal(large[1], values[3] * 2) and torch.equal(large[2], values[4])
