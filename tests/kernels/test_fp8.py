import pytest
import torch
import triton
from helpers import DEVICES, FP32_TOL, assert_close, assert_matches_ref

from qwen_image_fast.kernels import fp8
from qwen_image_fast.kernels._utils import (
    CHUNKED_MIN_COLS, FP8_AMAX_EPS, FP8_DTYPE, FP8_MAX, MAX_CHUNKS, chunked_rows_launch,
)
from qwen_image_fast.kernels.fp8 import (
    FAST_ACCUM_MIN_ROWS,
    dequantize_fp8_rowwise,
    fp8_linear,
    fp8_linear_ref,
    pad_fp8_rows,
    pad_fp8_rows_ref,
    quantize_fp8_rowwise,
    quantize_fp8_rowwise_ref,
    scaled_mm_cpu,
)

# e4m3 keeps 3 mantissa bits: a rounding error of at most 2^-4 relative, ~2.5% RMS on normal data.
FP8_TOL = 4e-2


def test_ref_roundtrip_within_e4m3_precision():
    x = torch.randn(64, 300, dtype=torch.float64).float() * torch.logspace(-3, 3, 64)[:, None]
    q, s = quantize_fp8_rowwise_ref(x)
    assert q.dtype == FP8_DTYPE and s.shape == (64, 1)
    assert_close(dequantize_fp8_rowwise(q, s), x, FP8_TOL, "dequant(quant(x))")
    # each row's largest magnitude maps to +-448 (up to the fp32 rounding of amax / (amax / 448))
    pre, _ = quantize_fp8_rowwise_ref(x, torch.float32)
    torch.testing.assert_close(pre.abs().amax(-1), torch.full((64,), FP8_MAX), rtol=1e-6, atol=0)


def test_ref_zero_row_has_finite_scale():
    q, s = quantize_fp8_rowwise_ref(torch.zeros(2, 16))
    assert torch.isfinite(s).all() and (s > 0).all() and (q.float() == 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 48), (7, 123), (3, 3072)])
def test_quantize_kernel_matches_ref(device, dtype, shape):
    x = (torch.randn(shape, device=device) * 3).to(dtype)
    if shape[0] > 1:
        x[-1] = 0  # an all-zero row (a padded token's): scale FP8_AMAX_EPS / 448, codes 0, no NaN
    q, s = quantize_fp8_rowwise(x, torch.float32)
    if shape[0] > 1:
        assert torch.allclose(s[-1], torch.tensor(FP8_AMAX_EPS / FP8_MAX), rtol=1e-6) and q[-1].eq(0).all(), s[-1]
    q_ref, s_ref = quantize_fp8_rowwise_ref(x, torch.float32)
    # a row maximum, two IEEE divisions and one product per element: bit-equal on every device and dtype
    assert torch.equal(s, s_ref), "scale"
    assert torch.equal(q, q_ref), "pre-cast values"
    assert q.abs().max() <= FP8_MAX
    if device == "cuda":  # exact e4m3 codes only off the interpreter
        q8, s8 = quantize_fp8_rowwise(x)
        q8_ref, _ = quantize_fp8_rowwise_ref(x)
        assert torch.equal(q8.view(torch.uint8), q8_ref.view(torch.uint8))


@pytest.mark.parametrize("device", DEVICES)
def test_quantize_strided_rows_and_leading_dims(device):
    x = torch.randn(2, 5, 96, device=device)[..., :80]  # rows strided by 96
    q, s = quantize_fp8_rowwise(x, torch.float32)
    q_ref, s_ref = quantize_fp8_rowwise_ref(x, torch.float32)
    assert q.shape == (2, 5, 80) and s.shape == (2, 5, 1)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)


def test_quantize_rejects_bad_q_dtype():
    with pytest.raises(ValueError, match="q_dtype=torch.float16"):
        quantize_fp8_rowwise(torch.randn(2, 16), torch.float16)


# (M, K, N): K and N multiples of 16 (cuBLASLt's rule) but not powers of two; M = 65 reaches FAST_ACCUM_MIN_ROWS.
LINEAR_SHAPES = [
    (1, 48, 80),
    (37, 112, 112),  # K == N: an untransposed w_q would still multiply
    (65, 208, 48),
    (48, 96, 48),  # M == N: swapped scales would still have valid shapes
]


