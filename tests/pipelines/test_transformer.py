"""The fast transformer against diffusers' QwenImageTransformer2DModel: BF16 mode exactly (fp32 compute), FP8 mode
against an independent per-row FP8 emulation of the same linears applied to the stock model."""

import copy

import pytest
import torch
import torch.nn as nn
from diffusers import QwenImageTransformer2DModel
from helpers import assert_close

from qwen_image_fast.kernels._utils import rel_rms_error
from qwen_image_fast.kernels.fp8 import dequantize_fp8_rowwise, quantize_fp8_rowwise_ref
from qwen_image_fast.pipelines.core.config import FP8_LINEARS, FastTransformerConfig
from qwen_image_fast.pipelines.qwen_image.model.transformer import FastQwenImageTransformer

IMG_SHAPES = {  # per sample: [(frames, latent h / 2, latent w / 2), condition images...]
    "square": [(1, 4, 4)],
    "wide": [(1, 2, 6)],
    "odd": [(1, 3, 5)],
    "edit": [(1, 4, 4), (1, 2, 2)],  # a condition image: zero_cond_t gives its tokens the t=0 modulation
}


def tiny_stock(zero_cond_t=False, num_layers=2, seed=0, device="cpu", **overrides):
    torch.manual_seed(seed)
    kwargs = dict(
        patch_size=2,
        in_channels=16,  # 64
        out_channels=4,  # 16
        num_layers=num_layers,  # 60
        attention_head_dim=16,  # 128
        num_attention_heads=3,  # 24
        joint_attention_dim=16,  # 3584
        axes_dims_rope=(8, 4, 4),  # (16, 56, 56)
        zero_cond_t=zero_cond_t,
    )
    kwargs.update(overrides)
    model = QwenImageTransformer2DModel(**kwargs).to(device).eval()
    with torch.no_grad():  # non-trivial biases and norm weights, so a dropped one shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def make_inputs(model, shape_name, batch=2, txt_len=7, padded=False, device="cpu", dtype=torch.float32):
    shapes = [IMG_SHAPES[shape_name]] * batch
    img_len = sum(f * h * w for f, h, w in shapes[0])
    cfg = model.config
    x = torch.randn(batch, img_len, cfg.in_channels, device=device, dtype=dtype)
    e = torch.randn(batch, txt_len, cfg.joint_attention_dim, device=device, dtype=dtype)
    t = torch.linspace(0.2, 0.9, batch, device=device, dtype=dtype)
    mask = None
    if padded:  # sample 1 has a shorter prompt: right padding, as the tokenizer and pipeline produce
        mask = torch.ones(batch, txt_len, dtype=torch.long, device=device)
        mask[-1, txt_len // 2 :] = 0
    return dict(hidden_states=x, encoder_hidden_states=e, encoder_hidden_states_mask=mask, timestep=t,
                img_shapes=shapes)


@torch.no_grad()
def run(model, inputs):
    return model(**inputs).sample


@pytest.mark.parametrize("zero_cond_t", [False, True])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("shape_name", ["square", "wide", "odd", "edit"])
def test_bf16_mode_matches_diffusers(zero_cond_t, padded, shape_name):
    stock = tiny_stock(zero_cond_t)
    fast = FastQwenImageTransformer.from_diffusers(stock, FastTransformerConfig(fp8=False))
    inputs = make_inputs(stock, shape_name, padded=padded)
    assert_close(run(fast, inputs), run(stock, inputs), 1e-5, "fast bf16-mode vs diffusers (fp32)")


def test_padded_keys_are_not_attended():
    # Garbage in the padded text positions must not change the output (they are masked as keys).
    stock = tiny_stock()
    fast = FastQwenImageTransformer.from_diffusers(stock, FastTransformerConfig(fp8=False))
    inputs = make_inputs(stock, "square", padded=True)
    out = run(fast, inputs)
    inputs["encoder_hidden_states"][-1, 4:] = torch.randn_like(inputs["encoder_hidden_states"][-1, 4:]) * 100
    assert torch.equal(run(fast, inputs)[-1], out[-1])
    assert_close(out, run(stock, inputs), 1e-5)


def test_left_padded_mask_is_refused():
    stock = tiny_stock()
    fast = FastQwenImageTransformer.from_diffusers(stock, FastTransformerConfig(fp8=False))
    inputs = make_inputs(stock, "square", padded=True)
    inputs["encoder_hidden_states_mask"] = inputs["encoder_hidden_states_mask"].flip(1)
    with pytest.raises(RuntimeError, match="right-padded"):
        run(fast, inputs)


class FakeQuantLinear(nn.Module):
    """Independent FP8 emulation: per-token activation and per-channel weight e4m3 round trips, fp32 matmul."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear = linear

    def forward(self, x):
        q, s = quantize_fp8_rowwise_ref(x.reshape(-1, x.shape[-1]))
        w_q, w_s = quantize_fp8_rowwise_ref(self.linear.weight)
        out = dequantize_fp8_rowwise(q, s) @ dequantize_fp8_rowwise(w_q, w_s).t() + self.linear.bias.float()
        return out.to(x.dtype).view(*x.shape[:-1], -1)


def emulate_fp8(stock, names=FP8_LINEARS):
    model = copy.deepcopy(stock)
    for block in model.transformer_blocks:
        a = block.attn
        slots = {
            "img_qkv": [(a, "to_q"), (a, "to_k"), (a, "to_v")],
            "txt_qkv": [(a, "add_q_proj"), (a, "add_k_proj"), (a, "add_v_proj")],
            "img_out": [(a.to_out, 0)], "txt_out": [(a, "to_add_out")],
            "img_fc1": [(block.img_mlp.net[0], "proj")], "img_fc2": [(block.img_mlp.net, 2)],
            "txt_fc1": [(block.txt_mlp.net[0], "proj")], "txt_fc2": [(block.txt_mlp.net, 2)],
        }
        for name in names:
            for parent, key in slots[name]:
                if isinstance(key, int):
                    parent[key] = FakeQuantLinear(parent[key])
                else:
                    setattr(parent, key, FakeQuantLinear(getattr(parent, key)))
    return model


@pytest.mark.parametrize("zero_cond_t,padded", [(False, False), (False, True), (True, True)])
def test_fp8_mode_no_worse_than_emulation(zero_cond_t, padded):
    stock = tiny_stock(zero_cond_t, num_layers=3)
    fast = FastQwenImageTransformer.from_diffusers(stock, FastTransformerConfig(fp8=True))
    inputs = make_inputs(stock, "edit" if zero_cond_t else "square", padded=padded)
    ref = run(stock, inputs)
    ours, emulated = run(fast, inputs), run(emulate_fp8(stock), inputs)
    err_ours, err_emulated = rel_rms_error(ours, ref), rel_rms_error(emulated, ref)
    assert 1e-3 < err_emulated < 0.2, err_emulated  # FP8 really changed something, and not everything
    assert err_ours <= err_emulated * 1.02, (err_ours, err_emulated)
    assert rel_rms_error(ours, emulated) < 0.25 * err_emulated  # the same function, up to fp32 rounding


def test_policy_keeps_named_linears_in_bf16():
    stock = tiny_stock(num_layers=3)
    config = FastTransformerConfig(fp8=True, bf16_linears=("img_fc2", "txt_out"))
    fast = FastQwenImageTransformer.from_diffusers(stock, config)
    for blk in fast.transformer_blocks:
        assert {name: getattr(blk, name).fp8 for name in FP8_LINEARS} == {
            name: name not in ("img_fc2", "txt_out") for name in FP8_LINEARS}
    inputs = make_inputs(stock, "square", padded=True)
    ref = run(stock, inputs)
    err = rel_rms_error(run(fast, inputs), ref)
    err_emulated = rel_rms_error(run(emulate_fp8(stock, [n for n in FP8_LINEARS if n not in config.bf16_linears]),
                                     inputs), ref)
    assert err <= err_emulated * 1.02, (err, err_emulated)


def test_config_validation():
    with pytest.raises(ValueError, match=r"bf16_linears=\['img_mlp'\]; allowed: img_qkv"):
        FastTransformerConfig(bf16_linears=("img_mlp",))
    with pytest.raises(ValueError, match="attention='flash'; allowed: auto, fa4, cudnn, sdpa"):
        FastTransformerConfig(attention="flash")
    stock = tiny_stock(num_layers=1)
    with pytest.raises(ValueError, match="attention='fa4' needs a CUDA device"):
        FastQwenImageTransformer.from_diffusers(stock, FastTransformerConfig(attention="fa4"))


def test_stock_model_unchanged_and_usable():
    stock = tiny_stock()
    inputs = make_inputs(stock, "square")
    before = run(stock, inputs)
    state = {k: v.clone() for k, v in stock.state_dict().items()}
    FastQwenImageTransformer.from_diffusers(stock, FastTransformerConfig(fp8=True))
    assert all(torch.equal(state[k], v) for k, v in stock.state_dict().items())
    assert torch.equal(run(stock, inputs), before)


def test_forward_signature_and_output_match_diffusers():
    import inspect

    stock = tiny_stock(num_layers=1)
    fast = FastQwenImageTransformer.from_diffusers(stock, FastTransformerConfig(fp8=False))
    ours = list(inspect.signature(fast.forward).parameters)
    upstream = list(inspect.signature(QwenImageTransformer2DModel.forward).parameters)[1:]
    assert ours == upstream + ["modulation"]  # ours adds one keyword, last: a row of modulation_table()
    inputs = make_inputs(stock, "square")
    out = fast(**inputs, return_dict=False)
    assert isinstance(out, tuple) and out[0].shape == (2, 16, 16)


def real_width_stock(num_layers: int = 2) -> QwenImageTransformer2DModel:
    """diffusers' transformer at the real widths, `num_layers` blocks, bf16 on the GPU, its 2-D weights normal(0,
    0.02) (seed 0)."""
    stock = QwenImageTransformer2DModel(num_layers=num_layers).to("cuda", torch.bfloat16).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in stock.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.02)
    return stock


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_real_width_on_gpu(fp8, padded):
    """Real widths (3072 = 24 x 128, MLP 12288, text 3584), 2 blocks, 1024x1024 latents (4096 tokens), bf16."""
    stock = real_width_stock()
    fast = FastQwenImageTransformer.from_diffusers(stock, FastTransformerConfig(fp8=fp8))
    batch, txt_len = 2, 218
    inputs = dict(
        hidden_states=torch.randn(batch, 4096, 64, device="cuda", dtype=torch.bfloat16),
        encoder_hidden_states=torch.randn(batch, txt_len, 3584, device="cuda", dtype=torch.bfloat16),
        encoder_hidden_states_mask=None, timestep=torch.tensor([0.5, 0.5], device="cuda", dtype=torch.bfloat16),
        img_shapes=[[(1, 64, 64)]] * batch,
    )
    if padded:
        inputs["encoder_hidden_states_mask"] = torch.ones(batch, txt_len, dtype=torch.long, device="cuda")
        inputs["encoder_hidden_states_mask"][1, 150:] = 0
    ref32 = run(stock.float(), {k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v
                                for k, v in inputs.items()})
    stock.to(torch.bfloat16)
    ref = run(stock, inputs)
    err_stock_bf16 = rel_rms_error(ref, ref32)
    err = rel_rms_error(run(fast, inputs), ref32)
    if fp8:
        err_emulated = rel_rms_error(run(emulate_fp8(stock), inputs), ref32)
        assert err <= err_emulated * 1.1, (err, err_emulated)
    else:
        assert err <= 2 * err_stock_bf16 + 1e-3, (err, err_stock_bf16)


def compute_inputs(inputs: dict) -> dict:
    """make_inputs' forward arguments as FastQwenImageTransformer.compute takes them (what the runner passes)."""
    return dict(guidance=None, controlnet_block_samples=None, additional_t_cond=None, modulation=None) | inputs


