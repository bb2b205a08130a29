"""round_to: the fp32 value of a cast to bf16 / fp16 and back, through integer ops (kernels/_utils.py says why),
bit-equal to PyTorch's casts on every class of input: normals, fp16 subnormals, underflow, overflow, signed zeros,
infinities, NaN, and random bit patterns."""

import pytest
import torch
import triton
import triton.language as tl
from helpers import DEVICES

from qwen_image_fast.kernels._utils import round_to

EDGES = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 65504.0, 65519.9, 65520.0, -65520.0, 65536.0,
         2.0**-14, 2.0**-14 * (1 - 2.0**-12), 2.0**-24, -(2.0**-24), 2.0**-25, 2.0**-25 * 1.0001, 3 * 2.0**-26,
         1e-30, -1e-30, 1.5e-45, 3.4e38, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8]


@triton.jit
def _round_kernel(X, Y, N, DTYPE: tl.constexpr):
    offs = tl.program_id(0) * 1024 + tl.arange(0, 1024)
    mask = offs < N
    tl.store(Y + offs, round_to(tl.load(X + offs, mask=mask), DTYPE), mask=mask)


def inputs(device) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    n = 1 << 14
    scaled = torch.randn(n, generator=g) * 10.0 ** torch.randint(-9, 6, (n,), generator=g).float()
    bits = torch.randint(-(2**31), 2**31 - 1, (n,), generator=g, dtype=torch.int32).view(torch.float32)
    return torch.cat([torch.tensor(EDGES), scaled, bits]).to(device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("device", DEVICES)
def test_round_to_equals_the_cast(device, dtype):
    x = inputs(device)
    y = torch.full_like(x, 1.0)
    tl_dtype = tl.bfloat16 if dtype == torch.bfloat16 else tl.float16
    _round_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), DTYPE=tl_dtype)
    ref = x.to(dtype).float()
    nan = ref.isnan()
    assert torch.equal(y.isnan(), nan), "NaN in / NaN out"
    assert torch.equal(y[~nan].view(torch.int32), ref[~nan].view(torch.int32)), (
        f"{(y[~nan].view(torch.int32) != ref[~nan].view(torch.int32)).sum().item()} values differ from the cast")
