"""FastConfig(fp8_attention=...): the blocks' attention in FP8 (model/fp8_attention.py), lossy and off by default.

CPU: the option's registry entry and its refusals; the blocks' FP8 wiring (q, k into the FP8 buffers with the
RMSNorm bound's scales, v quantized over the valid keys, the output split into the output projections' operands,
cuDNN's FP8 output included) run with fp8_attention_ref standing in for the GPU kernels, against stock diffusers.
GPU: each installed kernel against fp8_attention_ref at the real head shape; the fast transformer with the option
against stock within its declared bound, in CUDA graphs with batched CFG."""

import dataclasses

import pytest
import torch
from helpers import assert_close

from qwen_image_fast import FastConfig
from qwen_image_fast.kernels._utils import FP8_DTYPE, rel_rms_error
from qwen_image_fast.pipelines.core.config import FastTransformerConfig
from qwen_image_fast.pipelines.qwen_image.model import block as block_module
from qwen_image_fast.pipelines.qwen_image.model import transformer as transformer_module
from qwen_image_fast.pipelines.core.model.fp8_attention import (
    fp8_attention,
    fp8_attention_kernel,
    fp8_attention_ref,
    installed,
)
from qwen_image_fast.pipelines.qwen_image.model.transformer import FastQwenImageTransformer
from qwen_image_fast.pipelines.core.optimizations import BY_NAME, Facts, plan_fp8_attention

from test_transformer import make_inputs, real_width_stock, run, tiny_stock


def test_registered_lossy_and_off_by_default():
    opt = BY_NAME["fp8_attention"]
    assert opt.kind == "lossy" and opt.bound is not None and opt.bound.tiny is None  # no kernel on the CPU
    assert FastConfig().fp8_attention == "off" and FastConfig.preset("fast").fp8_attention == "off"
    with pytest.raises(ValueError, match="fp8_attention='fp4'; allowed: off, auto, cudnn, fa3"):
        FastConfig(fp8_attention="fp4")
    with pytest.raises(ValueError, match="fp8_attention='cudnn' with parallel='ulysses' is not supported"):
        FastConfig(fp8_attention="cudnn", parallel="ulysses")
    with pytest.raises(ValueError, match="fp8_attention='fa3' runs inside the fused transformer"):
        FastConfig(fp8_attention="fa3", fused_transformer=False)


def test_plan_says_bf16_where_the_forwards_run_it():
    """A kernel found on this machine but no FP8 attention in the forwards (Ulysses; the stock transformer): the
    plan (applied, --dry-run) says BF16 and why, never the kernel."""
    facts = Facts(pipeline="QwenImagePipeline", fused=True, device="cuda", fp8=True, fast_accum=True,
                  attention="fa4", offload_hooks=False, vae_2d=None, enhancer=False, fp8_attention="cudnn")
    assert plan_fp8_attention(FastConfig(fp8_attention="auto"), facts).values == ("cudnn",)
    ulysses = plan_fp8_attention(FastConfig(fp8_attention="auto", parallel="ulysses"),
                                 dataclasses.replace(facts, parallel=("ulysses2",)))
    assert ulysses.values == () and "BF16 attention runs" in ulysses.why_not
    stock = plan_fp8_attention(FastConfig(fp8_attention="auto", fused_transformer=False), facts)
    assert stock.values == () and "needs fused_transformer" in stock.why_not


def test_where_it_cannot_run():
    """auto: the BF16 attention, the plan saying why; a named kernel: refused before any conversion."""
    cpu = torch.device("cpu")
    assert fp8_attention_kernel("off", cpu, torch.bfloat16) == (None, None)
    kernel, why = fp8_attention_kernel("auto", cpu, torch.bfloat16)
    assert kernel is None and why == "needs a CUDA GPU (the transformer runs on cpu)"
    facts = Facts(pipeline="QwenImagePipeline", fused=True, device="cpu", fp8=True, fast_accum=True,
                  attention="sdpa", offload_hooks=False, vae_2d=None, enhancer=False, fp8_attention_why=why)
    assert plan_fp8_attention(FastConfig(fp8_attention="auto"), facts).why_not == why
    assert plan_fp8_attention(FastConfig(), facts).values == () and plan_fp8_attention(FastConfig(), facts).why_not is None
    with pytest.raises(ValueError, match="fp8_attention='fa3' needs a CUDA GPU"):
        FastQwenImageTransformer.from_diffusers(tiny_stock(), FastTransformerConfig(fp8_attention="fa3"))
    fast = FastQwenImageTransformer.from_diffusers(tiny_stock(), FastTransformerConfig(fp8_attention="auto"))
    assert fast.fp8_attention == (None, why) and not any(name == "fp8_attention" for name, _ in fast.running())