@pytest.mark.gpu
def test_cuda_graph_replay_matches_eager():
    """The runner's policy on the real CUDA graphs: a signature's first forward eager, its second captured, later
    ones replayed, each equal to the eager forward of its own inputs."""
    from qwen_image_fast.pipelines.core.optimizations import CallRecord
    from qwen_image_fast.pipelines.core.runtime.runner import Runner

    stock = tiny_stock(num_layers=2, device="cuda", num_attention_heads=4, attention_head_dim=32,
                       axes_dims_rope=(8, 12, 12))  # the rotary axes must add up to the head dim
    fast = FastQwenImageTransformer.from_diffusers(stock.to(torch.bfloat16), FastTransformerConfig(fp8=True))
    runner, record = Runner(), CallRecord()
    with runner.call(fast, record, graphs=True, pair_cfg=False, bucket=1) as call:
        for padded in (False, True):
            for _ in range(3):
                inputs = make_inputs(stock, "square", padded=padded, device="cuda", dtype=torch.bfloat16)
                assert_close(call.forward("cond", **compute_inputs(inputs)), run(fast, inputs), 1e-6, "vs eager")
    assert len(runner.graphs) == 2 and "cuda_graphs" in record.labels()  # one per signature (mask / no mask)


def test_auto_attention_never_picks_fa4_for_fp32(monkeypatch):
    from qwen_image_fast.pipelines.core.model import attention

    monkeypatch.setattr(attention, "fa4_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda")
    assert attention.resolve_backend("auto", cuda, torch.bfloat16) == "fa4"
    assert attention.resolve_backend("auto", cuda, torch.float32) == "cudnn"  # FA4 takes fp16/bf16 only
    with pytest.raises(ValueError, match="attention='fa4' needs a float16/bfloat16 model, this one is torch.float32"):
        attention.resolve_backend("fa4", cuda, torch.float32)


