"""One test per registered optimization (optimizations.REGISTRY), each on the CPU, on the tiny fp32 pipeline:
(a) switching it off removes exactly its `applied` label (and those of the optimizations that run inside it), before
    a call and after one;
(b) with it on, the output equals stock diffusers' at the same seed (EXACT_TOL, FP8 off), or, for a lossy one, stays
    inside its declared bound; a "choice" equals stock diffusers set up the same way independently of our code;
(c) it has an effect a CPU test can see (a spy on what it replaces, or a stand-in for CUDA-graph capture).
A registered optimization without a case here (or in ELSEWHERE: parallel, under torchrun in test_parallel.py; step_cache,
lossy without a fixed bound, against stock with the same cache and a reference of its rule in test_step_caches.py) fails
test_every_optimization_has_a_case."""

import contextlib
import math

import numpy as np
import pytest
import torch
from diffusers import DPMSolverMultistepScheduler, UniPCMultistepScheduler
from helpers import assert_close, forward_batches
from test_pipeline import EXACT, stock_pipeline

from qwen_image_fast import FastConfig, optimize
from qwen_image_fast.kernels import fp8 as fp8_kernels
from qwen_image_fast.kernels._utils import rel_rms_error
from qwen_image_fast.pipelines.qwen_image.model import block, vae
from qwen_image_fast.pipelines.qwen_image.model import transformer as transformer_module
from qwen_image_fast.pipelines.qwen_image.model.transformer import FastQwenImageTransformer
from qwen_image_fast.pipelines.core.optimizations import BY_NAME, EXACT_TOL, REGISTRY

CALL = dict(prompt="a cat on a mat", negative_prompt="blurry", true_cfg_scale=3.0, height=16, width=16,
            num_inference_steps=2)


def run(pipe, **kwargs) -> torch.Tensor:
    """The final latents (output_type="latent") of CALL with kwargs."""
    return pipe(**(CALL | dict(output_type="latent") | kwargs), generator=torch.Generator().manual_seed(0)).images


@pytest.fixture(scope="module")
def stock_latents():
    return run(stock_pipeline())


def fast(config=EXACT, **kwargs):
    return optimize(stock_pipeline(), config, **kwargs)


def names(applied: list[str]) -> set[str]:
    return {label.split(":")[0] for label in applied}


def inside(name: str) -> set[str]:
    """The optimizations that run inside `name` (their `needs` lead to it), with it."""
    found = {name}
    while True:
        more = {opt.name for opt in REGISTRY if set(opt.needs) & found} - found
        if not more:
            return found
        found |= more


def check_switch(on: FastConfig, off: FastConfig, name: str, **call):
    """(a): `off` runs exactly what `on` runs but `name` and what runs inside it, before a call and after one."""
    pipes = fast(on), fast(off)
    before = [names(pipe.applied) for pipe in pipes]
    assert name in before[0] and before[1] == before[0] - inside(name), (before, name)
    for pipe in pipes:
        run(pipe, output_type="pt", **call)
    after = [names(pipe.applied) for pipe in pipes]
    assert name in after[0] and after[1] == after[0] - inside(name), (after, name)


def record_calls(monkeypatch, owner, attribute: str) -> list:
    """Each call of owner.attribute, as (args, kwargs); the original still runs."""
    calls, original = [], getattr(owner, attribute)

    def recording(*args, **kwargs):
        calls.append((args, kwargs))
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, attribute, recording)
    return calls


# ---- the cases, one per registered optimization


def case_fused_transformer(stock_latents, monkeypatch):
    check_switch(EXACT, EXACT.replace(fused_transformer=False), "fused_transformer")
    pipe = fast()
    batches = forward_batches(pipe)
    assert isinstance(pipe.transformer, FastQwenImageTransformer)
    assert_close(run(pipe), stock_latents, EXACT_TOL, "fused transformer vs stock")
    assert batches == [2, 2], "(c) the fused transformer computed the forwards"


