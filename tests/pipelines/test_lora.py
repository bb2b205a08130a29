"""LoRA on the fast pipeline against the stock QwenImagePipeline with the same LoRA through peft (tiny fp32
components on the CPU, FP8 off: <= 1e-5), for every API path: load before / after optimize, several adapters with
weights, fuse / unfuse, disable / enable, unload, delete, attention_kwargs scale, block and non-block targets."""

import functools
import logging

import pytest
import torch
from helpers import assert_close
from test_pipeline import EXACT, fast_pipeline, stock_pipeline
from test_pipeline import run as run_pipeline

from qwen_image_fast import FastConfig, optimize
from qwen_image_fast.kernels._utils import rel_rms_error
from qwen_image_fast.pipelines.core.model.lora import LoraTargetLinear

pytest.importorskip("peft")

BLOCK = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj",
         "attn.to_out.0", "attn.to_add_out", "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj",
         "txt_mlp.net.2"]  # the Lightning release's 12 targets per block
NON_BLOCK = ["img_in", "txt_in", "proj_out", "norm_out.linear", "time_text_embed.timestep_embedder.linear_1",
             "time_text_embed.timestep_embedder.linear_2"]
TOL = 1e-5


def run(pipe, **kwargs):
    """3 steps of CFG (cond and uncond passes both see the adapters)."""
    return run_pipeline(pipe, **{"prompt": "a red fox in snow", "negative_prompt": "blurry", "true_cfg_scale": 3.0,
                                 **kwargs})


@functools.cache
def linear_shapes() -> dict[str, tuple[int, int]]:
    return {n: (m.in_features, m.out_features) for n, m in stock_pipeline().transformer.named_modules()
            if isinstance(m, torch.nn.Linear)}


def lightning_format(targets, rank=4, alpha=2.0, seed=0, std=0.6, shapes=None) -> dict[str, torch.Tensor]:
    """A random LoRA in lightx2v's key format (`{module}.lora_down.weight`, `.lora_up.weight`, `.alpha`), which
    diffusers' Qwen-Image loader converts, folding alpha / rank into the factors. shapes: module name -> (in, out)
    features (default: the tiny 2512 transformer's linears)."""
    shapes = shapes or linear_shapes()
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name in targets:
        k, n = shapes[name]
        sd[f"{name}.lora_down.weight"] = torch.randn(rank, k, generator=g) * std / k**0.5
        sd[f"{name}.lora_up.weight"] = torch.randn(n, rank, generator=g) * std
        sd[f"{name}.alpha"] = torch.tensor(alpha)
    return sd


def diffusers_format(targets, rank=3, seed=1, std=0.3, shapes=None) -> dict[str, torch.Tensor]:
    """peft / diffusers keys (`transformer.{module}.lora_A.weight`, `.lora_B.weight`), no alpha (scale 1)."""
    sd = lightning_format(targets, rank, seed=seed, std=std, shapes=shapes)
    return {f"transformer.{k.replace('lora_down', 'lora_A').replace('lora_up', 'lora_B')}": v
            for k, v in sd.items() if not k.endswith(".alpha")}


def blocks(*names, layers=(0, 1)):
    return [f"transformer_blocks.{i}.{n}" for i in layers for n in names]


LORA_A = blocks(*BLOCK)
LORA_B = blocks("attn.to_q", "attn.add_v_proj", "img_mod.1", "txt_mlp.net.2", layers=(1,)) + NON_BLOCK


def pair():
    return stock_pipeline(), fast_pipeline()


def same(fast, stock, what, **kwargs):
    out, ref = run(fast, **kwargs), run(stock, **kwargs)
    assert_close(out, ref, TOL, what)
    return out


@pytest.fixture(scope="module")
def no_lora():
    return run(fast_pipeline())


def test_load_after_optimize_matches_stock(no_lora):
    stock, fast = pair()
    for pipe in (stock, fast):
        pipe.load_lora_weights(lightning_format(LORA_A), adapter_name="lightning")
    out = same(fast, stock, "Lightning-format LoRA on every block linear")
    assert rel_rms_error(out, no_lora) > 1e-2, "the LoRA must change the output for this test to mean anything"
    assert fast.get_active_adapters() == stock.get_active_adapters() == ["lightning"]
    assert fast.get_list_adapters() == stock.get_list_adapters()