# ---- the drop-in contract: a diffusers model like the stock one


def test_config_is_the_stock_config_plus_how_linears_are_stored():
    stock = tiny_stock(zero_cond_t=True)
    fast = FastQwenImageTransformer.from_diffusers(stock, FastTransformerConfig(fp8=True, bf16_linears=("img_fc2",)))
    stock_keys = [k for k in stock.config if not k.startswith("_")]
    assert {k: fast.config[k] for k in stock_keys} == {k: stock.config[k] for k in stock_keys}
    assert set(fast.config) - set(stock.config) == {"fast_config"}
    assert fast.config.fast_config == {"fp8": True, "bf16_linears": ["img_fc2"], "fp8_fast_accum": True,
                                       "attention": "auto", "fp8_attention": "off"}
    assert fast.dtype == torch.float32 and fast.device == torch.device("cpu")


@pytest.mark.parametrize("fp8", [False, True])
def test_every_weight_is_registered(fp8):
    # .to(device), state_dict() and offload hooks only see parameters and buffers: no weight may be a plain attribute
    fast = FastQwenImageTransformer.from_diffusers(tiny_stock(), FastTransformerConfig(fp8=fp8))
    registered = {id(t) for t in (*fast.parameters(), *fast.buffers())}
    for name, module in fast.named_modules():
        if module is fast.pos_embed:
            continue  # rotary tables, computed (diffusers keeps them unregistered too)
        loose = [k for k, v in vars(module).items() if isinstance(v, torch.Tensor) and id(v) not in registered]
        assert not loose, (name, loose)
    fast.to("meta")
    assert all(t.device.type == "meta" for t in (*fast.parameters(), *fast.buffers()))
    keys = fast.state_dict().keys()
    assert "transformer_blocks.0.norm_added_k" in keys and "transformer_blocks.1.img_mod.1.weight" in keys
    assert ("transformer_blocks.0.img_qkv.weight_q" in keys) == fp8


