import math

import pytest
import torch
from diffusers.hooks.taylorseer_cache import TaylorSeerState
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformerBlock
from helpers import (
    DEVICES,
    DTYPES,
    FP32_TOL,
    assert_close,
    assert_e4m3_codes_match,
    assert_fp8_precast_matches_ref,
    assert_matches_ref,
    ulp_error,
)

from qwen_image_fast.kernels.fp8 import dequantize_fp8_rowwise, quantize_fp8_rowwise_ref
from qwen_image_fast.kernels.residual_gate import (
    residual_gate,
    residual_gate_layer_norm_modulate,
    residual_gate_layer_norm_modulate_fp8,
    residual_gate_layer_norm_modulate_fp8_ref,
    residual_gate_layer_norm_modulate_ref,
    residual_gate_ref,
)

SHAPES = [(1, 1, 48), (2, 37, 123), (1, 3, 3072)]
# e4m3 keeps 3 mantissa bits: a rounding error of at most 2^-4 relative, ~2.5% RMS on normal data.
FP8_TOL = 4e-2


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def make_inputs(b, l, d, dtype, device, g=None):
    residual = (torch.randn(b, l, d, device=device) * 4).to(dtype)
    x = torch.randn(b, l, d, device=device).to(dtype)
    mod = (torch.randn(g or b, 6 * d, device=device) * 0.5).to(dtype)
    gate, shift, scale = mod[:, 2 * d : 3 * d], mod[:, 3 * d : 4 * d], mod[:, 4 * d : 5 * d]  # strided views
    return residual, x, gate, shift, scale


def tiny_block(dtype, zero_cond_t):
    torch.manual_seed(0)
    block = QwenImageTransformerBlock(dim=48,  # 3072
                                      num_attention_heads=3,  # 24
                                      attention_head_dim=16,  # 128
                                      zero_cond_t=zero_cond_t)
    return block.to(dtype).eval()


def run_block(block, x, txt, temb, modulate_index):
    """The block's own forward on image tokens x [B, L, D] and text tokens txt; returns its output image residual
    and, captured with hooks, what its image stream computed on the way: img_mod's output [G, 6D] (shift, scale,
    gate of norm1, then of norm2), the attention output, the residual after the attention (img_norm2's input), the
    modulated norm2 output (img_mlp's input) and the MLP output."""
    seen = {}
    hooks = [
        block.img_mod.register_forward_hook(lambda m, args, out: seen.update(mod=out)),
        block.attn.register_forward_hook(lambda m, args, out: seen.update(attn_output=out[0])),  # (image, text)
        block.img_norm2.register_forward_pre_hook(lambda m, args: seen.update(residual1=args[0])),
        block.img_mlp.register_forward_pre_hook(lambda m, args: seen.update(modulated2=args[0])),
        block.img_mlp.register_forward_hook(lambda m, args, out: seen.update(mlp_output=out)),
    ]
    with torch.no_grad():
        _, out = block(x, txt, None, temb, modulate_index=modulate_index)  # returns (text, image)
    for hook in hooks:
        hook.remove()
    return out, seen