def test_a_saved_model_loads_without_it_unless_asked(tmp_path):
    """fp8_attention is how a model runs, not how it is stored: a folder saved with it loads with it off (the
    loader's choice, as attention's), and on when the loader's fast_config asks."""
    fast = FastQwenImageTransformer.from_diffusers(tiny_stock(), FastTransformerConfig(fp8_attention="auto"))
    fast.save_pretrained(tmp_path)
    assert FastQwenImageTransformer.from_pretrained(tmp_path).fast_config.fp8_attention == "off"
    asked = FastQwenImageTransformer.from_pretrained(tmp_path, fast_config=FastTransformerConfig(fp8_attention="auto"))
    assert asked.fast_config.fp8_attention == "auto"


@pytest.fixture
def reference_kernel(monkeypatch):
    """fp8_attention_ref as the model's FP8 kernel on the CPU (the GPU kernels' semantics, module docstring)."""
    monkeypatch.setattr(transformer_module, "fp8_attention_kernel", lambda name, device, dtype: (
        ("reference", None) if name != "off" else (None, None)))


@pytest.mark.parametrize("padded", [False, True])
def test_blocks_fp8_wiring_against_stock(reference_kernel, padded):
    """With the reference standing in for the kernel: the output within FP8 attention's error of stock (fp32, FP8
    GEMMs off), and not the BF16 attention's output (the option does something); `running` names the kernel."""
    stock = tiny_stock()
    inputs = make_inputs(stock, "wide", padded=padded)
    fast = FastQwenImageTransformer.from_diffusers(stock, FastTransformerConfig(fp8=False, fp8_attention="auto"))
    exact = FastQwenImageTransformer.from_diffusers(stock, FastTransformerConfig(fp8=False))
    ref = run(stock, inputs)
    error, exact_error = rel_rms_error(run(fast, inputs), ref), rel_rms_error(run(exact, inputs), ref)
    # measured 5e-3 (FP8 q, k, v on 16-wide heads); padded keys attended would give 2e-2
    assert exact_error < 1e-5 and 1e-4 < error < 1.2e-2, (error, exact_error)
    assert ("fp8_attention", "reference") in fast.running()


def test_v_bound_holds_is_near_tight_and_gives_way_to_a_lora():
    """v's FP8 scale from the bound (FP8 QKV GEMMs): every v of any FP8 operand within 448 * scale, the worst row
    (its codes the signs of the widest v row of W_v, at 448) reaching it; with a LoRA adding to v's rows, no bound
    (quantize_fp8_heads measures v then)."""
    from qwen_image_fast.kernels.fp8 import quantize_fp8_rowwise_ref
    from qwen_image_fast.pipelines.core.model import fp8_attention as fp8_module
    from test_lora import diffusers_format

    fast = FastQwenImageTransformer.from_diffusers(tiny_stock(), FastTransformerConfig(fp8=True))
    block = fast.transformer_blocks[0]
    inner = block.heads * block.head_dim
    w = block.img_qkv.weight_q[2 * inner:].float() * block.img_qkv.weight_scale[2 * inner:, None]
    widest = w.abs().sum(1).argmax()
    rows = torch.cat([torch.randn(40, w.shape[1]) * torch.logspace(-2, 2, 40)[:, None], 1e3 * torch.sign(w[widest])[None]])
    x = quantize_fp8_rowwise_ref(rows)
    x_txt = quantize_fp8_rowwise_ref(torch.randn(7, w.shape[1]))
    scales = block.v_fp8_scales(x, x_txt)
    scale = scales[:1]
    # cuDNN's output scale and its reciprocal come with it (one kernel), from CudnnFp8Attention's headroom
    o_scale = scale * fp8_module.CudnnFp8Attention.O_HEADROOM
    assert torch.equal(scales[1:2], o_scale) and torch.equal(scales[2:], 1 / o_scale), scales
    for linear, operand in ((block.img_qkv, x), (block.txt_qkv, x_txt)):
        v = linear(operand)[:, 2 * inner:].float()
        assert v.abs().max() <= 448 * scale, (v.abs().max(), 448 * scale)
    assert block.img_qkv(x)[-1, 2 * inner:].float().abs().max() >= 0.9 * 448 * scale  # the bound is reached
    # a large bias on the widest v row, of its sum's sign (changed in place: the cached bound must see it): the
    # bias term dominates the bound, every v stays within it, and that row reaches it (both terms at their largest)
    row = block.img_qkv(x)[-1, 2 * inner + widest].float()
    with torch.no_grad():
        block.img_qkv.bias[2 * inner + widest] = 20 * row.abs() * row.sign()
    large = block.v_fp8_scales(x, x_txt)[:1]
    assert large > 10 * scale, (large, scale)
    v = block.img_qkv(x)[:, 2 * inner:].float()
    assert v.abs().max() <= 448 * large and v[-1].abs().max() >= 0.95 * 448 * large, (v.abs().max(), 448 * large)
    assert block.v_fp8_scales(rows, x_txt) is None  # an operand not FP8
    pipe_lora = diffusers_format(["transformer_blocks.0.attn.add_v_proj"])
    fast.load_lora_adapter(pipe_lora, adapter_name="v", prefix="transformer")
    assert block.v_fp8_scales(x, x_txt) is None