def test_non_block_weights_keep_the_stock_state_dict_keys():
    stock = tiny_stock()
    fast = FastQwenImageTransformer.from_diffusers(stock, FastTransformerConfig(fp8=True)).state_dict()
    for key, value in stock.state_dict().items():
        if not key.startswith("transformer_blocks.") or ".img_mod." in key or ".txt_mod." in key:
            assert torch.equal(fast[key], value), key


@pytest.mark.parametrize("cast", ["to", "half", "bfloat16"])
def test_dtype_cast_keeps_fp8_weights_and_scales(cast):
    stock = tiny_stock()
    fast = FastQwenImageTransformer.from_diffusers(copy.deepcopy(stock), FastTransformerConfig(fp8=True))
    fp8 = {k: v.clone() for k, v in fast.state_dict().items() if k.endswith(("weight_q", "weight_scale"))}
    dtype = torch.float16 if cast == "half" else torch.bfloat16
    fast = fast.to(dtype) if cast == "to" else getattr(fast, cast)()
    state = fast.state_dict()
    assert fp8 and all(torch.equal(state[k], v) and state[k].dtype == v.dtype for k, v in fp8.items())
    assert {v.dtype for k, v in state.items() if k not in fp8} == {dtype}
    assert fast.dtype == dtype
    inputs = make_inputs(stock, "square", dtype=dtype)
    out = run(fast, inputs)
    assert out.dtype == dtype
    err = rel_rms_error(out.float(), run(stock, {k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v
                                                for k, v in inputs.items()}))
    assert err < 0.1, err


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("zero_cond_t", [False, True])
def test_controlnet_residuals_added_as_diffusers_adds_them(fp8, zero_cond_t):
    stock = tiny_stock(zero_cond_t, num_layers=3)
    fast = FastQwenImageTransformer.from_diffusers(stock, FastTransformerConfig(fp8=fp8))
    inputs = make_inputs(stock, "edit" if zero_cond_t else "wide", padded=True)
    img_len = inputs["hidden_states"].shape[1]
    torch.manual_seed(1)
    inputs["controlnet_block_samples"] = [torch.randn(2, img_len, 48) for _ in range(2)]  # interval 2: blocks 0-1, 2
    ref = run(stock, inputs)
    assert rel_rms_error(ref, run(stock, {**inputs, "controlnet_block_samples": None})) > 0.05  # they matter
    if fp8:
        err, err_emulated = rel_rms_error(run(fast, inputs), ref), rel_rms_error(run(emulate_fp8(stock), inputs), ref)
        assert err <= err_emulated * 1.02, (err, err_emulated)
    else:
        assert_close(run(fast, inputs), ref, 1e-5, "controlnet, bf16 mode (fp32)")