# scaled_mm_cpu scales the exact sum of e4m3 code products, fp8_linear_ref sums products of dequantized values: the
# fp32 sums differ by a few ulps, which can round a bf16 output the other way, many ulps off where the sum cancels.
CPU_GEMM_BOUNDS = dict(max_ulp=None, max_frac=1e-2)
# Hopper's FP8 tensor cores accumulate with less than fp32 precision, fast_accum off too (H100, torch 2.11: fp32
# outputs ~1e-4 of the largest off the exact sum; bf16 outputs 6e-4 to 1e-3 rel-RMS off the reference here).
GPU_GEMM_TOL = 4e-3


def make_linear_operands(m, k, n, out_dtype, device):
    """e4m3 operands whose row scales differ row to row and channel to channel (independently, so that swapped or
    transposed scales change the product), and a bias as large as the product (so a lost or doubled one shows)."""
    x = torch.randn(m, k, device=device) * torch.randn(m, 1, device=device).exp()
    w = torch.randn(n, k, device=device) * torch.randn(n, 1, device=device).exp() / k**0.5
    x_q, x_s = quantize_fp8_rowwise_ref(x)  # [M, K] e4m3, [M, 1] fp32
    w_q, w_s = quantize_fp8_rowwise_ref(w)  # [N, K] e4m3, [N, 1] fp32
    bias = torch.randn(n, device=device).to(out_dtype)
    return x_q, x_s, w_q, w_s.view(-1), bias


@pytest.mark.parametrize("shape", LINEAR_SHAPES)
def test_ref_matches_nn_linear(shape):
    """fp8_linear_ref against the module it replaces, nn.Linear, given the weights and inputs the e4m3 codes and
    scales stand for: the same fp32 products, summed in another order (addmm)."""
    torch.manual_seed(0)
    m, k, n = shape
    x_q, x_s, w_q, w_s, bias = make_linear_operands(m, k, n, torch.float32, "cpu")
    lin = torch.nn.Linear(k, n)
    with torch.no_grad():
        lin.weight.copy_(dequantize_fp8_rowwise(w_q, w_s[:, None]))
        lin.bias.copy_(bias)
        expected = lin(dequantize_fp8_rowwise(x_q, x_s))
    assert_close(fp8_linear_ref(x_q, x_s, w_q, w_s, bias, torch.float32), expected, FP32_TOL, f"{shape}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", LINEAR_SHAPES)
def test_fp8_linear_matches_ref(device, out_dtype, shape):
    """The _scaled_mm call fp8_linear makes (the same on CPU and CUDA) against the dequantize-and-multiply
    reference: a wrong scale layout, an untransposed weight or a misplaced bias raises or changes the product."""
    if device == "cuda" and out_dtype == torch.float32:
        pytest.skip("CUDA's _scaled_mm takes no bias with an fp32 output")
    torch.manual_seed(0)
    args = make_linear_operands(*shape, out_dtype, device)
    out, ref = fp8_linear(*args, out_dtype=out_dtype), fp8_linear_ref(*args, out_dtype=out_dtype)
    assert out.dtype == out_dtype and out.shape == shape[::2]
    if device == "cuda":
        assert_close(out, ref, GPU_GEMM_TOL, f"{shape} {out_dtype}")
    else:
        assert_matches_ref(out, ref, f"{shape} {out_dtype}", **CPU_GEMM_BOUNDS)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fast_accum", [False, True])
