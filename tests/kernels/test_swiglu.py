import re

import pytest
import torch
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5MLP

from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21SwiGLUFeedForward
from helpers import (
    DEVICES,
    DTYPES,
    assert_close,
    assert_e4m3_codes_match,
    assert_fp8_precast_matches_ref,
    assert_matches_ref,
    assert_nearly_exact,
)
from qwen_image_fast.kernels.fp8 import quantize_fp8_rowwise_ref
from qwen_image_fast.kernels.swiglu import silu_mul, silu_mul_fp8, silu_mul_fp8_ref, silu_mul_ref

DTYPE_IDS = [str(d).removeprefix("torch.") for d in DTYPES]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def gate_up(lead, i, dtype, device, strided=False) -> torch.Tensor:
    """[*lead, 2I] like a packed GEMM output; strided: a column slice of a wider output, so rows are not packed."""
    t = 3 * torch.randn(*lead, 2 * i + (5 if strided else 0), device=device)
    return t.to(dtype)[..., : 2 * i]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_ref_matches_qwen35_mlp(dtype):
    hidden = inter = 48  # 4096, 12288; equal sizes so down_proj can be the identity
    config = Qwen3_5TextConfig(hidden_size=hidden, intermediate_size=inter)
    mlp = Qwen3_5MLP(config, inter).to(dtype)
    with torch.no_grad():
        mlp.down_proj.weight.copy_(torch.eye(hidden))  # exact: one nonzero term per output
    x = torch.randn(3, 5, hidden).to(dtype)
    gu = torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], dim=-1)  # what one GEMM of [gate_proj; up_proj] yields
    out = silu_mul_ref(gu)
    assert out.dtype == dtype
    assert torch.equal(out, mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))
    assert torch.equal(mlp.down_proj(out), mlp(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_fp8_ref_matches_qwen_image21_feedforward(dtype):
    """silu_mul_fp8_ref quantizes what diffusers' Qwen-Image-2.1 SwiGLU feeds its `out` projection."""
    hidden, inter = 48, 144  # 4096, 12288 (ratio 3)
    ff = QwenImage21SwiGLUFeedForward(hidden, inter).to(dtype)
    x = torch.randn(3, 5, hidden).to(dtype)
    gu = torch.cat([ff.gate_layer(x), ff.proj(x)], dim=-1)  # one GEMM of [gate_layer; proj]
    seen = {}
    handle = ff.out.register_forward_pre_hook(lambda module, args: seen.setdefault("in", args[0]))
    ff(x)
    handle.remove()
    q_ref, s_ref = quantize_fp8_rowwise_ref(seen["in"].reshape(-1, inter), torch.float32)
    q, s = silu_mul_fp8_ref(gu, torch.float32)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)


@pytest.mark.parametrize("lead, i, strided", [((1,), 37, False), ((5,), 123, True), ((2, 3), 1000, True),
                                             ((9,), 9000, True), ((2,), 16000, False)],
                         ids=["M1-I37", "M5-I123-strided", "2x3-I1000-strided", "M9-I9000-3chunks-strided",
                              "M2-I16000-4chunks"])  # 9 rows: several programs under the interpreter too
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("device", DEVICES)
def test_silu_mul_fp8_matches_ref(device, dtype, lead, i, strided):
    x = gate_up(lead, i, dtype, device, strided)
    q, s = silu_mul_fp8(x, torch.float32)
    assert q.shape == (x[..., 0].numel(), i) and s.shape == (q.shape[0], 1)
    q_ref, s_ref = silu_mul_fp8_ref(x, torch.float32)
    # a flipped rounding of silu(gate) moves the product by up to 2 ulp (test_silu_mul_matches_ref)
    assert_fp8_precast_matches_ref(q, s, q_ref, s_ref, dtype, f"silu_mul_fp8 {lead} I={i}", max_ulp=2.0,
                                   max_frac=1e-2, gpu=(2.0, 1e-2))
    if device == "cuda":  # e4m3 codes only off the interpreter
        assert_e4m3_codes_match(silu_mul_fp8(x)[0], silu_mul_fp8_ref(x)[0], "e4m3")


@pytest.mark.gpu
def test_silu_mul_fp8_real_width_gpu():
    x = gate_up((4096,), 12288, torch.bfloat16, "cuda", strided=True)  # Qwen-Image-2.1: 4096 x 3
    q, s = silu_mul_fp8(x, torch.float32)
    assert_fp8_precast_matches_ref(q, s, *silu_mul_fp8_ref(x, torch.float32), torch.bfloat16, "real width",
                                   max_ulp=2.0, max_frac=1e-2, gpu=(2.0, 1e-2))


@pytest.mark.parametrize(
    "lead, i, strided",
    [((1,), 37, False), ((5,), 37, True), ((2, 3), 1000, True), ((3,), 1536, False)],
    ids=["M1-I37", "M5-I37-strided", "2x3-I1000-strided", "M3-I1536-two-blocks"],
)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("device", DEVICES)
def test_silu_mul_matches_ref(device, dtype, lead, i, strided):
    x = gate_up(lead, i, dtype, device, strided)
    out = silu_mul(x)
    assert out.shape == (*lead, i) and out.is_contiguous()
    # silu and the product each round (round_to, exact under the interpreter too); a silu whose fp32 exp differs from
    # torch's by an ulp can round the other way, and moves the product by up to |up| ulp of silu: 2 ulp of y
    assert_matches_ref(out, silu_mul_ref(x), f"silu_mul {lead} I={i}", max_ulp=2.0)


@pytest.mark.parametrize("m", [1, 7, 4096])  # decode, a few rows, a prefill
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.gpu
def test_silu_mul_real_width_gpu(dtype, m):
    x = gate_up((m,), 12288, dtype, "cuda", strided=True)  # Qwen3.5-9B intermediate_size
    # a flipped rounding of silu(gate) moves the product by |up| ulp(silu): up to 2 ulp of the output
    assert_nearly_exact(silu_mul(x), silu_mul_ref(x), f"silu_mul M={m}", max_ulp=2)


def test_silu_mul_validation():
    with pytest.raises(ValueError, match=re.escape("even last dim, got shape (2, 7)")):
        silu_mul(torch.randn(2, 7))
    with pytest.raises(ValueError, match="gate_up has dtype torch.int32"):
        silu_mul(torch.ones(2, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="contiguous in its last dim"):
        silu_mul(torch.randn(8, 2).t())
    assert silu_mul(torch.randn(0, 8)).shape == (0, 4)
    assert silu_mul_fp8(torch.randn(0, 8))[0].shape == (0, 4)
    with pytest.raises(ValueError, match=re.escape("gate_up has shape (3, 0): a row needs at least one column")):
        silu_mul_fp8(torch.randn(3, 0))


@pytest.mark.parametrize("i", [9000, 12288, 16000])
def test_silu_mul_fp8_row_amax_spans_every_chunk(i):
    """Row r's largest product sits in chunk r (rows wider than 8192 run as up to four 4096-column chunks)."""
    x = gate_up((4,), i, torch.float32, "cpu")
    for r, col in enumerate([5, 4100, 8200, i - 1]):
        x[r, col] = x[r, i + col] = 9.0
    q, s = silu_mul_fp8(x, torch.float32)
    q_ref, s_ref = silu_mul_fp8_ref(x, torch.float32)
    assert_close(s, s_ref, 1e-6)
    assert_close(q * s, q_ref * s_ref, 1e-5)