@pytest.mark.parametrize("lora, v_bias", [(False, 1.0), (True, 1.0), (False, 30.0)],
                         ids=["bound", "lora", "large-v-bias"])
def test_fp8_gemms_take_the_v_bound(reference_kernel, monkeypatch, lora, v_bias):
    """With the FP8 GEMMs the blocks write v as FP8 in qkv_pack from the bound (no quantize_fp8_heads pass), with a
    LoRA on v they measure it; either way the output stays within the FP8 GEMMs' and attention's error of stock,
    also where v's biases (both streams', every block's) are v_bias times as large, so that the bound's bias term
    decides the scale."""
    from qwen_image_fast.pipelines.core.model import fp8_attention as fp8_module
    from test_lora import diffusers_format

    measured = []
    quantize = fp8_module.quantize_fp8_heads
    monkeypatch.setattr(fp8_module, "quantize_fp8_heads", lambda *a, **k: measured.append(1) or quantize(*a, **k))
    stock = tiny_stock()
    inputs = make_inputs(stock, "wide", padded=True)
    with torch.no_grad():
        for block in stock.transformer_blocks:
            block.attn.to_v.bias.mul_(v_bias), block.attn.add_v_proj.bias.mul_(v_bias)
    if lora:
        stock.load_lora_adapter(diffusers_format([f"transformer_blocks.{i}.attn.to_v" for i in (0, 1)]),
                                adapter_name="v", prefix="transformer")
    fast = FastQwenImageTransformer.from_diffusers(stock, FastTransformerConfig(fp8=True, fp8_attention="auto"))
    error = rel_rms_error(run(fast, inputs), run(stock, inputs))
    # measured 7.6e-3 (7.8e-3 with the LoRA) and 3.1e-2 with the large biases: a bias, the same for every key, is
    # rounded to e4m3 once per channel, and its error does not average out over the keys as the rest of v's does
    assert 1e-4 < error < (3e-2 if v_bias == 1 else 5e-2), error
    assert bool(measured) == lora


def test_with_lora_and_a_step_cache_in_the_pipeline(reference_kernel):
    """The text-to-image pipeline with FP8 attention (the reference kernel), batched CFG, a LoRA on every block
    linear and a fixed-schedule step cache: within FP8 attention's error of the same pipeline without it (the LoRA
    acts in the GEMMs before qkv_pack; a cached step skips the middle blocks whole)."""
    from test_lora import LORA_A, diffusers_format
    from test_lora import run as run_cfg
    from test_pipeline import fast_pipeline

    latents = {}
    for setting in ("off", "auto"):
        pipe = fast_pipeline(FastConfig(fp8=False, fp8_attention=setting, cache="every:2,1,0"))
        pipe.load_lora_weights(diffusers_format(LORA_A), adapter_name="a")
        latents[setting] = run_cfg(pipe)
        applied = pipe.applied
        assert ("fp8_attention:reference" in applied) == (setting == "auto"), applied
        assert "batched_cfg" in applied and any(label.startswith("step_cache:") for label in applied), applied
    error = rel_rms_error(latents["auto"], latents["off"])
    assert 1e-5 < error < 2e-2, error