def test_fp8_linear_fast_accum_at_every_row_count_pads_to_min_rows(device, fast_accum, monkeypatch):
    """use_fast_accum reaches _scaled_mm when asked for, at every row count, fewer than FAST_ACCUM_MIN_ROWS rows
    padded to that many (cuBLASLt has no kernel for them), and the rows asked for come back; without it, the rows
    as they are."""
    calls = []

    def recording(scaled_mm):
        def record(a, *args, **kwargs):
            calls.append((kwargs["use_fast_accum"], a.shape[0]))
            return scaled_mm(a, *args, **kwargs)
        return record

    # fp8_linear calls one of them: torch._scaled_mm on CUDA, scaled_mm_cpu elsewhere
    monkeypatch.setattr(torch, "_scaled_mm", recording(torch._scaled_mm))
    monkeypatch.setattr(fp8, "scaled_mm_cpu", recording(fp8.scaled_mm_cpu))
    rows = [1, FAST_ACCUM_MIN_ROWS - 1, FAST_ACCUM_MIN_ROWS, FAST_ACCUM_MIN_ROWS + 1]
    for m in rows:
        operands = make_linear_operands(m, 48, 80, torch.bfloat16, device)
        out = fp8_linear(*operands, fast_accum=fast_accum)
        assert out.shape == (m, 80) and out.is_contiguous(), (m, out.shape)
        if device == "cpu":  # the padded rows change none of the others (on the GPU: the test below)
            assert torch.equal(out, scaled_mm_cpu(operands[0], operands[2].t(), operands[1],
                                                  operands[3][None, :], operands[4])), m
    assert calls == [(fast_accum, max(m, FAST_ACCUM_MIN_ROWS) if fast_accum else m) for m in rows]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m, k, rows", [(1, 48, 64), (47, 3072, 64), (25, 12288, 64), (63, 80, 64), (5, 4112, 7),
                                        (64, 96, 64)])