def test_per_layer_alpha_reaches_the_math():
    outs = []
    for alpha in (2.0, 8.0):
        stock, fast = pair()
        for pipe in (stock, fast):
            pipe.load_lora_weights(lightning_format(LORA_A, alpha=alpha))
        outs.append(same(fast, stock, f"alpha {alpha}"))
    assert rel_rms_error(outs[0], outs[1]) > 1e-2


def test_lora_a_lora_b_keys_with_alpha():
    """The key form with peft's factor names and a per-layer alpha (`{module}.lora_A.weight`, `.lora_B.weight`,
    `.alpha`, no prefix), which diffusers' Qwen loader also converts: alpha 2 and 8 both match stock."""
    outs = []
    for alpha in (2.0, 8.0):
        sd = {k.replace("lora_down", "lora_A").replace("lora_up", "lora_B"): v
              for k, v in lightning_format(LORA_A, alpha=alpha).items()}
        stock, fast = pair()
        for pipe in (stock, fast):
            pipe.load_lora_weights(dict(sd))
        outs.append(same(fast, stock, f"lora_A / lora_B keys, alpha {alpha}"))
    assert rel_rms_error(outs[0], outs[1]) > 1e-2


def test_load_before_optimize_is_carried_over():
    stock = stock_pipeline()
    stock.load_lora_weights(lightning_format(LORA_A), adapter_name="a")
    stock.load_lora_weights(diffusers_format(LORA_B), adapter_name="b")
    stock.set_adapters(["a", "b"], [0.7, -0.4])
    ref = run(stock)
    fast = optimize(stock_pipeline(), EXACT)
    fast.load_lora_weights(lightning_format(LORA_A), adapter_name="a")
    fast.load_lora_weights(diffusers_format(LORA_B), adapter_name="b")
    fast.set_adapters(["a", "b"], [0.7, -0.4])
    assert_close(run(fast), ref, TOL, "loaded after optimize")
    carried = optimize(stock, EXACT)  # the LoRA'd stock pipeline itself, converted
    assert carried.get_active_adapters() == ["a", "b"]
    assert_close(run(carried), ref, TOL, "carried over by optimize()")


def test_two_adapters_weights_disable_enable_delete(no_lora):
    stock, fast = pair()
    for pipe in (stock, fast):
        pipe.load_lora_weights(lightning_format(LORA_A), adapter_name="a")
        pipe.load_lora_weights(diffusers_format(LORA_B), adapter_name="b")
    same(fast, stock, "the last loaded adapter is the active one")
    for pipe in (stock, fast):
        pipe.set_adapters(["a", "b"], [0.5, 1.5])
    same(fast, stock, "two adapters with weights")
    for pipe in (stock, fast):
        pipe.disable_lora()
    assert torch.equal(run(fast), no_lora), "disabled: exactly the LoRA-free output"
    for pipe in (stock, fast):
        pipe.enable_lora()
    same(fast, stock, "enabled again")
    for pipe in (stock, fast):
        pipe.delete_adapters("b")
    assert fast.get_list_adapters() == stock.get_list_adapters() == {"transformer": ["a"]}
    same(fast, stock, "after deleting b")


def test_prefix_none_default_weights_and_safe_fusing():
    """transformer.load_lora_adapter(prefix=None) with unprefixed peft keys; set_adapters(names) without weights
    (1.0 each); transformer.set_adapter; fuse_lora(safe_fusing=True) refusing a LoRA with NaNs, as stock does."""
    stock, fast = pair()
    unprefixed = {k.removeprefix("transformer."): v for k, v in diffusers_format(LORA_B).items()}
    for pipe in (stock, fast):
        pipe.transformer.load_lora_adapter(dict(unprefixed), prefix=None, adapter_name="b")
        pipe.load_lora_weights(lightning_format(LORA_A), adapter_name="a")
        pipe.set_adapters(["a", "b"])
    same(fast, stock, "prefix=None, then set_adapters(names) at weight 1.0 each")
    for pipe in (stock, fast):
        pipe.set_adapters(["a", "b"], [0.5, 1.5])
        pipe.transformer.set_adapter("b")  # the active set changes; b keeps its weight
    same(fast, stock, "transformer.set_adapter after set_adapters with weights")
    broken = lightning_format(LORA_A[:2])
    broken[f"{LORA_A[0]}.lora_up.weight"][0, 0] = float("nan")
    for pipe in (stock, fast):
        pipe.load_lora_weights(broken, adapter_name="nan")
        with pytest.raises(ValueError, match="NaN"):
            pipe.fuse_lora(safe_fusing=True, adapter_names=["nan"])