@pytest.mark.parametrize("zero_cond_t", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_refs_match_diffusers_block(dtype, zero_cond_t):
    """The references against what QwenImageTransformerBlock.forward computes, with its own img_mod's gates, shifts
    and scales: after the attention, `hidden_states + img_gate1 * img_attn_output` then img_norm2 and _modulate;
    after the MLP, `hidden_states + img_gate2 * img_mlp_output`. Bit-equal: the same ops in the same dtype."""
    b, l, d = 2, 6, 48
    block = tiny_block(dtype, zero_cond_t)
    x = (torch.randn(b, l, d) * 4).to(dtype)
    txt = torch.randn(b, 3, d).to(dtype)
    mod_row, index = None, None
    if zero_cond_t:  # temb [2B, D]: rows B.. are the t=0 ones, which a condition image's tokens (index 1) use
        index = torch.tensor([[0] * 4 + [1] * 2, [0] * 3 + [1] * 3])  # [B, L] as diffusers' modulate_index
        mod_row = (torch.arange(b)[:, None] + b * index).flatten().int()
    temb = torch.randn(2 * b if zero_cond_t else b, d).to(dtype)
    out, seen = run_block(block, x, txt, temb, index)
    mod = seen["mod"]  # [G, 6D]; the kernels take strided views of it, as the transformer passes them
    gate1, shift2, scale2, gate2 = mod[:, 2 * d : 3 * d], mod[:, 3 * d : 4 * d], mod[:, 4 * d : 5 * d], mod[:, 5 * d :]

    residual1 = residual_gate_ref(x, seen["attn_output"], gate1, mod_row=mod_row)
    assert torch.equal(residual1, seen["residual1"]), "residual after the attention"
    r, y = residual_gate_layer_norm_modulate_ref(x, seen["attn_output"], gate1, shift2, scale2, mod_row=mod_row)
    assert torch.equal(r, seen["residual1"]), "fused: residual"
    assert torch.equal(y, seen["modulated2"]), "fused: norm2 + modulation"
    assert torch.equal(residual_gate_ref(seen["residual1"], seen["mlp_output"], gate2, mod_row=mod_row), out), (
        "residual after the MLP (the block's output)")

    # FP8: [B*L, D] rows of the modulated output, e4m3 codes and scales exactly those of what img_mlp got
    r, q, s = residual_gate_layer_norm_modulate_fp8_ref(x, seen["attn_output"], gate1, shift2, scale2, mod_row=mod_row)
    rows = seen["modulated2"].reshape(-1, d)
    q_expected, s_expected = quantize_fp8_rowwise_ref(rows)
    assert torch.equal(r, seen["residual1"]), "fp8: residual"
    assert torch.equal(q.view(torch.uint8), q_expected.view(torch.uint8)) and torch.equal(s, s_expected), "fp8"
    assert_close(dequantize_fp8_rowwise(q, s), rows.float(), FP8_TOL, "fp8: dequantized")


def assert_exact(out, ref, what=""):
    """residual + gate * x, two roundings of upstream's (round_to, exact under the interpreter too) and no reduction:
    bit-equal, except fp32 on the GPU, which contracts the two into one FMA."""
    if out.device.type == "cuda" and out.dtype == torch.float32:
        assert_close(out, ref, FP32_TOL, what)
    else:
        assert torch.equal(out, ref), f"{what}: max {ulp_error(out, ref).max().item():.2f} ulp"


# The modulated output follows a LayerNorm, whose mean and variance sum in another order than torch's: a normalized
# value can round the other way (up to ~2e-4 of them in fp16 / bf16 on the CPU; more on the GPU, whose rsqrt is
# approximate), and `+ shift` can cancel that ulp into several of the output.
Y_BOUNDS = dict(max_ulp=None, max_frac=1e-3, gpu=(None, 1e-2))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_residual_gate(device, dtype, shape):
    residual, x, gate, _, _ = make_inputs(*shape, dtype, device)
    assert_exact(residual_gate(residual, x, gate), residual_gate_ref(residual, x, gate), f"{shape} {dtype}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_norm(device, dtype, shape):
    args = make_inputs(*shape, dtype, device)
    r, y = residual_gate_layer_norm_modulate(*args)
    r_ref, y_ref = residual_gate_layer_norm_modulate_ref(*args)
    assert_exact(r, r_ref, "residual")
    assert_matches_ref(y, y_ref, "modulated", **Y_BOUNDS)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_norm_fp8(device, dtype, shape):
    args = make_inputs(*shape, dtype, device)
    r, q, s = residual_gate_layer_norm_modulate_fp8(*args, q_dtype=torch.float32)
    r_ref, q_ref, s_ref = residual_gate_layer_norm_modulate_fp8_ref(*args, q_dtype=torch.float32)
    assert_exact(r, r_ref, "residual")
    assert_fp8_precast_matches_ref(q, s, q_ref, s_ref, dtype, "fp8", **Y_BOUNDS)
    if device == "cuda":  # e4m3 codes only off the interpreter; a flipped activation rarely moves its code
        q8, q8_ref = residual_gate_layer_norm_modulate_fp8(*args)[1], residual_gate_layer_norm_modulate_fp8_ref(*args)
        assert_e4m3_codes_match(q8, q8_ref[1], "e4m3")


@pytest.mark.parametrize("device", DEVICES)
def test_mod_row(device):
    b, l, d = 2, 5, 48
    args = make_inputs(b, l, d, torch.float16, device, g=2 * b)
    mod_row = torch.randint(0, 2 * b, (b * l,), device=device, dtype=torch.int32)
    assert_exact(residual_gate(*args[:3], mod_row=mod_row), residual_gate_ref(*args[:3], mod_row=mod_row))
    r, y = residual_gate_layer_norm_modulate(*args, mod_row=mod_row)
    r_ref, y_ref = residual_gate_layer_norm_modulate_ref(*args, mod_row=mod_row)
    assert_exact(r, r_ref, "residual")
    assert_matches_ref(y, y_ref, "modulated", **Y_BOUNDS)


@pytest.mark.parametrize("max_order", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_x_term_ref_matches_diffusers_taylorseer(dtype, max_order):
    """x_term=(f, c) as the last term of diffusers' TaylorSeerState.predict: its output is `x + f * c` with x the
    sum of the lower orders, the same tensor in the same dtype. The state's factors from updates at steps 0, 2 and
    3, predicted at step 6 (offset 3: c = 3^j / j!)."""
    b, l, d = 2, 5, 48
    state = TaylorSeerState(taylor_factors_dtype=dtype, max_order=max_order)
    for step in (0, 2, 3):
        state.current_step = step
        state.update(((torch.randn(b, l, d) * 2).to(dtype),))
    state.current_step = 6
    predicted = state.predict()[0]
    factors = state.taylor_factors[0]
    assert len(factors) == max_order + 1
    lower = factors[0] if max_order == 1 else factors[0] + factors[1] * 3.0  # orders below the last, as predict sums
    coef = torch.tensor([3.0 ** max_order / math.factorial(max_order)])
    residual, _, gate, _, _ = make_inputs(b, l, d, dtype, "cpu")
    assert torch.equal(residual_gate_ref(residual, lower, gate, x_term=(factors[max_order], coef)),
                       residual_gate_ref(residual, predicted, gate))


def with_extras(args, prior: bool, term: bool, g=None) -> dict:
    """prior / x_term keyword arguments for make_inputs' tensors: a pending gated add (its own gate, a strided view
    of another modulation table) and a Taylor-like term with a device scalar coefficient."""
    residual = args[0]
    b, l, d = residual.shape
    extras = {}
    if prior:
        mod = (torch.randn(g or b, 6 * d, device=residual.device) * 0.5).to(residual.dtype)
        extras["prior"] = ((torch.randn(b, l, d, device=residual.device) * 2).to(residual.dtype), mod[:, 5 * d:])
    if term:
        extras["x_term"] = ((torch.randn(b, l, d, device=residual.device) * 0.3).to(residual.dtype),
                            torch.tensor([2.5], device=residual.device))
    return extras


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("prior,term", [(True, False), (False, True), (True, True)])
def test_prior_and_x_term(device, dtype, shape, prior, term):
    """The optional pending gated add and the term on x, in each form of the kernel, against the references."""
    args = make_inputs(*shape, dtype, device)
    extras = with_extras(args, prior, term)
    assert_exact(residual_gate(*args[:3], **extras), residual_gate_ref(*args[:3], **extras), "residual_gate")
    r, y = residual_gate_layer_norm_modulate(*args, **extras)
    r_ref, y_ref = residual_gate_layer_norm_modulate_ref(*args, **extras)
    assert_exact(r, r_ref, "fused: residual")
    assert_matches_ref(y, y_ref, "fused: modulated", **Y_BOUNDS)
    r, q, s = residual_gate_layer_norm_modulate_fp8(*args, q_dtype=torch.float32, **extras)
    r_ref, q_ref, s_ref = residual_gate_layer_norm_modulate_fp8_ref(*args, q_dtype=torch.float32, **extras)
    assert_exact(r, r_ref, "fp8: residual")
    assert_fp8_precast_matches_ref(q, s, q_ref, s_ref, dtype, "fp8", **Y_BOUNDS)


@pytest.mark.parametrize("device", DEVICES)
def test_prior_and_x_term_mod_row(device):
    b, l, d = 2, 5, 48
    args = make_inputs(b, l, d, torch.bfloat16, device, g=2 * b)
    mod_row = torch.randint(0, 2 * b, (b * l,), device=device, dtype=torch.int32)
    extras = with_extras(args, True, True, g=2 * b)
    r, y = residual_gate_layer_norm_modulate(*args, mod_row=mod_row, **extras)
    r_ref, y_ref = residual_gate_layer_norm_modulate_ref(*args, mod_row=mod_row, **extras)
    assert_exact(r, r_ref, "residual")
    assert_matches_ref(y, y_ref, "modulated", **Y_BOUNDS)


def test_validation_names_the_value():
    residual, x, gate, shift, scale = make_inputs(2, 3, 48, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"x must have shape \(2, 3, 48\)"):
        residual_gate(residual, x[:, :2], gate)
    with pytest.raises(ValueError, match="x has dtype torch.bfloat16"):
        residual_gate(residual, x.bfloat16(), gate)
    with pytest.raises(ValueError, match="shift has 1 rows"):
        residual_gate_layer_norm_modulate(residual, x, gate, shift[:1], scale)
    with pytest.raises(ValueError, match=r"x_term\[0\] has dtype torch.bfloat16"):
        residual_gate(residual, x, gate, x_term=(x.bfloat16(), torch.ones(1)))
    with pytest.raises(ValueError, match=r"x_term\[1\] must have shape \(1,\), got \(\)"):
        residual_gate(residual, x, gate, x_term=(x, torch.tensor(1.0)))
    with pytest.raises(ValueError, match=r"prior\[1\] has 1 rows"):
        residual_gate(residual, x, gate, prior=(x, gate[:1]))