def test_pad_fp8_rows_matches_ref(device, m, k, rows):
    """Every code byte copied, zero rows and unit scales below (outputs start as NaN), from rows strided wider than
    K; bit-equal to torch.cat's form."""
    x = torch.randn(m, k + 32, device=device) * 5
    q, s = quantize_fp8_rowwise_ref(x[:, :k])
    q_wide = torch.zeros(m, k + 32, dtype=FP8_DTYPE, device=device)
    q_wide[:, :k] = q
    padded_q, padded_s = pad_fp8_rows(q_wide[:, :k], s, rows)
    want_q, want_s = pad_fp8_rows_ref(q, s, rows)
    assert padded_q.shape == (rows, k) and padded_s.shape == (rows, 1)
    assert torch.equal(padded_q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(padded_s, want_s)


def test_pad_fp8_rows_refuses_fewer_rows():
    q, s = quantize_fp8_rowwise_ref(torch.randn(9, 32))
    with pytest.raises(ValueError, match="rows=8 is fewer than x_q's 9"):
        pad_fp8_rows(q, s, 8)


@pytest.mark.parametrize("device", DEVICES)
def test_scaled_mm_cpu_refuses_what_cuda_refuses(device):
    """Calls of fp8_linear's form, each with one thing wrong: the CUDA op refuses them all, and so does its CPU
    stand-in (with its message), so a CPU run of fp8_linear catches a call the GPU would refuse."""
    torch.manual_seed(0)
    x_q, x_s, w_q, w_s, bias = make_linear_operands(37, 96, 80, torch.bfloat16, device)
    good = dict(scale_a=x_s, scale_b=w_s[None, :], bias=bias, out_dtype=torch.bfloat16)
    refused = [
        ("a row-major and b column-major", (x_q, w_q.t().contiguous()), good),
        ("K and N divisible by 16", (x_q[:, :40], w_q[:, :40].t()), good),
        (r"scale_b \(1, 80\)", (x_q, w_q.t()), {**good, "scale_b": w_s[:, None]}),
        (r"scale_a \(37, 1\)", (x_q, w_q.t()), {**good, "scale_a": w_s[:, None], "scale_b": x_s.t()}),
        (r"bias must be \(80,\) torch.bfloat16", (x_q, w_q.t()), {**good, "bias": bias.float()}),
        ("operands are torch.bfloat16", (x_q.bfloat16(), w_q.t()), good),
    ]
    scaled_mm = torch._scaled_mm if device == "cuda" else scaled_mm_cpu
    for message, operands, kwargs in refused:
        with pytest.raises((RuntimeError, ValueError), match=None if device == "cuda" else message):
            scaled_mm(*operands, **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", LINEAR_SHAPES)
def test_scaled_mm_cpu_matches_cuda(shape):
    """The CPU stand-in computes what the CUDA op computes from the same call (up to Hopper's FP8 accumulation)."""
    torch.manual_seed(0)
    x_q, x_s, w_q, w_s, bias = make_linear_operands(*shape, torch.bfloat16, "cpu")
    out = torch._scaled_mm(x_q.cuda(), w_q.cuda().t(), scale_a=x_s.cuda(), scale_b=w_s[None, :].cuda(),
                           bias=bias.cuda(), out_dtype=torch.bfloat16)
    ref = scaled_mm_cpu(x_q, w_q.t(), scale_a=x_s, scale_b=w_s[None, :], bias=bias, out_dtype=torch.bfloat16)
    assert_close(out.cpu(), ref, GPU_GEMM_TOL, f"{shape}")


@pytest.mark.gpu
def test_fp8_linear_fast_accum_at_every_row_count():
    """Short rows (a short prompt's unpadded text stream) at the model's K and N, fast accumulation asked for:
    cuBLASLt has no such kernel below ~64 rows at K=12288, which fp8_linear's padding must avoid. And a row comes
    out bit for bit the same whatever the row count (what Ulysses' bit-equality with one GPU rests on: a rank
    computes part of one GPU's rows), here against the first rows of 4200 (a 1024² image's tokens and more)."""
    torch.manual_seed(0)
    for k, n in ((3072, 9216), (3072, 12288), (12288, 3072)):
        w_q, w_s = quantize_fp8_rowwise(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        x_q, x_s = quantize_fp8_rowwise(torch.randn(4200, k, device="cuda", dtype=torch.bfloat16))
        whole = fp8_linear(x_q, x_s, w_q, w_s.view(-1), bias, fast_accum=True)
        for m in [*range(1, 130), 2048, 2100, 4100]:
            out = fp8_linear(x_q[:m], x_s[:m], w_q, w_s.view(-1), bias, fast_accum=True)
            assert_close(out, fp8_linear_ref(x_q[:m], x_s[:m], w_q, w_s.view(-1), bias), 2e-2, f"K={k} N={n} M={m}")
            assert torch.equal(out, whole[:m]), (k, n, m, (out.float() - whole[:m].float()).abs().max().item())


def test_fp8_linear_validates():
    x_q = torch.zeros(4, 32, dtype=FP8_DTYPE)
    w_q = torch.zeros(16, 48, dtype=FP8_DTYPE)
    with pytest.raises(ValueError, match="in-features must equal x_q's K=32"):
        fp8_linear(x_q, torch.ones(4, 1), w_q, torch.ones(16))
    with pytest.raises(ValueError, match=r"x_scale must have shape \(4, 1\)"):
        fp8_linear(x_q, torch.ones(4), w_q[:, :32], torch.ones(16))
    with pytest.raises(ValueError, match="x_q has dtype torch.bfloat16"):
        fp8_linear(torch.zeros(4, 32, dtype=torch.bfloat16), torch.ones(4, 1), w_q[:, :32], torch.ones(16))
    with pytest.raises(ValueError, match=r"^torch\._scaled_mm needs K and N divisible by 16, got K=40"):
        fp8_linear(torch.zeros(4, 40, dtype=FP8_DTYPE), torch.ones(4, 1), w_q[:, :40], torch.ones(16))


@pytest.mark.parametrize("n_cols", [*range(1, 70000, 997), 3072, 8192, 8193, 12288, 16384, 24576, 65536])
def test_chunked_rows_launch_covers_each_row_once(n_cols):
    """Every column in exactly one chunk, no chunk wholly padding, at most MAX_CHUNKS, no more padding than one
    power-of-two tile, and none at the MLP hidden width 12288 (3 x 4096)."""
    grid, s = chunked_rows_launch(100, n_cols)
    chunk, num_chunks, block_m = s["CHUNK"], s["NUM_CHUNKS"], s["BLOCK_M"]
    assert chunk & (chunk - 1) == 0 and block_m & (block_m - 1) == 0 and 1 <= num_chunks <= MAX_CHUNKS
    assert (num_chunks - 1) * chunk < n_cols <= num_chunks * chunk
    assert num_chunks * chunk <= triton.next_power_of_2(n_cols)
    assert grid == (triton.cdiv(100, block_m),)
    if n_cols <= CHUNKED_MIN_COLS:
        assert num_chunks == 1
    if n_cols == 12288:
        assert (chunk, num_chunks) == (4096, 3)
