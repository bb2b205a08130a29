"""Batched CFG on Qwen-Image-2.1 (qwen_image21/model.py's _forward_pair, block.PairedAttention): diffusers' loop
calls the transformer for "cond" and then "uncond" at every step; from the first cached step on, the "cond" call
computes both as one step of batch 2B (each half against its own branch's prefix cache, at its own rotary
positions) and the "uncond" call gets its half, when its inputs are those the half was computed from.

Against stock diffusers' QwenImage21Transformer2DModel in the same loop (fp32, tiny config, FP8 off: 1e-5): the
prompt and the negative prompt of different lengths (their targets' rotary positions differ), a condition image in
both prefixes; FP8 attention (the reference kernel on the CPU) equal to its unpaired self; an "uncond" call whose
latents are not the ones paired computes anew, and one whose timestep is not fails the call (the speculation's
check, a ValueError at the call's end). The pipeline-level comparisons (with graphs, memory="low")
are test_qwen21.py's and test_qwen21_memory.py's, which run with CFG and batched CFG on by default."""

import contextlib

import pytest
import torch
from diffusers.hooks import TaylorSeerCacheConfig
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache
from helpers import assert_close, rel_rms_error

from qwen_image_fast import FastConfig, optimize
from qwen_image_fast.pipelines.core.config import FastTransformerConfig
from qwen_image_fast.pipelines.core.optimizations import BY_NAME, FP8_BOUND, CallRecord, plans
from qwen_image_fast.pipelines.core.runtime.runner import Runner
from qwen_image_fast.pipelines.core.runtime.context import forward_context
from qwen_image_fast.pipelines.qwen_image21.model import FastQwenImage21Transformer

from test_qwen21 import REAL, inputs, tiny_pipeline, tiny_stock
from test_qwen21_fp8_attention import reference_kernel  # noqa: F401 (a fixture)

CASES = {  # id -> (batch, prompt's text lengths, negative prompt's, condition image (h, w) in latent tokens)
    "t2i-two-lengths": (2, (7, 4), (3, 9), None),
    "condition": (1, (5,), (8,), (2, 4)),
}


def branches(case: str) -> tuple[dict, dict]:
    """The prompt's and the negative prompt's forward arguments: their own text, mask and image slots; the same
    latents (one tensor, as the pipeline passes it) and image shapes."""
    batch, lengths, negative_lengths, condition = CASES[case]
    cond, uncond = inputs(batch, lengths, condition, seed=1), inputs(batch, negative_lengths, condition, seed=2)
    return cond, uncond | dict(hidden_states=cond["hidden_states"])


def cfg_loop(model, cond: dict, uncond: dict, steps: int = 4, scale: float = 2.0, speculation=None,
             uncond_latents=lambda latents: latents, uncond_timestep=lambda t: t) -> list[torch.Tensor]:
    """QwenImage21Pipeline's loop around the transformer (the prefix caches extracted at the first step, then
    cached; CFG; Euler steps on the target latents): each step's (cond, uncond) outputs. speculation: the fast
    model's pairing in the forward context (None: the context's, a runner's call or none); uncond_latents / uncond_timestep: what the "uncond" call
    gets instead of the step's latents / timestep."""
    kvs = QwenImage21KVCache(len(model.transformer_blocks)), QwenImage21KVCache(len(model.transformer_blocks))
    target = cond["img_shapes"][0][-1][1] * cond["img_shapes"][0][-1][2]
    latents, outs = cond["hidden_states"], []
    paired = forward_context(cfg_speculation=speculation) if speculation is not None else contextlib.nullcontext()
    with torch.no_grad(), paired:
        for i in range(steps):
            t = torch.full((latents.shape[0],), 1 - i / steps, device=latents.device, dtype=latents.dtype)
            mode = "extract" if i == 0 else "cached"
            step = []
            for name, args, kv in (("cond", cond, kvs[0]), ("uncond", uncond, kvs[1])):
                hidden, timestep = (latents, t) if name == "cond" else (uncond_latents(latents), uncond_timestep(t))
                with model.cache_context(name):
                    step.append(model(**args | dict(hidden_states=hidden), timestep=timestep, kv_cache=kv,
                                      kv_cache_mode=mode, return_dict=False)[0][:, -target:])
            outs.append(step)
            guided = step[1] + scale * (step[0] - step[1])
            latents = torch.cat([latents[:, :-target], latents[:, -target:] - guided / steps], dim=1)
    return outs


