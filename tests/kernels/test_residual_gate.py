import pytest
import torch
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

from qwen_image_fast.kernels.residual_gate import (
    residual_gate,
    residual_gate_layer_norm_modulate,
    residual_gate_layer_norm_modulate_fp8,
    residual_gate_layer_norm_modulate_fp8_ref,
    residual_gate_layer_norm_modulate_ref,
    residual_gate_ref,
)

SHAPES = [(1, 1, 48), (2, 37, 123), (1, 3, 3072)]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def make_inputs(b, l, d, dtype, device, g=None):
    residual = (torch.randn(b, l, d, device=device) * 4).to(dtype)
    x = torch.randn(b, l, d, device=device).to(dtype)
    mod = (torch.randn(g or b, 6 * d, device=device) * 0.5).to(dtype)
    gate, shift, scale = mod[:, 2 * d : 3 * d], mod[:, 3 * d : 4 * d], mod[:, 4 * d : 5 * d]  # strided views
    return residual, x, gate, shift, scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ref_matches_diffusers_expression(dtype):
    residual, x, gate, _, _ = make_inputs(2, 5, 48, dtype, "cpu")
    # QwenImageTransformerBlock: `hidden_states = hidden_states + img_gate1 * img_attn_output`, gate [B, 1, D]
    assert torch.equal(residual_gate_ref(residual, x, gate), residual + gate.unsqueeze(1) * x)


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


def test_validation_names_the_value():
    residual, x, gate, shift, scale = make_inputs(2, 3, 48, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"x must have shape \(2, 3, 48\)"):
        residual_gate(residual, x[:, :2], gate)
    with pytest.raises(ValueError, match="x has dtype torch.bfloat16"):
        residual_gate(residual, x.bfloat16(), gate)
    with pytest.raises(ValueError, match="shift has 1 rows"):
        residual_gate_layer_norm_modulate(residual, x, gate, shift[:1], scale)
