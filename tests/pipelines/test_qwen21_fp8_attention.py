"""FastConfig(fp8_attention=...) on Qwen-Image-2.1 (qwen_image21/block.py): the target's queries against its own
keys and the prefix cache's, each set in FP8 with its own v scale, two calls merged by their log-sum-exps.

CPU: fp8_attention_lse_ref stands in for the kernel (FA3; its semantics); the tiny fp32 transformer and pipeline
against stock diffusers within FP8 attention's error (and not equal: it ran), the prefix cache stored in FP8 once
per call and per branch, v's scale from its bound or measured, the refusals. GPU: FA3's two calls merged against
one reference attention over the union at the real head shape; the real-width transformer within the option's
bound of stock, its cached steps in CUDA graphs equal to eager."""

import pytest
import torch
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache
from helpers import assert_close, rel_rms_error

from qwen_image_fast import FastConfig, optimize
from qwen_image_fast.kernels._utils import FP8_DTYPE
from qwen_image_fast.pipelines.core.config import FastTransformerConfig
from qwen_image_fast.pipelines.core.model.fp8_attention import installed
from qwen_image_fast.pipelines.core.optimizations import BY_NAME, plans
from qwen_image_fast.pipelines.qwen_image21 import model as model_module
from qwen_image_fast.pipelines.qwen_image21.block import Fp8Prefix
from qwen_image_fast.pipelines.qwen_image21.model import FastQwenImage21Transformer

from test_qwen21 import CASES, REAL, denoise, inputs, latents, tiny_pipeline, tiny_stock

# FP8 q, k, v on 16-wide heads: measured 0.8e-3 to 1.9e-3 over the cases below (FP8 GEMMs alone: 0.8e-3 to 1.2e-3)
TINY_ERROR = 5e-3


@pytest.fixture
def reference_kernel(monkeypatch):
    """fp8_attention_lse_ref as the model's FP8 kernel on the CPU (the GPU kernel's semantics)."""
    monkeypatch.setattr(model_module, "fp8_attention_kernel", lambda name, device, dtype, kernels: (
        ("reference", None) if name != "off" else (None, None)))


def target_errors(model, stock, args, steps: int = 3, cache: bool = True) -> list[float]:
    target = args["img_shapes"][0][-1][1] * args["img_shapes"][0][-1][2]
    return [rel_rms_error(out[:, -target:], ref[:, -target:])
            for out, ref in zip(denoise(model, args, steps, cache), denoise(stock, args, steps, cache))]


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-gemms", "fp8-gemms"])
@pytest.mark.parametrize("cache", [True, False], ids=["prefix-cache", "no-cache"])
@pytest.mark.parametrize("case", ["t2i-two-lengths", "condition-two-lengths"])
def test_within_its_error_of_stock(reference_kernel, case, cache, fp8):
    """Every step's target rows within FP8 attention's error of stock (fp32), and further from stock than the
    same model without it (it ran); two prompts of different lengths (the prefix's padding counted out of its
    call), a condition image in the prefix; v's scale measured (FP8 GEMMs off) or from its bound (on)."""
    stock = tiny_stock()
    fast = FastQwenImage21Transformer.from_diffusers(stock, FastTransformerConfig(fp8=fp8, fp8_attention="auto"))
    plain = FastQwenImage21Transformer.from_diffusers(stock, FastTransformerConfig(fp8=fp8))
    args = inputs(*CASES[case])
    errors, plain_errors = target_errors(fast, stock, args, cache=cache), target_errors(plain, stock, args, cache=cache)
    assert all(e <= TINY_ERROR for e in errors), errors
    assert all(e > p + 2e-4 for e, p in zip(errors, plain_errors)), (errors, plain_errors)
    assert ("fp8_attention", "reference") in fast.running()


