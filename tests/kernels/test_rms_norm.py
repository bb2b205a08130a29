import os
import re

import pytest
import torch
from diffusers.models.normalization import RMSNorm
from helpers import DTYPES, assert_matches_ref
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm, Qwen3_5RMSNormGated

from qwen_image_fast.kernels.rms_norm import (
    add_rms_norm,
    add_rms_norm_ref,
    gated_rms_norm,
    gated_rms_norm_ref,
    rms_norm,
    rms_norm_ref,
)

# CPU tensors run only in Triton's interpreter, which conftest turns on where there is no GPU.
_NOT_INTERPRETING = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
DEVICES = [pytest.param("cpu", marks=_NOT_INTERPRETING), pytest.param("cuda", marks=pytest.mark.gpu)]
DTYPE_IDS = [str(d).removeprefix("torch.") for d in DTYPES]
EPS = 1e-6
# (leading shape, N, strided rows): M=1, an odd width, rows sliced from a wider tensor, 3-D input
SHAPES = [((1,), 123, False), ((5,), 123, True), ((2, 3), 64, True)]
SHAPE_IDS = ["M1-N123", "M5-N123-strided", "2x3-N64-strided"]


def check(out, ref, what):
    """Rounded where upstream rounds; rstd's sum runs in another order (on the GPU also through an approximate
    rsqrt), so a normalized value can round the other way, and `* w` carry that ulp into up to 2 of the output;
    the gated form's `* silu(gate)` can move the product to a lower binade, where it spans 3 (measured on an H200,
    fp16). The last step is a plain cast: under the interpreter bf16 truncates there (assert_truncated)."""
    assert_matches_ref(out, ref, what, max_ulp=2.0, max_frac=1e-3, gpu=(3.0, 1e-2), truncating_store=True)


def check_residual(out, ref, what):
    """x + residual: one rounding (round_to, exact under the interpreter too), bit-equal (fp32 included)."""
    assert torch.equal(out, ref), what


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def rows(lead: tuple, device: str) -> tuple:
    """The GPU runs many rows; the interpreter a few (it is slow). M=1 stays M=1."""
    return lead if device == "cpu" or lead == (1,) else (4096, *lead[1:])


def randn(lead, n, dtype, device, strided=False) -> torch.Tensor:
    """Random normal [*lead, n]; strided: a slice of a wider tensor, so rows are not packed."""
    t = 2 * torch.randn(*lead, n + 17 if strided else n, device=device)
    return t.to(dtype)[..., :n]


def weight(n, dtype, device, zero_centered=False) -> torch.Tensor:
    """Random weights around 1 (around 0 for the zero-centred (1 + w) convention)."""
    w = 0.5 * torch.randn(n, device=device)
    return (w if zero_centered else 1 + w).to(dtype)


def upstream(module: torch.nn.Module, w: torch.Tensor) -> torch.nn.Module:
    with torch.no_grad():
        module.weight.copy_(w.float())
    return module.to(w.dtype)


# Hop 1: each reference against the module it mirrors, bit-exact.


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rms_norm_ref_matches_diffusers_rmsnorm(dtype):
    x, w = randn((3, 5), 128, dtype, "cpu"), weight(128, dtype, "cpu")
    expected = upstream(RMSNorm(128, eps=EPS), w)(x)
    out = rms_norm_ref(x, w, EPS)
    assert out.dtype == expected.dtype == dtype
    assert torch.equal(out, expected)