def case_fp8(stock_latents, monkeypatch):
    check_switch(FastConfig(), FastConfig(fp8=False), "fp8")
    pipe = fast(FastConfig())
    calls = record_calls(monkeypatch, fp8_kernels, "scaled_mm_cpu")
    err = rel_rms_error(run(pipe), stock_latents)
    assert 0 < err <= BY_NAME["fp8"].bound.tiny, err
    weights = pipe.transformer.transformer_blocks[0].img_qkv.weight_q
    assert weights.dtype == torch.float8_e4m3fn and calls, "(c) e4m3 weights, rowwise-FP8 GEMMs"


def case_fp8_fast_accum(stock_latents, monkeypatch):
    check_switch(FastConfig(), FastConfig(fp8_fast_accum=False), "fp8_fast_accum")
    for accum in (True, False):  # 48 x 48: 36 image tokens, 72 rows in a CFG pair (fast accumulation from 64)
        calls = record_calls(monkeypatch, fp8_kernels, "scaled_mm_cpu")
        err = rel_rms_error(run(fast(FastConfig(fp8_fast_accum=accum)), height=48, width=48),
                            run(stock_pipeline(), height=48, width=48))
        assert 0 < err <= BY_NAME["fp8_fast_accum"].bound.tiny, err
        assert any(kwargs["use_fast_accum"] for _, kwargs in calls) == accum, "(c) asked of _scaled_mm"
        monkeypatch.undo()


def case_attention(stock_latents, monkeypatch):
    pipe = fast()
    assert [label for label in pipe.applied if label.startswith("attention:")] == ["attention:sdpa"]
    assert "attention:sdpa" not in fast(EXACT.replace(fused_transformer=False)).applied
    with pytest.raises(ValueError, match="attention='cudnn' needs a CUDA device"):
        fast(EXACT.replace(attention="cudnn"))  # never a silent substitute
    calls = record_calls(monkeypatch, block, "joint_attention")
    assert_close(run(pipe), stock_latents, EXACT_TOL, "attention vs stock")
    assert calls and all(args[-1] == "sdpa" for args, _ in calls), "(c) the backend it names ran"


def case_fp8_attention(stock_latents, monkeypatch):
    """No FP8 attention kernel runs on the CPU: "auto" runs the BF16 attention, saying why, a named kernel is
    refused. (a), (b), (c) with fp8_attention_ref standing in for the GPU kernels (test_fp8_attention.py; the GPU
    tests hold the kernels to it and the option to its bound)."""
    plan = dict(zip((opt.name for opt in REGISTRY), fast(EXACT.replace(fp8_attention="auto")).will_run().values()))
    assert not plan["fp8_attention"] and "fp8_attention" not in names(fast(EXACT.replace(fp8_attention="auto")).applied)
    with pytest.raises(ValueError, match="fp8_attention='cudnn' needs a CUDA GPU"):
        fast(EXACT.replace(fp8_attention="cudnn"))  # never a silent substitute
    monkeypatch.setattr(transformer_module, "fp8_attention_kernel", lambda name, device, dtype: (
        ("reference", None) if name != "off" else (None, None)))
    check_switch(EXACT.replace(fp8_attention="auto"), EXACT, "fp8_attention")
    calls = record_calls(monkeypatch, block, "fp8_attention")
    err = rel_rms_error(run(fast(EXACT.replace(fp8_attention="auto"))), stock_latents)
    assert 0 < err <= 2e-2, err  # the reference's FP8 q, k, v; the kernels' FP8 probabilities only on a GPU
    assert calls and all(args[0] == "reference" for args, _ in calls), "(c) the FP8 attention ran"