def test_additional_t_cond_and_layer3d_rope_match_diffusers():
    # QwenImageLayeredPipeline's transformer: an embedding of additional_t_cond added to the timestep's, 3-D RoPE
    stock = tiny_stock(use_additional_t_cond=True, use_layer3d_rope=True)
    fast = FastQwenImageTransformer.from_diffusers(stock, FastTransformerConfig(fp8=False))
    inputs = make_inputs(stock, "square")
    inputs["img_shapes"] = [[(1, 2, 2), (1, 2, 2), (1, 2, 2), (1, 2, 2)]] * 2  # layers of one image
    inputs["additional_t_cond"] = torch.tensor([0, 1])
    assert_close(run(fast, inputs), run(stock, inputs), 1e-5, "additional_t_cond + layer3d rope")


def test_guidance_fails_as_in_diffusers():
    # diffusers 0.42's QwenTimestepProjEmbeddings takes no guidance: the stock model raises TypeError; so does ours
    stock = tiny_stock(num_layers=1)
    fast = FastQwenImageTransformer.from_diffusers(stock, FastTransformerConfig(fp8=False))
    inputs = dict(make_inputs(stock, "square"), guidance=torch.tensor([3.5, 3.5]))
    for model in (stock, fast):
        with pytest.raises(TypeError):
            run(model, inputs)


def test_the_constructors_name_an_unknown_config_field():
    """Both fast transformers' constructors (core/config.py transformer_configs): a field their stock model does not
    have is a TypeError naming it and the model, as the stock constructor's would be one; an unknown fast option a
    ValueError naming the allowed ones."""
    from qwen_image_fast.pipelines.qwen_image21.model import FastQwenImage21Transformer

    for cls, stock in ((FastQwenImageTransformer, "QwenImageTransformer2DModel"),
                       (FastQwenImage21Transformer, "QwenImage21Transformer2DModel")):
        with torch.device("meta"):
            with pytest.raises(TypeError, match=rf"unknown {stock} config field\(s\) \['not_a_field'\]"):
                cls(not_a_field=1)
            with pytest.raises(ValueError, match=r"unknown FastTransformerConfig field\(s\) \['fp9'\]; allowed: fp8"):
                cls({"fp9": True})
            assert cls(num_layers=1).config.num_layers == 1