@pytest.mark.parametrize("head_dim", [16, 5])  # rows of 48 codes and of 15 (a width no vector load divides)
def test_fp8_output_split_as_its_dequantized_values(head_dim):
    """cuDNN's FP8 output (codes and one scale): the output projections' FP8 operands are its codes with the scale
    on every row, a BF16 projection gets the dequantized values."""
    o8 = (torch.randn(2, 9, 3, head_dim) * 40).clamp(-448, 448).to(FP8_DTYPE)
    scale, width = torch.tensor([0.03]), 3 * head_dim
    (img_q, img_s), txt = block_module.split_attention(o8, 5, True, False, scale)
    assert img_q.dtype == FP8_DTYPE and img_q.is_contiguous()
    assert torch.equal(img_q.view(torch.uint8), o8[:, :5].reshape(10, width).view(torch.uint8))
    assert img_s.shape == (10, 1) and (img_s == scale).all()
    assert torch.equal(txt, (o8[:, 5:].reshape(8, width).float() * scale).to(torch.bfloat16))
    (_, _), (txt_q, _) = block_module.split_attention(o8, 5, True, True, scale)
    assert torch.equal(txt_q.view(torch.uint8), o8[:, 5:].reshape(8, width).view(torch.uint8))


def test_output_scales_need_their_v_scale():
    """o_scales were computed with a v scale: given without it (v measured here, another scale), refused."""
    q8 = (torch.randn(1, 4, 2, 16) * 50).to(FP8_DTYPE)
    one = torch.ones(1)
    with pytest.raises(ValueError, match="o_scales come with the v_scale they were computed with"):
        fp8_attention("reference", q8, q8, torch.randn(1, 4, 2, 16), one, one, torch.tensor([4], dtype=torch.int32),
                      None, torch.bfloat16, (one, one))


def test_reference_masks_padded_keys():
    """fp8_attention_ref: keys past valid_keys never attended (a huge value there changes nothing)."""
    q8, k8, v8 = ((torch.randn(2, 12, 3, 16) * 50).to(FP8_DTYPE) for _ in range(3))
    one, scales = torch.full((1,), 0.02), torch.full((2, 3), 0.05)
    valid = torch.tensor([12, 7], dtype=torch.int32)
    out = fp8_attention_ref(q8, k8, v8, one, one, scales, valid)
    v8[1, 7:] = torch.tensor(448.0).to(FP8_DTYPE)
    assert torch.equal(out, fp8_attention_ref(q8, k8, v8, one, one, scales, valid))


# ---- on a GPU

def kernels_here() -> list[str]:
    return [kernel for kernel in ("cudnn", "fa3") if installed(kernel)]