def paired_steps(monkeypatch, model) -> list:
    """Each _forward_pair call of `model` from here on, recorded."""
    calls, pair = [], model._forward_pair
    monkeypatch.setattr(model, "_forward_pair", lambda *args: calls.append(1) or pair(*args))
    return calls


def paired_equal(monkeypatch, fast, cond: dict, uncond: dict, expected: list) -> int:
    """The fast model's loop with its speculation: each step's cond and uncond outputs equal `expected`'s (1e-5);
    returns how many steps it paired."""
    pairs = paired_steps(monkeypatch, fast)
    for n, (got, want) in enumerate(zip(cfg_loop(fast, cond, uncond, speculation=fast.cfg_speculation()), expected)):
        assert_close(got[0], want[0], 1e-5, f"step {n}, cond")
        assert_close(got[1], want[1], 1e-5, f"step {n}, uncond")
    return len(pairs)


@pytest.mark.parametrize("case", list(CASES))
def test_paired_steps_match_stock(monkeypatch, case):
    """Every step's cond and uncond outputs equal stock's (fp32, FP8 off), the cached steps paired: one
    _forward_pair a cached step, and the "uncond" calls answered from it."""
    stock = tiny_stock()
    fast = FastQwenImage21Transformer.from_diffusers(stock, FastTransformerConfig(fp8=False))
    cond, uncond = branches(case)
    assert paired_equal(monkeypatch, fast, cond, uncond, cfg_loop(stock, cond, uncond)) == 3, "the 3 cached steps"


def test_an_uncond_call_unlike_the_paired_one_computes_anew_or_the_call_fails(monkeypatch):
    """A loop whose "uncond" call passes other latents than its step's "cond" call gets what it asked for: its
    output computed anew (equal to stock's for those inputs), not the paired half. Another timestep (its values are
    compared on the device, read once at the end): the speculation's verify() fails the call, saying what to do."""
    stock = tiny_stock()
    fast = FastQwenImage21Transformer.from_diffusers(stock, FastTransformerConfig(fp8=False))
    cond, uncond = branches("t2i-two-lengths")
    change = dict(uncond_latents=lambda latents: latents * 0.9)
    expected = cfg_loop(stock, cond, uncond, **change)
    pairs = paired_steps(monkeypatch, fast)
    speculation = fast.cfg_speculation()
    got = cfg_loop(fast, cond, uncond, speculation=speculation, **change)
    for n, (steps, want) in enumerate(zip(got, expected)):
        assert_close(steps[1], want[1], 1e-5, f"step {n}, uncond")
        assert_close(steps[0], want[0], 1e-5, f"step {n}, cond")
    assert len(pairs) == 3, "the cond calls still paired; their uncond halves dropped"
    speculation.verify()  # nothing answered from a kept half
    speculation = fast.cfg_speculation()
    cfg_loop(fast, cond, uncond, speculation=speculation, uncond_timestep=lambda t: t * 0.9)
    with pytest.raises(ValueError, match=r"passed another timestep: this loop needs FastConfig\(batched_cfg=False\)"):
        speculation.verify()
    speculation = fast.cfg_speculation()
    cfg_loop(fast, cond, uncond, speculation=speculation)
    speculation.verify()