def test_attention_kwargs_scale():
    stock, fast = pair()
    for pipe in (stock, fast):
        pipe.load_lora_weights(lightning_format(LORA_A))
    same(fast, stock, "attention_kwargs scale 0.3", attention_kwargs={"scale": 0.3})
    same(fast, stock, "scale applies to one call only")
    same(fast, stock, "other keys: ignored by both (diffusers warns)", attention_kwargs={"scale": 0.3, "foo": 1})


def test_fuse_unfuse_unload(no_lora):
    stock, fast = pair()
    for pipe in (stock, fast):
        pipe.load_lora_weights(lightning_format(LORA_A), adapter_name="a")
        pipe.load_lora_weights(diffusers_format(LORA_B), adapter_name="b")
        pipe.set_adapters(["a", "b"], [1.0, 0.6])
        pipe.fuse_lora(lora_scale=0.5)
    assert fast.num_fused_loras == stock.num_fused_loras == 2
    same(fast, stock, "fused at lora_scale 0.5")
    same(fast, stock, "fused: attention_kwargs scale has no effect", attention_kwargs={"scale": 3.0})
    for pipe in (stock, fast):
        pipe.unfuse_lora()
    same(fast, stock, "unfused (peft keeps lora_scale on the scaling)")
    fast.unload_lora_weights()
    assert torch.equal(run(fast), no_lora), "unload restores the LoRA-free output exactly"
    assert fast.get_list_adapters() == {}


def test_fuse_twice_and_fuse_while_disabled_as_stock(no_lora):
    """A second fuse_lora fuses nothing more (peft merges an adapter once); fuse_lora while disabled leaves
    nothing fused (peft merges, and the disabled layer's next forward unmerges): enabled again, the LoRA runs
    unfused, as on stock."""
    stock, fast = pair()
    for pipe in (stock, fast):
        pipe.load_lora_weights(lightning_format(LORA_A), adapter_name="a")
        pipe.fuse_lora()
        pipe.fuse_lora()
    same(fast, stock, "fused twice")
    stock, fast = pair()
    for pipe in (stock, fast):
        pipe.load_lora_weights(lightning_format(LORA_A), adapter_name="a")
        pipe.disable_lora()
        pipe.fuse_lora(lora_scale=0.5)
    assert torch.equal(run(fast), no_lora) and not fast.transformer.fused_adapters
    assert_close(run(stock), no_lora, TOL, "stock disabled after a fuse")
    for pipe in (stock, fast):
        pipe.enable_lora()
    same(fast, stock, "enabled again: the LoRA at lora_scale 0.5, unfused")


def test_what_peft_would_do_differently_is_refused():
    """set_adapters changing a fused adapter's scaling (peft would unmerge at the new one, leaving the difference
    in the weights) and a delete_adapters after which peft would activate different adapters in different layers
    (the fast transformer has one active set) are refused with what to do instead."""
    fast = fast_pipeline()
    fast.load_lora_weights(lightning_format(LORA_A), adapter_name="a")
    fast.fuse_lora()
    fast.set_adapters(["a"], [1.0])  # the same scaling: allowed
    with pytest.raises(ValueError, match=r"scaling of the fused adapter\(s\) \['a'\]: unfuse_lora\(\) first"):
        fast.set_adapters(["a"], [0.3])
    fast.unfuse_lora()
    fast.load_lora_weights(diffusers_format(NON_BLOCK), adapter_name="c")  # other layers than a's
    fast.load_lora_weights(diffusers_format(LORA_B), adapter_name="b")
    with pytest.raises(NotImplementedError, match="peft would activate the first remaining one of each layer"):
        fast.delete_adapters("b")
    fast.set_adapters(["a", "c"])
    fast.delete_adapters("b")
    assert fast.get_active_adapters() == ["a", "c"]


def test_fuse_named_adapters_only():
    stock, fast = pair()
    for pipe in (stock, fast):
        pipe.load_lora_weights(lightning_format(LORA_A), adapter_name="a")
        pipe.load_lora_weights(diffusers_format(LORA_B), adapter_name="b")
        pipe.set_adapters(["a", "b"], [0.8, 1.2])
        pipe.fuse_lora(adapter_names=["b"])
    assert fast.num_fused_loras == stock.num_fused_loras == 1
    same(fast, stock, "b fused: a layer holding it runs only b (peft), the others still run a")


