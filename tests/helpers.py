"""Helpers shared by the tests (tests/ is on sys.path through pytest's rootdir conftest)."""

import contextlib
import logging
import math
import os

import pytest
import torch

from qwen_image_fast.kernels._utils import rel_rms_error

# Scale-aware error bound (RMS of difference / RMS of reference) for kernels whose sums run in another order than
# their reference's (GEMV, attention, recurrences). Too loose for elementwise and row kernels: a kernel that skips a
# rounding of upstream's casts, or truncates instead of rounding, passes it; those use assert_matches_ref.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
# fp32 outputs: there is no rounding step to miss, only fp32 operations in another order (reductions, exp, rsqrt;
# FMA contraction on the GPU), a few fp32 ulps; rel-RMS, since cancellation makes single elements many ulps off.
FP32_TOL = 1e-6
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Kernel tests run on the CPU under Triton's interpreter (conftest turns it on when there is no GPU) and on CUDA.
# On a GPU machine the interpreter is off, so Triton cannot launch on CPU tensors: the CPU cases skip there.
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                                 reason="Triton interpreter off (GPU machine)")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]


@contextlib.contextmanager
def diffusers_warnings(level: int = logging.WARNING):
    """The messages diffusers logs at `level` and above inside the block (its loggers do not propagate to the root
    logger, so caplog does not see them; below WARNING, its library logger is set to `level` meanwhile)."""
    messages = []

    class Keep(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    library, handler = logging.getLogger("diffusers"), Keep(level)
    library.addHandler(handler)
    was = library.level
    library.setLevel(min(level, was or logging.WARNING))
    try:
        yield messages
    finally:
        library.removeHandler(handler)
        library.setLevel(was)


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str = ""):
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    assert torch.isfinite(out).all(), f"{what}: output has NaN/inf (an element left unwritten?)"
    err = rel_rms_error(out, ref)
    assert err <= tol, f"{what}: rel-RMS error {err:.3e} > {tol:.1e}"