@pytest.mark.parametrize("w_fp32", [False, True], ids=["w-x-dtype", "w-fp32"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rms_norm_ref_matches_qwen35_rmsnorm(dtype, w_fp32):
    x = randn((3, 5), 256, dtype, "cpu")
    w = weight(256, torch.float32 if w_fp32 else dtype, "cpu", zero_centered=True)
    expected = upstream(Qwen3_5RMSNorm(256, eps=EPS), w)(x)
    out = rms_norm_ref(x, w, EPS, zero_centered=True)
    assert out.dtype == expected.dtype == dtype
    assert torch.equal(out, expected)


@pytest.mark.parametrize("zero_centered", [False, True], ids=["diffusers", "qwen35"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_add_rms_norm_ref_matches_decoder_layer_add(dtype, zero_centered):
    x, residual = randn((3, 5), 256, dtype, "cpu"), randn((3, 5), 256, dtype, "cpu")
    w = weight(256, dtype, "cpu", zero_centered)
    norm = Qwen3_5RMSNorm(256, eps=EPS) if zero_centered else RMSNorm(256, eps=EPS)
    expected_residual = residual + x  # what Qwen3_5DecoderLayer does before post_attention_layernorm
    expected = upstream(norm, w)(expected_residual)
    out, residual_out = add_rms_norm_ref(x, residual, w, EPS, zero_centered)
    assert out.dtype == residual_out.dtype == dtype
    assert torch.equal(residual_out, expected_residual)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gated_rms_norm_ref_matches_qwen35_gated(dtype):
    x, gate, w = randn((3, 5), 128, dtype, "cpu"), randn((3, 5), 128, dtype, "cpu"), weight(128, dtype, "cpu")
    expected = upstream(Qwen3_5RMSNormGated(128, eps=EPS), w)(x, gate)
    out = gated_rms_norm_ref(x, gate, w, EPS)
    assert out.dtype == expected.dtype == dtype
    assert torch.equal(out, expected)


# Hop 2: each kernel against its reference (interpreter on the CPU, the real GPU with -m gpu).


@pytest.mark.parametrize("lead, n, strided", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("zero_centered", [False, True], ids=["diffusers", "qwen35"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("device", DEVICES)
def test_rms_norm_kernel(device, dtype, zero_centered, lead, n, strided):
    x = randn(rows(lead, device), n, dtype, device, strided)
    if x.shape[0] > 1:  # a row where eps is all of the mean square (0 * rsqrt(0 + eps)): without eps, NaN
        x[-1] = 0
    w = weight(n, dtype, device, zero_centered)
    check(rms_norm(x, w, EPS, zero_centered), rms_norm_ref(x, w, EPS, zero_centered), "y")


@pytest.mark.parametrize("lead, n, strided", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("zero_centered", [False, True], ids=["diffusers", "qwen35"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("device", DEVICES)
def test_add_rms_norm_kernel(device, dtype, zero_centered, lead, n, strided):
    x = randn(rows(lead, device), n, dtype, device, strided)
    residual = randn(rows(lead, device), n, dtype, device)
    w = weight(n, dtype, device, zero_centered)
    y, residual_out = add_rms_norm(x, residual, w, EPS, zero_centered)
    y_ref, residual_ref = add_rms_norm_ref(x, residual, w, EPS, zero_centered)
    check_residual(residual_out, residual_ref, "residual_out")
    check(y, y_ref, "y")


@pytest.mark.parametrize("lead, n, strided", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("device", DEVICES)
def test_gated_rms_norm_kernel(device, dtype, lead, n, strided):
    x = randn(rows(lead, device), n, dtype, device, strided)
    gate = randn(rows(lead, device), n, dtype, device, strided)
    w = weight(n, dtype, device)
    check(gated_rms_norm(x, gate, w, EPS), gated_rms_norm_ref(x, gate, w, EPS), "y")


@pytest.mark.parametrize("device", DEVICES)
def test_fp32_weight_and_gate_with_bf16_x(device):
    x = randn(rows((4,), device), 128, torch.bfloat16, device)
    gate = randn(rows((4,), device), 128, torch.float32, device)
    w, w0 = weight(128, torch.float32, device), weight(128, torch.float32, device, zero_centered=True)
    check(gated_rms_norm(x, gate, w, EPS), gated_rms_norm_ref(x, gate, w, EPS), "gated")
    check(rms_norm(x, w0, EPS, True), rms_norm_ref(x, w0, EPS, True), "zero-centred")


# Real widths, few rows on the CPU: DiT QK-norm (head_dim 128) and txt_norm (3584); Qwen3.5 hidden 4096,
# attention q/k-norm (head_dim 256), Gated-DeltaNet output norm (value head_dim 128).
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("device", DEVICES)
def test_real_widths(device, dtype):
    for n in (128, 3584):
        x, w = randn(rows((4,), device), n, dtype, device), weight(n, dtype, device)
        check(rms_norm(x, w, EPS), rms_norm_ref(x, w, EPS), f"diffusers N={n}")
    for n in (4096, 256):
        x, r = randn(rows((4,), device), n, dtype, device), randn(rows((4,), device), n, dtype, device)
        w = weight(n, dtype, device, zero_centered=True)
        y, r_out = add_rms_norm(x, r, w, EPS, zero_centered=True)
        y_ref, r_ref = add_rms_norm_ref(x, r, w, EPS, zero_centered=True)
        check_residual(r_out, r_ref, f"qwen35 residual N={n}")
        check(y, y_ref, f"qwen35 N={n}")
    x, gate = randn(rows((2, 4), device), 128, dtype, device), randn(rows((2, 4), device), 128, dtype, device)
    w = weight(128, dtype, device)
    check(gated_rms_norm(x, gate, w, EPS), gated_rms_norm_ref(x, gate, w, EPS), "gated N=128")


@pytest.mark.parametrize("device", DEVICES)
def test_empty_rows(device):
    x, w = torch.randn(0, 64, device=device), torch.ones(64, device=device)
    assert rms_norm(x, w).shape == (0, 64)
    y, residual_out = add_rms_norm(x, x, w, zero_centered=True)
    assert y.shape == residual_out.shape == (0, 64)
    assert gated_rms_norm(x, x, w).shape == (0, 64)


# Validation: the message names the bad value and what is allowed.

_X = torch.randn(2, 64, dtype=torch.bfloat16)
_W = torch.ones(64, dtype=torch.bfloat16)
BAD_CALLS = [
    (lambda: rms_norm(_X, torch.ones(65, dtype=torch.bfloat16)), "weight must have shape (64,), got (65,)"),
    (lambda: gated_rms_norm(_X, _X, _W[:63]), "weight must have shape (64,), got (63,)"),
    (lambda: rms_norm(_X, _W.float()), "weight has dtype torch.float32; with zero_centered=False"),
    (lambda: rms_norm(_X, _W.half(), zero_centered=True),
     "weight has dtype torch.float16; allowed: torch.bfloat16, torch.float32"),
    (lambda: rms_norm(_X.int(), _W), "x has dtype torch.int32; allowed"),
    (lambda: rms_norm(_X.t(), _W), "x must be contiguous in its last dim"),
    (lambda: add_rms_norm(_X, _X.float(), _W), "residual has dtype torch.float32; allowed: torch.bfloat16"),
    (lambda: add_rms_norm(_X, _X[:1], _W), "residual must have shape (2, 64), got (1, 64)"),
    (lambda: gated_rms_norm(_X, _X[:, :32], _W), "gate must have shape (2, 64), got (2, 32)"),
]
BAD_IDS = ["weight-width", "gated-weight-width", "diffusers-weight-dtype", "qwen35-weight-dtype", "x-dtype",
           "x-last-dim-strided", "residual-dtype", "residual-shape", "gate-shape"]


@pytest.mark.parametrize("call, message", BAD_CALLS, ids=BAD_IDS)
def test_validation_errors(call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call()


@pytest.mark.gpu
def test_weight_on_another_device_raises():
    x = torch.randn(2, 64, device="cuda")
    with pytest.raises(ValueError, match=re.escape("weight is on cpu, expected cuda:0")):
        rms_norm(x, torch.ones(64))