def test_unload_of_a_fused_adapter_is_refused():
    fast = fast_pipeline()
    fast.load_lora_weights(lightning_format(LORA_A))
    fast.fuse_lora()
    with pytest.raises(NotImplementedError, match="unfuse_lora"):
        fast.unload_lora_weights()


def test_fp8_lora_error_is_that_of_fp8():
    stock = stock_pipeline()
    fp8 = fast_pipeline(FastConfig())
    plain = fast_pipeline(FastConfig())
    ref_plain = run(stock)
    for pipe in (stock, fp8):
        pipe.load_lora_weights(lightning_format(LORA_A + LORA_B))
    err_lora, err_plain = rel_rms_error(run(fp8), run(stock)), rel_rms_error(run(plain), ref_plain)
    assert err_lora < 1.5 * err_plain + 1e-3, (err_lora, err_plain)


def test_fp8_fuse_folds_into_the_weights_and_unfuse_restores_them_bit_exactly():
    """FP8: fuse_lora requantizes the block linears with the adapters in (no low-rank work left there), within the
    FP8 bound of stock's fuse; a second fuse_lora folds both from the original weights; disable_lora and unfuse_lora
    restore the weights and the unfused output bit for bit."""
    stock, fp8 = stock_pipeline(), fast_pipeline(FastConfig())
    for pipe in (stock, fp8):
        pipe.load_lora_weights(lightning_format(LORA_A), adapter_name="a")
        pipe.load_lora_weights(diffusers_format(LORA_B), adapter_name="b")
        pipe.set_adapters(["a", "b"], [1.0, 0.6])
    qkv = fp8.transformer.transformer_blocks[1].img_qkv
    before = qkv.weight_q.clone(), qkv.weight_scale.clone()
    unfused = run(fp8)
    stock.fuse_lora()
    fp8.fuse_lora(adapter_names=["a"])
    fp8.fuse_lora(adapter_names=["b"])
    assert qkv.lora.folded and not any(qkv.lora.in_effect(site) for site in qkv.lora.sites)
    two_fuses = qkv.weight_q.clone()
    err_fused, err_unfused = rel_rms_error(run(fp8), run(stock)), rel_rms_error(unfused, run(stock))
    assert err_fused < 1.5 * err_unfused + 1e-3, (err_fused, err_unfused)
    fp8.unfuse_lora()
    assert torch.equal(qkv.weight_q.view(torch.uint8), before[0].view(torch.uint8))
    assert torch.equal(qkv.weight_scale, before[1]) and not qkv.lora.folded
    assert torch.equal(run(fp8), unfused), "unfuse restores the unfused output exactly"
    fp8.fuse_lora()
    assert torch.equal(qkv.weight_q.view(torch.uint8), two_fuses.view(torch.uint8)), "one fuse of a and b = two"
    fp8.disable_lora()
    assert torch.equal(qkv.weight_q.view(torch.uint8), before[0].view(torch.uint8)), "disable unfuses (peft)"


def test_fp8_fuse_requantizes_from_the_checkpoints_bf16_weights(tmp_path):
    """A pipeline loaded from an upstream checkpoint folds from the stored weights (one e4m3 rounding of the merged
    weight), each checked to quantize to the model's FP8 weight; a weight that no longer does falls back to the
    dequantized FP8 weight."""
    from qwen_image_fast import QwenImageFastPipeline
    from qwen_image_fast.kernels.fp8 import quantize_fp8_rowwise_ref

    stock = stock_pipeline()
    stock.save_pretrained(tmp_path)
    fast = QwenImageFastPipeline.from_pretrained(tmp_path, fast_config=FastConfig(), dtype=torch.float32)
    assert fast.transformer.weight_source is not None
    fast.load_lora_weights(lightning_format(LORA_A))
    attn = stock.transformer.transformer_blocks[1].attn
    master = torch.cat([attn.to_q.weight, attn.to_k.weight, attn.to_v.weight]).float()
    qkv = fast.transformer.transformer_blocks[1].img_qkv
    fast.fuse_lora()
    expected = quantize_fp8_rowwise_ref(master + qkv.lora.frozen_delta(qkv.out_features))
    assert torch.equal(qkv.weight_q.view(torch.uint8), expected[0].view(torch.uint8))

    fast.unfuse_lora()
    qkv.weight_q[0, 0] = -qkv.weight_q[0, 0].float()  # the model no longer matches its checkpoint
    dequantized = qkv.weight_q.float() * qkv.weight_scale[:, None]
    fast.fuse_lora()
    expected = quantize_fp8_rowwise_ref(dequantized + qkv.lora.frozen_delta(qkv.out_features))
    assert torch.equal(qkv.weight_q.view(torch.uint8), expected[0].view(torch.uint8))


