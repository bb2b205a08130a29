import pytest
import torch
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformerBlock
from helpers import DEVICES, DTYPES, assert_e4m3_codes_match, assert_fp8_precast_matches_ref, assert_matches_ref

from qwen_image_fast.kernels.layer_norm_modulate import (
    layer_norm_modulate,
    layer_norm_modulate_fp8,
    layer_norm_modulate_fp8_ref,
    layer_norm_modulate_ref,
)

SHAPES = [(1, 1, 48), (2, 37, 123), (1, 3, 3072)]  # (B, L, D); 3072 is the DiT width
# The kernel rounds where upstream does (LayerNorm output, 1 + scale, product, sum), but its mean and variance sum in
# another order than torch's layer_norm: a normalized value can round the other way (up to ~2e-4 of them in fp16 /
# bf16 on the CPU; more on the GPU, whose rsqrt is approximate), and `+ shift` can cancel that ulp into several.
BOUNDS = dict(max_ulp=None, max_frac=1e-3, gpu=(None, 1e-2))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def tiny_block(dtype):
    torch.manual_seed(0)
    return QwenImageTransformerBlock(dim=48, num_attention_heads=3, attention_head_dim=16).to(dtype)


def make_inputs(b, l, d, g, dtype, device):
    x = (torch.randn(b, l, d, device=device) * 2 + 0.5).to(dtype)
    x[0, -1] = 0  # a zero row (a padded token's): variance 0, 0 / sqrt(0 + eps) (without eps, NaN)
    mod = (torch.randn(g, 6 * d, device=device) * 0.5).to(dtype)  # [G, 6D] like img_mod's output
    shift, scale = mod[:, :d], mod[:, d : 2 * d]  # strided views, as the transformer passes them
    return x, shift, scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ref_matches_diffusers_block(dtype):
    block = tiny_block(dtype)
    x, shift, scale = make_inputs(2, 5, 48, 2, dtype, "cpu")
    mod1 = torch.cat([shift, scale, torch.randn_like(shift)], dim=-1)  # [B, 3D] = shift, scale, gate
    upstream, _ = block._modulate(block.img_norm1(x), mod1)
    assert torch.equal(layer_norm_modulate_ref(x, shift, scale), upstream)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ref_matches_diffusers_block_zero_cond_t(dtype):
    block = tiny_block(dtype)
    b, l, d = 2, 6, 48
    x, shift, scale = make_inputs(b, l, d, 2 * b, dtype, "cpu")
    mod1 = torch.cat([shift, scale, torch.randn_like(shift)], dim=-1)  # [2B, 3D]: rows B.. are the t=0 ones
    index = torch.tensor([[0] * 4 + [1] * 2, [0] * 3 + [1] * 3])  # [B, L] as diffusers' modulate_index
    upstream, _ = block._modulate(block.img_norm1(x), mod1, index)
    mod_row = (torch.arange(b)[:, None] + b * index).flatten().int()
    assert torch.equal(layer_norm_modulate_ref(x, shift, scale, mod_row=mod_row), upstream)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_ref(device, dtype, shape):
    x, shift, scale = make_inputs(*shape, shape[0], dtype, device)
    out, ref = layer_norm_modulate(x, shift, scale), layer_norm_modulate_ref(x, shift, scale)
    assert_matches_ref(out, ref, f"{shape} {dtype}", **BOUNDS)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_fp8_kernel_matches_ref(device, dtype, shape):
    x, shift, scale = make_inputs(*shape, shape[0], dtype, device)
    q, s = layer_norm_modulate_fp8(x, shift, scale, q_dtype=torch.float32)
    q_ref, s_ref = layer_norm_modulate_fp8_ref(x, shift, scale, q_dtype=torch.float32)
    assert_fp8_precast_matches_ref(q, s, q_ref, s_ref, dtype, f"{shape} {dtype}", **BOUNDS)
    if device == "cuda":  # e4m3 codes only off the interpreter; a flipped activation rarely moves its code
        q8, q8_ref = layer_norm_modulate_fp8(x, shift, scale)[0], layer_norm_modulate_fp8_ref(x, shift, scale)[0]
        assert_e4m3_codes_match(q8, q8_ref, "e4m3")


@pytest.mark.parametrize("device", DEVICES)
def test_mod_row_kernel(device):
    b, l, d = 2, 5, 48
    x, shift, scale = make_inputs(b, l, d, 2 * b, torch.float16, device)
    mod_row = torch.randint(0, 2 * b, (b * l,), device=device, dtype=torch.int32)
    out = layer_norm_modulate(x, shift, scale, mod_row=mod_row)
    assert_matches_ref(out, layer_norm_modulate_ref(x, shift, scale, mod_row=mod_row), "mod_row", **BOUNDS)
    q, s = layer_norm_modulate_fp8(x, shift, scale, mod_row=mod_row, q_dtype=torch.float32)
    q_ref, s_ref = layer_norm_modulate_fp8_ref(x, shift, scale, mod_row=mod_row, q_dtype=torch.float32)
    assert_fp8_precast_matches_ref(q, s, q_ref, s_ref, torch.float16, "mod_row fp8", **BOUNDS)


def test_validation_names_the_value():
    x, shift, scale = make_inputs(2, 3, 48, 2, torch.float32, "cpu")
    with pytest.raises(ValueError, match="its width must equal x's D=48"):
        layer_norm_modulate(x, shift[:, :40], scale)
    with pytest.raises(ValueError, match=r"one per sample \(B=2\)"):
        layer_norm_modulate(x, shift[:1], scale[:1])
    with pytest.raises(ValueError, match="x must have 3 dims"):
        layer_norm_modulate(x[0], shift, scale)
    with pytest.raises(ValueError, match=r"mod_row must have shape \(6,\)"):
        layer_norm_modulate(x, shift, scale, mod_row=torch.zeros(5, dtype=torch.int32))