def test_prefix_stored_once_in_fp8_per_branch(reference_kernel):
    """The prefix cache under FP8 attention: each block its own Fp8Prefix of the prefix's rows only, written at the
    extract step and never by a cached step; two caches (cond, uncond) hold their own, each step within the error
    of stock's with the same caches."""
    stock = tiny_stock()
    fast = FastQwenImage21Transformer.from_diffusers(stock, FastTransformerConfig(fp8=False, fp8_attention="auto"))
    cond, uncond = inputs(1, (7,), None, seed=1), inputs(1, (9,), (2, 4), seed=2)
    t = torch.ones(1)
    outs = {}
    for model in (stock, fast):
        caches = QwenImage21KVCache(2), QwenImage21KVCache(2)
        for args, kv in zip((cond, uncond), caches):
            model(**args, timestep=t, kv_cache=kv, kv_cache_mode="extract")
        if model is fast:
            stores = [fast.prefix_cache.of(kv) for kv in caches]
            assert all(isinstance(s, Fp8Prefix) and s.k8.dtype == FP8_DTYPE for store in stores for s in store)
            assert [store[0].k8.shape[1] for store in stores] == [7, 9 + 8], "the prefix's rows only (text, image)"
            assert not torch.equal(stores[0][0].k8.float(), stores[0][1].k8.float()), "one per block"
            before = [[t.clone() for s in store for t in s] for store in stores]
        outs[model] = [model(**args, timestep=t / 2, kv_cache=kv, kv_cache_mode="cached").sample
                       for _ in range(2) for args, kv in zip((cond, uncond), caches)]
    after = [[t for s in store for t in s] for store in stores]
    assert all(torch.equal(a.float(), b.float()) for x, y in zip(before, after) for a, b in zip(x, y))
    for out, ref in zip(outs[fast], outs[stock]):
        assert 1e-4 < rel_rms_error(out, ref) <= TINY_ERROR


def test_v_scale_from_its_bound_or_measured():
    """FP8 GEMMs: v's scale from the bound over the QKV operand's row scales, which every v of the forward
    stays within; a LoRA on v's rows (or BF16 GEMMs) leaves it to the amax pass."""
    from qwen_image_fast.kernels.fp8 import quantize_fp8_rowwise_ref
    from qwen_image_fast.pipelines.core.model.linear import as_fp8_operand
    from test_lora import diffusers_format

    fast = FastQwenImage21Transformer.from_diffusers(tiny_stock(), FastTransformerConfig(fp8=True))
    block = fast.transformer_blocks[0]
    inner = block.heads * block.head_dim
    rows = torch.randn(50, inner) * torch.logspace(-2, 2, 50)[:, None]
    h = as_fp8_operand(*quantize_fp8_rowwise_ref(rows))
    scale = block.v_fp8_scale(h)
    v = block.qkv(h)[:, 2 * inner:].float()
    assert v.abs().max() <= 448 * scale and v.abs().max() > 448 * scale / 20, (v.abs().max(), 448 * scale)
    assert block.v_fp8_scale(rows) is None  # not an FP8 operand
    site = "transformer_blocks.0.attn.to_v"
    lora = diffusers_format([site], shapes={site: (inner, inner)})
    fast.load_lora_adapter(lora, adapter_name="v", prefix="transformer")
    assert block.v_fp8_scale(h) is None


def test_pipeline_with_graphs_and_a_step_cache(reference_kernel, stand_in_graphs):
    """optimize(QwenImage21Pipeline, fp8_attention="auto"): CFG with two prompt lengths, the cached steps in (stand-in)
    CUDA graphs, within the error of stock's latents; `applied` names the kernel; with a step cache too, within the
    error of the same cache without FP8 attention, both pipelines' `applied` naming the cache."""
    call = dict(num_inference_steps=4, use_kv_cache=True)
    expected = latents(tiny_pipeline(), **call)
    fast = optimize(tiny_pipeline(), FastConfig(fp8=False, fp8_attention="auto"))
    error = rel_rms_error(latents(fast, **call), expected)
    assert 1e-4 < error <= TINY_ERROR, error
    assert "fp8_attention:reference" in fast.applied and "cuda_graphs" in fast.applied, fast.applied
    assert stand_in_graphs["replays"]
    cache = dict(cache="every:2,1,0")
    cached = optimize(tiny_pipeline(), FastConfig(fp8=False, fp8_attention="auto", **cache))
    plain = optimize(tiny_pipeline(), FastConfig(fp8=False, **cache))
    error = rel_rms_error(latents(cached, **call), latents(plain, **call))
    assert 1e-4 < error <= TINY_ERROR, error
    assert "fp8_attention:reference" in cached.applied and "fp8_attention:reference" not in plain.applied
    assert [a for a in cached.applied if a.startswith("step_cache:")] == [
        a for a in plain.applied if a.startswith("step_cache:")] != [], (cached.applied, plain.applied)