def case_modulation_table(stock_latents, monkeypatch):
    check_switch(EXACT, EXACT.replace(modulation_table=False), "modulation_table")
    # the paired forwards' table (batch 2B) and the unpaired ones' (batch B): 2 forwards a call, or 4
    for table, batched in ((True, True), (False, True), (True, False)):
        pipe = fast(EXACT.replace(modulation_table=table, batched_cfg=batched))
        linear = pipe.transformer.transformer_blocks[0].img_mod[1]
        assert_close(run(pipe), stock_latents, EXACT_TOL, f"table={table}, batched_cfg={batched} vs stock")
        calls = record_calls(monkeypatch, linear, "forward")
        run(pipe)
        # (c) the same schedule again: the table's rows are looked up, the linear is not run in the forwards
        assert len(calls) == (0 if table else 2), (table, batched, len(calls))
        monkeypatch.undo()


def case_memory(stock_latents, monkeypatch):
    check_switch(EXACT.replace(memory="low"), EXACT, "memory")
    pipe = fast(EXACT.replace(memory="low"))
    assert_close(run(pipe), stock_latents, EXACT_TOL, "memory='low' vs stock")
    turns, weight = pipe._turns, pipe.transformer.transformer_blocks[0].img_qkv.weight

    def within(buffer) -> bool:
        return buffer.data_ptr() <= weight.data_ptr() < buffer.data_ptr() + buffer.numel()

    # (c) the block linears in the shared device buffer for the loop, back on the host for the text encoder's turn
    assert turns.resident == "transformer" and turns.loads == 2 and within(turns.buffer)
    pipe.encode_prompt("a cat", device=torch.device("cpu"))
    assert turns.resident == "text_encoder" and within(turns.arenas["transformer"].host)


def case_batched_cfg(stock_latents, monkeypatch):
    check_switch(EXACT, EXACT.replace(batched_cfg=False), "batched_cfg")
    for batched in (True, False):
        pipe = fast(EXACT.replace(batched_cfg=batched))
        batches = forward_batches(pipe)
        assert_close(run(pipe), stock_latents, EXACT_TOL, f"batched_cfg={batched} vs stock")
        assert batches == ([2, 2] if batched else [1, 1, 1, 1]), "(c) one forward of 2B per step"
    # prompt and negative prompt of one length: diffusers drops both all-ones masks, the texts pair unpadded
    same_length = dict(negative_prompt="a dog on a rug")  # as long as CALL's prompt
    assert_close(run(fast(), **same_length), run(stock_pipeline(), **same_length), EXACT_TOL, "unmasked pair vs stock")


def case_cuda_graphs(stock_latents, monkeypatch, stand_in_graphs):
    check_switch(EXACT, EXACT.replace(cuda_graphs=False), "cuda_graphs", num_inference_steps=3)
    log = stand_in_graphs
    log["captures"].clear(), log["replays"].clear()
    pipe = fast()
    latents = run(pipe, num_inference_steps=4)
    assert_close(latents, run(stock_pipeline(), num_inference_steps=4), EXACT_TOL, "graphs vs stock")
    # (c) step 1 eager, step 2 captured and replayed, steps 3-4 replayed; the next call replays every step
    assert (len(log["captures"]), len(log["replays"])) == (1, 3), log
    assert torch.equal(run(pipe, num_inference_steps=4), latents)
    assert (len(log["captures"]), len(log["replays"])) == (1, 7), log
    assert len(pipe.runner.graphs) == 1


def test_applied_lists_what_ran_on_that_call_only(stand_in_graphs):
    """`applied` after a call holds what that call ran: graphs only on a call that replayed one (a forward
    signature's second time in a call), vae_2d_decode only when it decoded. Before the first call: the plan."""
    log = stand_in_graphs
    pipe = fast(EXACT.replace(cfg_fraction=0.5))
    assert {"cuda_graphs", "vae_2d_decode"} <= names(pipe.applied)  # what the next call will run
    run(pipe)  # 2 steps: one paired forward, then one of the prompt alone: no signature twice, nothing replayed
    assert log["captures"] == [] and not {"cuda_graphs", "vae_2d_decode"} & names(pipe.applied), pipe.applied
    run(pipe, num_inference_steps=4, output_type="pil")  # each signature twice: captured and replayed; decoded
    assert log["replays"] == [2, 1] and {"cuda_graphs", "vae_2d_decode"} <= names(pipe.applied), pipe.applied
    run(pipe)  # the 2-step call again: now both of its forwards replay the graphs kept from the last
    assert log["replays"] == [2, 1, 2, 1] and "cuda_graphs" in names(pipe.applied), pipe.applied
    pipe.fast_config = pipe.fast_config.replace(cuda_graphs=False)
    run(pipe, num_inference_steps=4)
    assert log["replays"] == [2, 1, 2, 1] and "cuda_graphs" not in names(pipe.applied), pipe.applied


