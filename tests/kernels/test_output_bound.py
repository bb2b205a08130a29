import pytest
import torch
from helpers import DEVICES

from qwen_image_fast.kernels.output_bound import output_bound_scales, output_bound_scales_ref


def operands(device, rows):
    """Row scales of rowwise-FP8 operands (positive, spread over decades) and their weights' terms."""
    scales = [(torch.rand(m, 1, device=device) * 10 ** torch.empty(m, 1, device=device).uniform_(-4, 0)).clamp_min(1e-9)
              for m in rows]
    terms = [(torch.rand(1, device=device) * 0.01, torch.rand(1, device=device) * 50) for _ in rows]
    return scales, terms


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [(1,), (7,), (2048,), (4097,), (8192, 436), (436, 8192), (3, 2049)])
def test_kernel_matches_torch_ops(device, rows):
    """The bound as the torch ops computed it (amax, addcmul per operand, maximum, x headroom, reciprocal): to an
    ulp (the kernel may fuse the multiply-add)."""
    torch.manual_seed(len(rows) * 1000 + rows[0])
    scales, terms = operands(device, rows)
    got = output_bound_scales(scales, terms, 1.125)
    want = output_bound_scales_ref(scales, terms, 1.125)
    assert got.shape == (3,) and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=2.5e-7, atol=0)
    assert torch.equal(want[1:2], want[:1] * 1.125) and torch.equal(want[2:], 1 / want[1:2])


@pytest.mark.parametrize("which", [0, 1])
def test_each_operand_and_row_counts(which):
    """The largest row scale anywhere in either operand sets the bound (each operand read to its last row)."""
    scales, terms = operands("cpu", (5000, 300))
    terms = [(torch.zeros(1), torch.ones(1))] * 2
    scales[which][-1] = 7.0  # the last row of one operand, past the first 2048-float block
    assert output_bound_scales(scales, terms, 1.0)[0].item() == 7.0


def test_refusals():
    s = torch.ones(4, 1)
    t = (torch.zeros(1), torch.ones(1))
    with pytest.raises(ValueError, match="one or two operands"):
        output_bound_scales([s, s, s], [t, t, t], 1.0)
    with pytest.raises(ValueError, match=r"row_scales\[0\] must be a contiguous \[M, 1\]"):
        output_bound_scales([torch.ones(4, 2)[:, :1]], [t], 1.0)
    with pytest.raises(ValueError, match=r"terms\[0\].row_term has dtype torch.float64"):
        output_bound_scales([s], [(torch.zeros(1), torch.ones(1, dtype=torch.float64))], 1.0)


@pytest.mark.parametrize("which", [0, 1])
def test_nan_row_scale_gives_nan(which):
    """NaN activations give a NaN row scale; the bound is then NaN, as torch's amax makes it, never a finite
    scale from the other rows."""
    scales, terms = operands("cpu", (3000, 40))
    scales[which][which * 7] = float("nan")
    assert torch.isnan(output_bound_scales(scales, terms, 1.125)).all()
    assert torch.isnan(output_bound_scales_ref(scales, terms, 1.125)).all()