def test_readme_lightning_recipe_matches_stock(tmp_path):
    """README's three lines on a saved tiny checkpoint (FP8 off): the Lightning scheduler through from_pretrained,
    a LoRA file in a folder by weight_name, fuse_lora, 8 steps without CFG; against stock with the same."""
    from safetensors.torch import save_file

    from qwen_image_fast import QwenImageFastPipeline, lightning_scheduler

    stock = stock_pipeline()
    stock.save_pretrained(tmp_path / "model")
    (tmp_path / "lora").mkdir()
    save_file(lightning_format(LORA_A), tmp_path / "lora" / "lightning-8steps.safetensors")
    pipe = QwenImageFastPipeline.from_pretrained(tmp_path / "model", scheduler=lightning_scheduler(),
                                                 fast_config=EXACT, dtype=torch.float32)
    pipe.load_lora_weights(tmp_path / "lora", weight_name="lightning-8steps.safetensors"); pipe.fuse_lora()
    stock.scheduler = lightning_scheduler()
    stock.load_lora_weights(tmp_path / "lora", weight_name="lightning-8steps.safetensors"); stock.fuse_lora()
    case = dict(prompt="a red fox in snow", num_inference_steps=8, true_cfg_scale=1.0)
    assert_close(run_pipeline(pipe, **case), run_pipeline(stock, **case), TOL, "README's Lightning recipe")


def test_graphs_state_changes_with_adapters():
    fast = fast_pipeline()
    fast.load_lora_weights(lightning_format(LORA_A))
    version = fast.transformer.lora_state.version
    fast.set_adapters(["default_0"], [0.5])
    assert fast.transformer.lora_state.version > version


def test_conversion_refuses_fused_adapters_still_loaded():
    stock = stock_pipeline()
    stock.load_lora_weights(lightning_format(LORA_A))
    stock.fuse_lora()
    with pytest.raises(ValueError, match="unload_lora_weights"):
        optimize(stock, EXACT)


def test_fused_then_unloaded_stock_converts_with_the_fused_weights():
    stock = stock_pipeline()
    stock.load_lora_weights(lightning_format(LORA_A))
    stock.fuse_lora()
    stock.unload_lora_weights()
    ref = run(stock)
    assert_close(run(optimize(stock, EXACT)), ref, TOL, "fused LoRA baked into the converted weights")


def test_lora_naming_a_module_the_model_lacks_is_refused():
    fast = fast_pipeline()
    sd = lightning_format(LORA_A)
    sd["transformer_blocks.7.attn.to_q.lora_down.weight"] = sd["transformer_blocks.0.attn.to_q.lora_down.weight"]
    sd["transformer_blocks.7.attn.to_q.lora_up.weight"] = sd["transformer_blocks.0.attn.to_q.lora_up.weight"]
    with pytest.raises(ValueError, match="transformer_blocks.7"):
        fast.load_lora_weights(sd)
    assert fast.get_list_adapters() == {}, "nothing half-loaded"


def test_stock_model_is_untouched_by_the_fast_models_adapters():
    stock = stock_pipeline()
    stock_transformer = stock.transformer
    fast = optimize(stock, EXACT)  # shares the embedders, img_mod / txt_mod, norm_out, proj_out with its source
    fast.load_lora_weights(lightning_format(LORA_B))
    for name in ("img_in", "transformer_blocks.1.img_mod.1", "time_text_embed.timestep_embedder.linear_1"):
        assert type(stock_transformer.get_submodule(name)) is torch.nn.Linear, name
        assert type(fast.transformer.get_submodule(name)) is LoraTargetLinear, name
    fast.unload_lora_weights()
    assert type(fast.transformer.get_submodule("transformer_blocks.1.img_mod.1")) is torch.nn.Linear