def case_scheduler(stock_latents, monkeypatch):
    """Expectations from diffusers' own scheduler classes, configured here: UniPC through the stock pipeline
    (it takes the sigmas and mu the stock pipeline passes); DPM-Solver++ 2M through the stock pipeline too, with
    the sigmas dropped, as our pipeline drives it (its set_timesteps takes none: diffusers issue 12108)."""
    for name in ("unipc", "dpm++2m"):
        check_switch(EXACT.replace(scheduler=name), EXACT, "scheduler")
    flow = dict(prediction_type="flow_prediction", use_flow_sigmas=True)
    for name, make in (
        ("unipc", lambda config: UniPCMultistepScheduler.from_config(config, **flow)),
        ("dpm++2m", lambda config: DPMWithoutSigmas.from_config(
            config, **flow, algorithm_type="dpmsolver++", solver_order=2, final_sigmas_type="zero",
            lower_order_final=True)),
    ):
        stock = stock_pipeline()
        stock.scheduler = make(stock.scheduler.config)
        expected = run(stock, num_inference_steps=4)
        pipe = fast(EXACT.replace(scheduler=name))
        out = run(pipe, num_inference_steps=4)
        assert_close(out, expected, EXACT_TOL, f"{name} vs stock with that scheduler")
        assert isinstance(stock.scheduler, type(pipe.sampler)), "(c) the sampler stepped is the one asked for"
        assert rel_rms_error(out, run(stock_pipeline(), num_inference_steps=4)) > 1e-3, "(c) not Euler's result"


class DPMWithoutSigmas(DPMSolverMultistepScheduler):
    """diffusers' DPM-Solver++ taking the stock pipeline's sigmas only for their count (its ladder is its own)."""

    def set_timesteps(self, num_inference_steps=None, device=None, sigmas=None, mu=None, timesteps=None):
        super().set_timesteps(len(sigmas) if sigmas is not None else num_inference_steps, device=device, mu=mu)


def case_cfg_fraction(stock_latents, monkeypatch):
    """The reference: stock diffusers with the same guidance schedule, given through its callback: from the first
    unguided step on, the transformer answers the "uncond" pass with the "cond" pass's output, so stock's combination
    (neg + s * (cond - neg), rescaled to cond's norm) is the conditional prediction exactly, which selective CFG uses."""
    check_switch(EXACT.replace(cfg_fraction=0.5), EXACT, "cfg_fraction")
    steps = 4
    stock = stock_pipeline()
    transformer = stock.transformer
    state = {"pass": None, "guided": True, "cond": None}
    cache_context, forward = transformer.cache_context, transformer.forward

    @contextlib.contextmanager
    def naming(name):
        state["pass"] = name
        with cache_context(name):
            yield

    def scheduled(*args, **kwargs):
        if state["pass"] == "uncond" and not state["guided"]:
            return state["cond"]
        out = forward(*args, **kwargs)
        state["cond"] = out if state["pass"] == "cond" else state["cond"]
        return out

    def schedule(pipe, i, t, tensors):  # after step i: guidance for the first ceil(0.5 * steps) steps
        state["guided"] = i + 1 < math.ceil(0.5 * steps)
        return {}

    monkeypatch.setattr(transformer, "cache_context", naming)
    monkeypatch.setattr(transformer, "forward", scheduled)
    expected = run(stock, num_inference_steps=steps, callback_on_step_end=schedule)
    pipe = fast(EXACT.replace(cfg_fraction=0.5))
    batches = forward_batches(pipe)
    out = run(pipe, num_inference_steps=steps)
    assert_close(out, expected, EXACT_TOL, "cfg_fraction vs stock with the same guidance schedule")
    assert batches == [2, 2, 1, 1], "(c) guidance on the first half of the steps only"
    assert rel_rms_error(out, run(fast(), num_inference_steps=steps)) > 1e-3