def ulp_error(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|out - ref| in units in the last place of ref's dtype, at ref's magnitude (fp64)."""
    mantissa = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}[ref.dtype]
    r = ref.double()
    exponent = torch.frexp(ref.float())[1]  # ref = f * 2**exponent, 0.5 <= |f| < 1
    ulp = torch.ldexp(torch.ones_like(r), exponent - 1 - mantissa).clamp_min(torch.finfo(ref.dtype).tiny)
    return (out.double() - r).abs() / ulp


def assert_nearly_exact(out: torch.Tensor, ref: torch.Tensor, what: str = "", max_ulp: float | None = 1.0,
                        max_frac: float = 1e-3):
    """Bit-equal except a few elements (max_frac of them, rounded up: one in a small tensor) at most max_ulp away
    (None: no bound, for outputs where a flipped intermediate rounding meets cancellation): a kernel that rounds where
    the reference rounds, but whose fp32 intermediates (exp, reductions) can differ by an ulp and flip a rounding."""
    assert out.shape == ref.shape and out.dtype == ref.dtype, (
        f"{what}: {tuple(out.shape)} {out.dtype} vs reference {tuple(ref.shape)} {ref.dtype}")
    assert torch.isfinite(out).all(), f"{what}: output has NaN/inf (an element left unwritten?)"
    err = ulp_error(out, ref)
    differ = (err > 0).sum().item()
    assert (max_ulp is None or err.max().item() <= max_ulp) and differ <= allowed(max_frac, err.numel()), (
        f"{what}: max {err.max().item():.2f} ulp (allowed {max_ulp}), {differ} of {err.numel()} elements differ "
        f"(allowed {max_frac:.0e})")


def allowed(max_frac: float, n: int) -> int:
    """How many of n elements a fraction max_frac allows: rounded up, so one in a small tensor."""
    return math.ceil(max_frac * n)


def toward_zero(t: torch.Tensor) -> torch.Tensor:
    """Each element's neighbour toward zero in t's 16-bit float dtype (zeros stay)."""
    bits = t.view(torch.int16).int()
    magnitude = bits & 0x7FFF
    return torch.where(magnitude > 0, (bits & ~0x7FFF) | (magnitude - 1), bits).short().view(t.dtype)


def assert_truncated(out: torch.Tensor, ref: torch.Tensor, what: str = "", max_frac: float = 1e-3):
    """bf16 from a kernel whose last step is a plain cast, under the interpreter: that cast truncates where torch
    rounds to nearest, so from the same fp32 value the kernel gives ref or ref's neighbour toward zero. Any other
    value (in more than max_frac of the elements: fp32 intermediates in another order can flip a rounding) means
    the fp32 value differed: a skipped or extra rounding shows here, as it would bit for bit on the GPU."""
    assert out.shape == ref.shape and out.dtype == ref.dtype, (
        f"{what}: {tuple(out.shape)} {out.dtype} vs reference {tuple(ref.shape)} {ref.dtype}")
    assert torch.isfinite(out).all(), f"{what}: output has NaN/inf (an element left unwritten?)"
    bits = out.view(torch.int16)
    off = ((out != ref) & (bits != toward_zero(ref).view(torch.int16))).sum().item()
    assert off <= allowed(max_frac, out.numel()), (
        f"{what}: {off} of {out.numel()} elements are neither the reference nor its truncation (allowed "
        f"{max_frac:.0e}); max {ulp_error(out, ref).max().item():.2f} ulp")


def assert_matches_ref(out: torch.Tensor, ref: torch.Tensor, what: str = "", *, max_ulp: float | None = 1.0,
                       max_frac: float = 1e-3, gpu: tuple | None = None, truncating_store: bool = False,
                       fp32_tol: float = FP32_TOL):
    """An elementwise or row kernel against its reference, both rounding where upstream rounds.
    fp16 / bf16: assert_nearly_exact(max_ulp, max_frac) (on CUDA: gpu = (max_ulp, max_frac) when given, for a GPU's
    approximate exp / rsqrt and other reduction orders), and with max_ulp None (a flipped rounding before a
    cancellation) rel-RMS <= TOL / 10; bf16 under the interpreter from a kernel whose last step is a plain cast
    (truncating_store): assert_truncated(max_frac). fp32: rel-RMS <= fp32_tol (more than FP32_TOL only for long
    sums in another order)."""
    if ref.dtype == torch.float32:
        assert_close(out, ref, fp32_tol, what)
    elif out.device.type == "cpu" and ref.dtype == torch.bfloat16 and truncating_store:
        assert_truncated(out, ref, what, max_frac)
    else:
        if out.device.type == "cuda" and gpu is not None:
            max_ulp, max_frac = gpu
        assert_nearly_exact(out, ref, what, max_ulp, max_frac)
        if max_ulp is None:  # the differing elements: a flipped rounding's worth, not garbage
            assert_close(out, ref, TOL[ref.dtype] / 10, what)


def fp8_activations(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The `dtype` activations that pre-cast FP8 values q with row scales s stand for: exact, since q = y * (448 /
    amax) and s = amax / 448 are single fp32 roundings, far below dtype's ulp."""
    return (q * s).to(dtype)


def assert_fp8_precast_matches_ref(q, s, q_ref, s_ref, dtype: torch.dtype, what: str = "", *,
                                   max_ulp: float | None = 1.0, max_frac: float = 1e-3, gpu: tuple | None = None,
                                   where: torch.Tensor | None = None):
    """Rowwise-FP8 outputs stored as pre-cast fp32 values q [..., N] and scales s [..., 1] (q_dtype=torch.float32),
    for activations y in `dtype`, against the reference's. fp16 / bf16: the activations and row maxima they stand
    for (fp8_activations; s * 448) as assert_matches_ref, over the elements `where` selects (all if None); where
    both agree with the reference, q bit-equal. fp32: rel-RMS <= FP32_TOL."""
    if dtype == torch.float32:
        assert_close(s, s_ref, FP32_TOL, f"{what}: scales")
        assert_close(q, q_ref, FP32_TOL, f"{what}: pre-cast values")
        return
    y, y_ref = fp8_activations(q, s, dtype), fp8_activations(q_ref, s_ref, dtype)
    amax, amax_ref = (s * 448.0).to(dtype), (s_ref * 448.0).to(dtype)
    where = torch.ones_like(y, dtype=torch.bool) if where is None else where
    assert_matches_ref(y[where], y_ref[where], f"{what}: activations", max_ulp=max_ulp, max_frac=max_frac, gpu=gpu)
    # a row's maximum is one of its activations: a flip there moves the scale by that ulp
    assert_nearly_exact(amax, amax_ref, f"{what}: row maxima (scales)", max_ulp=1.0, max_frac=1.0)
    rows = amax == amax_ref
    assert torch.equal(s[rows], s_ref[rows]), f"{what}: scales differ where the row maxima agree"
    same = (y == y_ref) & rows & where
    assert torch.equal(q[same], q_ref[same]), f"{what}: pre-cast values differ where activations and scales agree"


def assert_e4m3_codes_match(q8: torch.Tensor, q8_ref: torch.Tensor, what: str = "", max_frac: float = 1e-3):
    """e4m3 codes (GPU only: the interpreter mis-rounds fp32 -> fp8) equal except max_frac of them: an activation
    that rounded the other way rarely moves its 3-bit-mantissa code."""
    differ = (q8.view(torch.uint8) != q8_ref.view(torch.uint8)).sum().item()
    assert differ <= allowed(max_frac, q8.numel()), f"{what}: {differ} of {q8.numel()} e4m3 codes differ"


def forward_batches(pipe) -> list[int]:
    """Records the batch of every forward the fast transformer computes (paired ones included)."""
    batches, compute = [], pipe.transformer.compute

    def counting(**inputs):
        batches.append(inputs["hidden_states"].shape[0])
        return compute(**inputs)

    pipe.transformer.compute = counting
    return batches


def tiny_lora(path, targets=("transformer_blocks.0.attn.to_q", "transformer_blocks.1.img_mlp.net.2"), seed=0):
    """A LoRA for the tiny model in lightx2v's key format (lora_down / lora_up / alpha), strong enough to see."""
    import torch
    from safetensors.torch import save_file

    from qwen_image_fast.pipelines.tiny import tiny_pipeline

    model = tiny_pipeline().transformer
    g = torch.Generator().manual_seed(seed)
    sd = {}
    q = model.transformer_blocks[0].attn.to_q
    for name in targets:
        linear = dict(model.named_modules()).get(name, q)  # a name the model lacks: to_q's shape
        k, n = linear.in_features, linear.out_features
        sd[f"{name}.lora_down.weight"] = torch.randn(4, k, generator=g) / k**0.5
        sd[f"{name}.lora_up.weight"] = torch.randn(n, 4, generator=g)
        sd[f"{name}.alpha"] = torch.tensor(4.0)
    save_file(sd, path)
    return path