def test_under_a_memory_budget_as_resident(reference_kernel):
    """With a memory budget (blocks streamed; the prefix caches, FP8 here, released before each decode and
    extracted anew): the images equal the resident pipeline's with FP8 attention bit for bit, call after call."""
    import numpy as np
    from diffusers import QwenImage21Pipeline

    from test_qwen21_memory import budget_for, components, images

    config = FastConfig(fp8=False, fp8_attention="auto")
    expected = images(optimize(QwenImage21Pipeline(**components()), config), output_type="np")
    low = optimize(QwenImage21Pipeline(**components()),
                   config.replace(memory="low", max_memory_gib=budget_for(resident_blocks=2)))
    for call in range(2):
        assert np.array_equal(images(low, output_type="np"), expected), f"call {call}"
        assert low._turns.arenas["transformer"].stream.copied > 0
        assert not low.transformer.prefix_cache.slots, "the FP8 prefix caches were kept through the decode"
        assert "fp8_attention:reference" in low.applied, low.applied


def test_where_it_cannot_run(tmp_path):
    """cuDNN's kernel (no log-sum-exp) refused on 2.1, by the model, optimize and the command line before loading;
    FA3 named on the CPU refused before any conversion; "auto" on the CPU runs BF16 attention and the plan says
    why."""
    from qwen_image_fast.cli.inputs import check_pipeline_options

    with pytest.raises(ValueError, match="fp8_attention='cudnn' is not available on Qwen-Image-2.1"):
        FastQwenImage21Transformer.from_diffusers(tiny_stock(), FastTransformerConfig(fp8_attention="cudnn"))
    with pytest.raises(ValueError, match="fp8_attention='fa3' needs a CUDA GPU"):
        FastQwenImage21Transformer.from_diffusers(tiny_stock(), FastTransformerConfig(fp8_attention="fa3"))
    with pytest.raises(ValueError, match="--fp8-attention cudnn: m is a Qwen-Image-2.1 checkpoint"):
        check_pipeline_options("QwenImage21Pipeline", "m", FastConfig(fp8_attention="cudnn"), False, "png")
    fast = optimize(tiny_pipeline(), FastConfig(fp8=False, fp8_attention="auto"))
    assert fast.transformer.fp8_attention == (None, "needs a CUDA GPU (the transformer runs on cpu)")
    why = {opt.name: plan.why_not for opt, plan in plans(fast.fast_config, fast.facts())}
    assert why["fp8_attention"] == "needs a CUDA GPU (the transformer runs on cpu)"
    assert not any(label.startswith("fp8_attention") for label in fast.applied)