class Rewriter:
    """A stand-in prompt enhancer: appends ", detailed"."""

    def enhance(self, prompts):
        return [p + ", detailed" for p in ([prompts] if isinstance(prompts, str) else prompts)]


def case_enhance_prompt(stock_latents, monkeypatch):
    on, off = fast(enhance_prompt=Rewriter()), fast()
    assert names(on.applied) - names(off.applied) == {"enhance_prompt"}
    encoded = record_calls(monkeypatch, on, "encode_prompt")
    out = run(on)
    run(off)
    assert names(on.applied) - names(off.applied) == {"enhance_prompt"}
    assert_close(out, run(stock_pipeline(), prompt=CALL["prompt"] + ", detailed"), EXACT_TOL, "vs stock, rewritten")
    assert encoded[0][1]["prompt"] == CALL["prompt"] + ", detailed", "(c) the rewrite is what is encoded"


def case_vae_2d_decode(stock_latents, monkeypatch):
    check_switch(EXACT, EXACT.replace(vae_2d_decode=False), "vae_2d_decode")
    calls = record_calls(monkeypatch, vae, "decode_image")
    pipe = fast()
    stock_decoder = record_calls(monkeypatch, pipe.vae.decoder, "forward")
    images = run(pipe, output_type="np", height=32, width=48)
    np.testing.assert_allclose(images, run(stock_pipeline(), output_type="np", height=32, width=48), atol=1e-5, rtol=0)
    assert len(calls) == 1 and not stock_decoder, "(c) the 2D decode ran, the stock 3D decoder did not"
    # an output layer 20x larger in both VAEs: the decoder's output saturates, and both clamp it to [-1, 1]
    stock_vae, z = stock_pipeline().vae, torch.randn(1, pipe.vae.config.z_dim, 1, 4, 6)
    with torch.no_grad():
        for v in (stock_vae, pipe.vae):
            v.decoder.conv_out.weight.mul_(20)
        want = stock_vae.decode(z).sample
        assert (want.abs() == 1).float().mean() > 0.05, "the check needs clamped pixels"
        assert_close(pipe.vae.decode(z).sample, want, EXACT_TOL, "saturated decode vs stock")


CASES = {name.removeprefix("case_"): function for name, function in globals().items() if name.startswith("case_")}
# Optimizations whose a, b and c need more than one process (checked under torchrun, gloo) or a file written in
# each format: checked by these tests.
ELSEWHERE = {"parallel": ("test_parallel", "test_parallel_against_stock"),
             "step_cache": ("test_step_caches", "test_dbcache_decides_and_computes_as_its_reference"),
             # what loading a single checkpoint file did: against stock holding what the file means
             "single_file": ("test_single_file", "test_a_bf16_file_loads_as_its_diffusers_folder_does"),
             "dequantized": ("test_single_file", "test_fp8_codes_and_scales_are_kept_bit_for_bit"),
             "requantized": ("test_single_file", "test_the_forward_equals_stock_holding_what_the_file_means")}


def test_every_optimization_has_a_case():
    assert sorted([*CASES, *ELSEWHERE]) == sorted(opt.name for opt in REGISTRY)
    for module, test in ELSEWHERE.values():
        assert callable(getattr(__import__(module), test)), f"{module}.{test}"


@pytest.mark.parametrize("name", [opt.name for opt in REGISTRY if opt.name not in ELSEWHERE])
def test_optimization(name, stock_latents, monkeypatch, request):
    kwargs = {"stand_in_graphs": request.getfixturevalue("stand_in_graphs")} if name == "cuda_graphs" else {}
    CASES[name](stock_latents, monkeypatch, **kwargs)