@pytest.mark.parametrize("case", list(CASES))
def test_fp8_attention_paired_equals_unpaired(reference_kernel, monkeypatch, case):  # noqa: F811
    """FP8 attention (the reference kernel; FP8 GEMMs off, so v's scales are measured per sample and head): each
    half's queries against its own branch's FP8 prefix cache and its own keys give what the branch gives alone."""
    stock = tiny_stock()
    fast = FastQwenImage21Transformer.from_diffusers(stock, FastTransformerConfig(fp8=False, fp8_attention="auto"))
    cond, uncond = branches(case)
    assert paired_equal(monkeypatch, fast, cond, uncond, cfg_loop(fast, cond, uncond)) == 3
    assert ("fp8_attention", "reference") in fast.running()


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_attention", ["off", "fa3"])
def test_real_width_paired_in_graphs_on_gpu(monkeypatch, fp8_attention):
    """2 blocks at the real width (32 heads x 128), bf16, FP8 GEMMs, a condition image, the prompt and the negative
    prompt of different lengths: every step's cond and uncond target rows within the bound of stock (FP8 GEMMs; with
    FP8 attention, FA3, its own), the cached steps paired; the same loop in a pipeline call's runner (its CUDA
    graphs: the paired step run eagerly, captured, replayed) equal to it run eagerly."""
    stock = tiny_stock(**REAL).to("cuda", torch.bfloat16)
    fast = FastQwenImage21Transformer.from_diffusers(stock, FastTransformerConfig(fp8_attention=fp8_attention))
    cond = inputs(1, (40,), (16, 16), target=(32, 48), config=REAL, device="cuda", dtype=torch.bfloat16, seed=1)
    uncond = inputs(1, (23,), (16, 16), target=(32, 48), config=REAL, device="cuda", dtype=torch.bfloat16, seed=2)
    uncond["hidden_states"] = cond["hidden_states"]
    bound = BY_NAME["fp8_attention"].bound.full if fp8_attention != "off" else FP8_BOUND.full
    expected = cfg_loop(stock, cond, uncond)
    pairs = paired_steps(monkeypatch, fast)
    eager = cfg_loop(fast, cond, uncond, speculation=fast.cfg_speculation())
    errors = [rel_rms_error(got[half].float(), want[half].float()) for got, want in zip(eager, expected)
              for half in (0, 1)]
    assert all(e <= bound for e in errors) and len(pairs) == 3, (fast.attention_backend, errors, len(pairs))
    record = CallRecord()
    with Runner().call(fast, record, graphs=True, pair_cfg=True, bucket=1):
        graphed = cfg_loop(fast, cond, uncond)
    for n, (got, want) in enumerate(zip(graphed, eager)):
        assert_close(got[0], want[0], 1e-6, f"step {n}, cond: graphed vs eager")
        assert_close(got[1], want[1], 1e-6, f"step {n}, uncond: graphed vs eager")
    assert {"cuda_graphs", "batched_cfg"} <= set(record.labels()) and len(pairs) == 6, record.labels()


def test_the_plan_says_where_it_does_not_run():
    """Batched CFG runs on 2.1's fused transformer with the prefix cache; not under a memory budget (planned for one
    branch's forward at a time), a step cache (its branches advance once per forward) or diffusers' TaylorSeer
    (a state per cache_context), each saying so."""
    facts = optimize(tiny_pipeline(), FastConfig(fp8=False)).facts()

    def why_not(config: FastConfig) -> str | None:
        return {opt.name: plan.why_not for opt, plan in plans(config, facts)}["batched_cfg"]

    assert why_not(FastConfig(fp8=False)) is None
    assert "planned for one branch's forward at a time" in why_not(FastConfig(fp8=False, memory="low",
                                                                              max_memory_gib=64))
    assert "branches advance once per forward" in why_not(FastConfig(fp8=False, cache="every:2,1,0"))
    taylor = optimize(tiny_pipeline(), FastConfig(fp8=False))
    taylor.transformer.enable_cache(TaylorSeerCacheConfig())
    assert "keeps a state per cache_context" in {
        opt.name: plan.why_not for opt, plan in plans(taylor.fast_config, taylor.facts())}["batched_cfg"]