@pytest.mark.gpu
def test_fa3_two_calls_merged_against_one_attention_on_gpu():
    """FA3's FP8 attention on two key sets (4096 target keys, 300 prefix keys of which sample 1 has 211 valid),
    merged, against the reference's one attention over the dequantized union (fp32 softmax): what is left is FA3's
    FP8 probabilities; its log-sum-exps equal the reference's."""
    from qwen_image_fast.kernels.attention_merge import merge_attention
    from qwen_image_fast.pipelines.core.model.fp8_attention import fp8_attention_lse, fp8_attention_lse_ref

    assert installed("fa3"), "tokenspeed-fa3 not installed (pip install 'qwen-image-fast[fp8-attention]')"
    g = torch.Generator("cuda").manual_seed(0)
    b, t, p, h, d = 2, 4096, 300, 32, 128

    def codes(n):
        return (torch.randn(b, n, h, d, generator=g, device="cuda") * 60).clamp(-448, 448).to(FP8_DTYPE)

    q8, k8t, v8t, k8p, v8p = codes(t), codes(t), codes(t), codes(p), codes(p)
    q_scale, k_scale = torch.full((1,), 0.01, device="cuda"), torch.full((1,), 0.02, device="cuda")
    v_t, v_p = torch.rand(b, h, generator=g, device="cuda") + 0.5, torch.rand(b, h, generator=g, device="cuda") * 3
    valid = torch.tensor([p, 211], dtype=torch.int32, device="cuda")
    o_t, l_t = fp8_attention_lse("fa3", q8, k8t, v8t, q_scale, k_scale, v_t)
    o_p, l_p = fp8_attention_lse("fa3", q8, k8p, v8p, q_scale, k_scale, v_p, valid)
    for (o, lse), args in (((o_t, l_t), (k8t, v8t, v_t, None)), ((o_p, l_p), (k8p, v8p, v_p, valid))):
        ref_o, ref_lse = fp8_attention_lse_ref(q8, args[0], args[1], q_scale, k_scale, args[2], args[3])
        assert o.dtype == torch.bfloat16 and lse.shape == (b, h, t)
        torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-3)
        assert rel_rms_error(o.float(), ref_o.float()) < 5e-2
    merged = torch.empty(b, t, h * d, dtype=torch.bfloat16, device="cuda")
    merge_attention(o_t, l_t, o_p, l_p, merged)
    # the union with one v scale per key set: the prefix's values rescaled into the target's scale exactly in fp32
    k = torch.cat([k8t.float(), k8p.float()], 1)
    v = torch.cat([v8t.float() * v_t[:, None, :, None], v8p.float() * v_p[:, None, :, None]], 1)
    keys = torch.cat([torch.ones(b, t, dtype=torch.bool, device="cuda"),
                      torch.arange(p, device="cuda")[None] < valid[:, None]], 1)
    scores = torch.einsum("bshd,bkhd->bhsk", q8.float() * q_scale, k * k_scale) / d ** 0.5
    probs = torch.softmax(scores.masked_fill(~keys[:, None, None, :], float("-inf")), dim=-1)
    union = torch.einsum("bhsk,bkhd->bshd", probs, v).flatten(2)
    assert rel_rms_error(merged.float(), union) < 5e-2, rel_rms_error(merged.float(), union)


@pytest.mark.gpu
def test_real_width_within_its_bound_in_graphs_on_gpu():
    """2 blocks at the real width (32 heads x 128), bf16, FP8 GEMMs, a condition image and two prompt lengths, the
    pipeline's loop (prefix extracted, then cached): every step's target rows within FP8 attention's bound of stock;
    the cached steps replayed from the runner's CUDA graphs equal the eager ones; `running` names FA3."""
    from qwen_image_fast.pipelines.core.optimizations import CallRecord
    from qwen_image_fast.pipelines.core.runtime.runner import Runner

    stock = tiny_stock(**REAL).to("cuda", torch.bfloat16)
    fast = FastQwenImage21Transformer.from_diffusers(stock, FastTransformerConfig(fp8_attention="auto"))
    assert fast.fp8_attention == ("fa3", None) and ("fp8_attention", "fa3") in fast.running()
    args = inputs(2, (40, 23), (16, 16), target=(32, 48), config=REAL, device="cuda", dtype=torch.bfloat16)
    errors = target_errors(fast, stock, args)
    assert all(e <= BY_NAME["fp8_attention"].bound.full for e in errors), errors
    kv = QwenImage21KVCache(2)
    t = torch.full((2,), 0.5, device="cuda", dtype=torch.bfloat16)
    fast(**args, timestep=t, kv_cache=kv, kv_cache_mode="extract")
    eager = fast(**args, timestep=t, kv_cache=kv, kv_cache_mode="cached").sample
    record = CallRecord()
    with Runner().call(fast, record, graphs=True, pair_cfg=False, bucket=1):
        for _ in range(3):  # eager, captured, replayed
            out = fast(**args, timestep=t, kv_cache=kv, kv_cache_mode="cached").sample
            assert_close(out, eager, 1e-6, "graph vs eager")
    assert "cuda_graphs" in record.labels() and "fp8_attention:fa3" in record.labels(), record.labels()