def test_cache_context_and_methods_it_cannot_honour():
    fast = FastQwenImageTransformer.from_diffusers(tiny_stock(num_layers=1), FastTransformerConfig(fp8=False))
    with fast.cache_context("cond"):  # diffusers pipelines wrap every forward in it
        pass
    calls = {
        "set_attention_backend": ("flash",), "enable_gradient_checkpointing": (),
        "compile_repeated_blocks": (), "fuse_qkv_projections": (), "enable_layerwise_casting": (),
        "add_adapter": (None,), "save_lora_adapter": ("x",), "enable_lora_hotswap": (),
        "enable_xformers_memory_efficient_attention": (),
    }
    for name, args in calls.items():
        with pytest.raises(NotImplementedError, match=f"FastQwenImageTransformer.{name}: .+"):
            getattr(fast, name)(*args)
    with pytest.raises(NotImplementedError, match="FastConfig\\(attention=...\\)"):
        fast.attn_processors  # noqa: B018


@pytest.mark.parametrize("fp8", [False, True])
def test_save_pretrained_round_trip_is_bit_exact(tmp_path, fp8):
    stock = tiny_stock(zero_cond_t=True)
    config = FastTransformerConfig(fp8=fp8, bf16_linears=("txt_fc2",) if fp8 else ())
    fast = FastQwenImageTransformer.from_diffusers(stock, config)
    fast.save_pretrained(tmp_path, max_shard_size="20KB")  # sharded, as full-size checkpoints are
    assert len(list(tmp_path.glob("*.safetensors"))) > 1 and (tmp_path / "config.json").exists()
    loaded = FastQwenImageTransformer.from_pretrained(tmp_path)
    assert loaded.fast_config == config and loaded.zero_cond_t
    before, after = fast.state_dict(), loaded.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype for k in before)
    inputs = make_inputs(stock, "edit", padded=True)
    assert torch.equal(run(loaded, inputs), run(fast, inputs))


def test_from_pretrained_refuses_what_it_cannot_load(tmp_path):
    stock = tiny_stock(num_layers=1)
    FastQwenImageTransformer.from_diffusers(stock, FastTransformerConfig(fp8=True)).save_pretrained(tmp_path / "fast")
    with pytest.raises(ValueError, match="stores the block linears with fp8=True"):
        FastQwenImageTransformer.from_pretrained(tmp_path / "fast", fast_config=FastTransformerConfig(fp8=False))
    with pytest.raises(ValueError, match="qwen_image_fast.from_pretrained"):  # what diffusers' loader passes
        FastQwenImageTransformer.from_pretrained(tmp_path / "fast", low_cpu_mem_usage=True, device_map=None)
    stock.save_pretrained(tmp_path / "stock")
    with pytest.raises(ValueError, match="holds a QwenImageTransformer2DModel checkpoint.+from_diffusers"):
        FastQwenImageTransformer.from_pretrained(tmp_path / "stock")


def test_float16_clips_as_diffusers_blocks_do():
    """float16: diffusers' block clips both streams to +-65504; the fast one too. The MLPs' gated outputs are
    scaled so that the residual streams pass the range (without the clip they overflow to inf)."""
    stock = tiny_stock(num_layers=2)
    with torch.no_grad():
        for block in stock.transformer_blocks:
            for mlp in (block.img_mlp, block.txt_mlp):
                mlp.net[2].weight.mul_(1e5)
    stock = stock.half()
    fast = FastQwenImageTransformer.from_diffusers(stock, FastTransformerConfig(fp8=False))
    inputs = make_inputs(stock, "square", dtype=torch.float16)
    ref, out = run(stock, inputs).float(), run(fast, inputs).float()
    assert torch.isfinite(ref).all() and torch.isfinite(out).all()
    assert_close(out, ref, 2e-2, "float16")