def test_save_pretrained_with_adapters_loaded_is_refused(tmp_path):
    fast = fast_pipeline()
    fast.load_lora_weights(lightning_format(LORA_A))
    with pytest.raises(ValueError, match="without them"):
        fast.transformer.save_pretrained(tmp_path / "t")
    assert not (tmp_path / "t").exists()
    with pytest.raises(ValueError, match="without them"):
        fast.save_pretrained(tmp_path / "pipe")
    assert not (tmp_path / "pipe").exists(), "nothing of the pipeline written"


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["model", "group-block", "group-leaf-stream"])
def test_lora_loaded_and_unloaded_under_offload_on_gpu(how):
    """Adapters loaded after offloading (accelerate's hooks come off and back on, as diffusers does; group offload's
    groups are rebuilt to take in the new factors) give what the resident pipeline gives; unloading restores it."""
    from test_pipeline import offload

    case = dict(prompt="a cat", negative_prompt="bad", true_cfg_scale=3.0, height=64, width=64,
                num_inference_steps=3, output_type="latent")

    def latents(pipe):
        return pipe(**case, generator=torch.Generator("cuda").manual_seed(0)).images

    config = FastConfig(fp8=True, cuda_graphs=False)
    resident = optimize(stock_pipeline().to("cuda", torch.bfloat16), config)
    plain = latents(resident)
    resident.load_lora_weights(lightning_format(LORA_A + LORA_B))
    expected = latents(resident)
    pipe = optimize(stock_pipeline().to(torch.bfloat16), config, device="cuda")
    offload(pipe, how)
    pipe.load_lora_weights(lightning_format(LORA_A + LORA_B))
    assert_close(latents(pipe), expected, 1e-6, f"LoRA under {how} offload vs resident")
    pipe.fuse_lora()  # offload hooks: kept low-rank, still exact
    assert_close(latents(pipe), expected, 1e-6, f"fused under {how} offload")
    pipe.unfuse_lora()
    pipe.unload_lora_weights()
    assert_close(latents(pipe), plain, 1e-6, f"unloaded under {how} offload")


@pytest.mark.gpu
def test_graph_replay_follows_the_attention_scale_of_each_call_on_gpu():
    """One graph per attention_kwargs scale (GraphedForward's signature); each keeps reading its own packed factors
    while calls alternate between scales, and agrees with the eager pipeline at that scale."""
    case = dict(prompt="a cat", negative_prompt="bad", true_cfg_scale=3.0, height=64, width=64,
                num_inference_steps=2, output_type="latent")

    def latents(pipe, scale):
        kwargs = {} if scale is None else {"attention_kwargs": {"scale": scale}}
        return pipe(**case, **kwargs, generator=torch.Generator("cuda").manual_seed(0)).images

    eager = optimize(stock_pipeline().to("cuda", torch.bfloat16), FastConfig(cuda_graphs=False))
    graphed = optimize(stock_pipeline().to("cuda", torch.bfloat16), FastConfig())
    for pipe in (eager, graphed):
        pipe.load_lora_weights(lightning_format(LORA_A + LORA_B))
    refs = {scale: latents(eager, scale) for scale in (None, 0.3, 2.0)}
    assert rel_rms_error(refs[0.3], refs[None]) > 0.05 and rel_rms_error(refs[2.0], refs[None]) > 0.05
    for scale in (None, 0.3, None, 2.0, 0.3, None):
        out = latents(graphed, scale)
        assert "cuda_graphs" in graphed.applied
        assert rel_rms_error(out, refs[scale]) < 1e-2, (scale, rel_rms_error(out, refs[scale]))


def test_no_lora_keys_for_the_prefix_warns_on_diffusers_logger(caplog):
    """A state dict with no key under the transformer's prefix loads nothing and warns, on diffusers' own
    `diffusers.loaders.peft` logger as stock does (diffusers' LoRA tests and users' verbosity settings look there)."""
    stock, fast = pair()
    text_encoder_only = {"text_encoder.layers.0.q_proj.lora_A.weight": torch.zeros(2, 4)}
    for pipe in (stock, fast):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="diffusers.loaders.peft"):
            pipe.transformer.load_lora_adapter(dict(text_encoder_only), prefix="transformer", adapter_name="x")
        warned = [r for r in caplog.records if r.name == "diffusers.loaders.peft" and "No LoRA keys" in r.message]
        assert len(warned) == 1, (type(pipe.transformer).__name__, [(r.name, r.message) for r in caplog.records])
        assert pipe.get_list_adapters() == {}
