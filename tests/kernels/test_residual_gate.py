import pytest
import torch
from helpers import DEVICES, DTYPES, TOL, assert_close

from qwen_image_fast.kernels.residual_gate import (
    residual_gate,
    residual_gate_layer_norm_modulate,
    residual_gate_layer_norm_modulate_fp8,
    residual_gate_layer_norm_modulate_fp8_ref,
    residual_gate_layer_norm_modulate_ref,
    residual_gate_ref,
)

SHAPES = [(1, 1, 48), (2, 37, 123), (1, 3, 3072)]


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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_residual_gate(device, dtype, shape):
    residual, x, gate, _, _ = make_inputs(*shape, dtype, device)
    assert_close(residual_gate(residual, x, gate), residual_gate_ref(residual, x, gate), TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_norm(device, dtype, shape):
    args = make_inputs(*shape, dtype, device)
    r, y = residual_gate_layer_norm_modulate(*args)
    r_ref, y_ref = residual_gate_layer_norm_modulate_ref(*args)
    assert_close(r, r_ref, TOL[dtype], "residual")
    assert_close(y, y_ref, TOL[dtype], "modulated")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_norm_fp8(device, dtype, shape):
    args = make_inputs(*shape, dtype, device)
    r, q, s = residual_gate_layer_norm_modulate_fp8(*args, q_dtype=torch.float32)
    r_ref, q_ref, s_ref = residual_gate_layer_norm_modulate_fp8_ref(*args, q_dtype=torch.float32)
    assert_close(r, r_ref, TOL[dtype], "residual")
    assert_close(s, s_ref, TOL[dtype], "scale")
    assert_close(q, q_ref, TOL[dtype], "pre-cast values")
    if device == "cuda":
        _, q8, s8 = residual_gate_layer_norm_modulate_fp8(*args)
        assert_close(q8.float() * s8, q_ref * s_ref, 4e-2, "dequantized e4m3")


@pytest.mark.parametrize("device", DEVICES)
def test_mod_row(device):
    b, l, d = 2, 5, 48
    args = make_inputs(b, l, d, torch.float32, device, g=2 * b)
    mod_row = torch.randint(0, 2 * b, (b * l,), device=device, dtype=torch.int32)
    assert_close(residual_gate(*args[:3], mod_row=mod_row), residual_gate_ref(*args[:3], mod_row=mod_row), 1e-6)
    r, y = residual_gate_layer_norm_modulate(*args, mod_row=mod_row)
    r_ref, y_ref = residual_gate_layer_norm_modulate_ref(*args, mod_row=mod_row)
    assert_close(y, y_ref, TOL[torch.float32])


def test_validation_names_the_value():
    residual, x, gate, shift, scale = make_inputs(2, 3, 48, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"x must have shape \(2, 3, 48\)"):
        residual_gate(residual, x[:, :2], gate)
    with pytest.raises(ValueError, match="x has dtype torch.bfloat16"):
        residual_gate(residual, x.bfloat16(), gate)
    with pytest.raises(ValueError, match="shift has 1 rows"):
        residual_gate_layer_norm_modulate(residual, x, gate, shift[:1], scale)