@pytest.mark.gpu
def test_kernels_against_reference_on_gpu():
    """Each installed kernel on qkv_pack / quantize_fp8_heads operands at the real head shape (24 x 128, B=2, a
    padded prompt) against fp8_attention_ref (the same FP8 operands, fp32 softmax): what is left is the kernels'
    FP8 probabilities (and cuDNN's FP8 output); both far from the BF16 attention's zero."""
    from qwen_image_fast.kernels.qkv_pack import qkv_pack, rms_norm_fp8_scale
    from qwen_image_fast.kernels.quantize_heads import quantize_fp8_heads

    assert kernels_here(), "no FP8 attention package installed (pip install 'qwen-image-fast[fp8-attention]')"
    b, s, h, d = 2, 1100, 24, 128
    g = torch.Generator("cuda").manual_seed(0)
    qkv = torch.randn(b, s, 3 * h * d, generator=g, device="cuda").bfloat16()
    w = (1 + 0.3 * torch.randn(d, generator=g, device="cuda")).bfloat16()
    freqs = torch.view_as_real(torch.polar(torch.ones(s, d // 2, device="cuda"),
                                           torch.rand(s, d // 2, generator=g, device="cuda") * 6))
    q8, k8 = (torch.empty(b, s, h, d, dtype=FP8_DTYPE, device="cuda") for _ in range(2))
    v = torch.empty(b, s, h, d, dtype=torch.bfloat16, device="cuda")
    scales = (rms_norm_fp8_scale([w], d), rms_norm_fp8_scale([w], d))
    qkv_pack(qkv, w, w, freqs, q8, k8, v, 0, qk_scales=scales)
    valid = torch.tensor([s, s - 77], dtype=torch.int32, device="cuda")
    for kernel in kernels_here():
        v8, v_scales = quantize_fp8_heads(v, valid, per_tensor=kernel == "cudnn")
        ref = fp8_attention_ref(q8, k8, v8, *scales, v_scales, valid).float()
        out, o_scale = fp8_attention(kernel, q8, k8, v, *scales, valid)
        out = out.float() * (1 if o_scale is None else o_scale)
        assert 1e-3 < rel_rms_error(out, ref) < 5e-2, (kernel, rel_rms_error(out, ref))


@pytest.mark.gpu
def test_fp8_output_never_past_its_codes_on_gpu():
    """cuDNN's FP8 output where its bound is tightest: every v code at 448 (v = max|v| everywhere, so o = v_max
    exactly; the probabilities' rounding alone moves a row's weights off 1), logits of std ~4 over 1024 keys: a
    row's weight on a handful of keys, whose codes round by up to 2^-4 each. o stays finite within its codes, and
    o * o_scale within e4m3's rounding of v_max. FA3's output is BF16: nothing to bound."""
    if "cudnn" not in kernels_here():
        pytest.skip("nvidia-cudnn-frontend not installed")
    g = torch.Generator("cuda").manual_seed(0)
    b, s, h, d = 2, 1024, 4, 128
    q8, k8 = ((torch.randn(b, s, h, d, generator=g, device="cuda") * 16).clamp(-448, 448).to(FP8_DTYPE)
              for _ in range(2))
    v8 = torch.full((b, s, h, d), 448.0, device="cuda").to(FP8_DTYPE)
    one, v_scale = torch.ones(1, device="cuda") / 8, torch.full((1,), 0.01, device="cuda")
    valid = torch.tensor([s, s - 100], dtype=torch.int32, device="cuda")
    out8, o_scale = fp8_attention("cudnn", q8, k8, v8, one, one, valid, v_scale)
    out = out8.float()
    assert out.isfinite().all() and out.abs().max() <= 448, out.abs().max()
    assert ((out * o_scale - 448 * v_scale) / (448 * v_scale)).abs().max() <= 2**-3, (out * o_scale).aminmax()


@pytest.mark.gpu
def test_transformer_within_its_bound_in_graphs_on_gpu():
    """2 blocks at the real width, bf16, FP8 GEMMs, batched CFG (B=2, a padded prompt), through the runner's CUDA
    graphs: with fp8_attention="auto" the output stays within the option's bound of stock's and the graph replay
    equals the eager forward; `running` names the kernel."""
    from qwen_image_fast.pipelines.core.optimizations import CallRecord
    from qwen_image_fast.pipelines.core.runtime.runner import Runner

    stock = real_width_stock()
    fast = FastQwenImageTransformer.from_diffusers(stock, FastTransformerConfig(fp8_attention="auto"))
    kernel = fast.fp8_attention[0]
    assert kernel == kernels_here()[0] and ("fp8_attention", kernel) in fast.running()
    mask = torch.ones(2, 218, dtype=torch.long, device="cuda")
    mask[1, 150:] = 0
    inputs = dict(hidden_states=torch.randn(2, 4096, 64, device="cuda", dtype=torch.bfloat16),
                  encoder_hidden_states=torch.randn(2, 218, 3584, device="cuda", dtype=torch.bfloat16),
                  encoder_hidden_states_mask=mask, timestep=torch.tensor([0.5, 0.5], device="cuda",
                                                                         dtype=torch.bfloat16),
                  img_shapes=[[(1, 64, 64)]] * 2)
    ref, eager = run(stock, inputs), run(fast, inputs)
    assert rel_rms_error(eager, ref) <= BY_NAME["fp8_attention"].bound.full, rel_rms_error(eager, ref)
    record = CallRecord()
    extra = dict(guidance=None, controlnet_block_samples=None, additional_t_cond=None, modulation=None)
    with Runner().call(fast, record, graphs=True, pair_cfg=False, bucket=1) as call:
        for _ in range(3):  # eager, captured, replayed
            assert_close(call.forward("cond", **inputs, **extra), eager, 1e-6, "graph vs eager")
    assert f"fp8_attention:{kernel}" in record.labels() and "cuda_graphs" in record.labels()
