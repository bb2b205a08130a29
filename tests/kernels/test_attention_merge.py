"""merge_attention: two attention parts over disjoint key sets merged by their log-sum-exps into the attention over
the union (Qwen-Image-2.1's FP8 attention: the target's keys and the prefix cache's), written as rowwise FP8 or in
the parts' dtype. The reference against one attention over the union; the kernel against the reference on awkward
shapes and strided outputs, the written rows starting as NaN and the rows around them checked untouched."""

import math

import pytest
import torch
from helpers import DEVICES

from qwen_image_fast.kernels._utils import FP8_DTYPE, rel_rms_error
from qwen_image_fast.kernels.attention_merge import merge_attention, merge_attention_ref

BF16_ULP = 2**-7  # bf16's relative spacing: the kernel's exp may round the merged value to the neighbour code


def attention_part(q, k, v, valid=None):
    """fp32 attention of q [B, S, H, D] over k, v [B, K, H, D] (keys past valid[b] masked): (output in v's dtype
    [B, S, H, D], lse fp32 [B, H, S]) as an attention kernel returns them."""
    scores = torch.einsum("bshd,bkhd->bhsk", q.float(), k.float()) / math.sqrt(q.shape[-1])
    if valid is not None:
        keys = torch.arange(k.shape[1])[None, :] < valid[:, None]
        scores = scores.masked_fill(~keys[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bhsk,bkhd->bshd", torch.softmax(scores, dim=-1).nan_to_num(0.0), v.float())
    return out.to(v.dtype).contiguous(), lse.contiguous()


def parts(b, s, h, d, keys=(37, 11), device="cpu", dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, h, d, generator=g) * 2
    kv = [(torch.randn(b, n, h, d, generator=g) * 2, torch.randn(b, n, h, d, generator=g).to(dtype)) for n in keys]
    (o1, l1), (o2, l2) = (attention_part(q, k, v) for k, v in kv)
    return [t.to(device) for t in (o1, l1, o2, l2)], (q, kv)


def test_reference_is_attention_over_the_union():
    """The merged parts equal one attention over the concatenated keys, to the parts' bf16 rounding (each part
    rounded once, then the merge); a part whose keys are all masked (lse -inf, its output NaN) adds nothing."""
    (o1, l1, o2, l2), (q, ((k1, v1), (k2, v2))) = parts(2, 9, 3, 16)
    union, _ = attention_part(q, torch.cat([k1, k2], 1), torch.cat([v1, v2], 1))
    merged = merge_attention_ref(o1, l1, o2, l2)
    assert merged.dtype == torch.bfloat16 and merged.shape == (2, 9, 48)
    assert rel_rms_error(merged.float(), union.flatten(2).float()) < 4e-3
    alone = merge_attention_ref(o1, l1, torch.full_like(o2, float("nan")), torch.full_like(l2, float("-inf")))
    assert torch.equal(alone, o1.flatten(2))
    codes, scales = merge_attention_ref(o1, l1, o2, l2, torch.float32)
    assert scales.shape == (2, 9) and torch.equal(codes.abs().amax(dim=-1), torch.full((2, 9), 448.0))
    assert rel_rms_error(codes * scales[..., None], merged.float()) < 1e-6  # the pre-cast values, before e4m3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("b, s, h, d", [(1, 1, 1, 16), (2, 5, 3, 24), (1, 70, 32, 128)])
@pytest.mark.parametrize("fp8", [False, True])
def test_kernel_matches_reference_into_a_strided_buffer(device, b, s, h, d, fp8):
    """Written at rows [2, 2 + S) of each sample of a [B, S + 3, H * D] buffer (the prefix rows before, one spare
    after), as the 2.1 block writes the target's rows of its output operand; nothing else touched."""
    (o1, l1, o2, l2), _ = parts(b, s, h, d, device=device, seed=s)
    q_dtype = (FP8_DTYPE if device == "cuda" else torch.float32) if fp8 else None
    out = torch.full((b, s + 3, h * d), float("nan"), dtype=q_dtype or torch.bfloat16, device=device)
    scale = torch.full((b, s + 3), float("nan"), device=device) if fp8 else None
    merge_attention(o1, l1, o2, l2, out[:, 2:2 + s], None if scale is None else scale[:, 2:2 + s])
    assert out[:, :2].float().isnan().all() and out[:, 2 + s:].float().isnan().all()
    got = out[:, 2:2 + s].float()
    if not fp8:
        torch.testing.assert_close(got, merge_attention_ref(o1, l1, o2, l2).float(), rtol=BF16_ULP, atol=0)
        return
    assert scale[:, :2].isnan().all() and scale[:, 2 + s:].isnan().all()
    codes, scales = merge_attention_ref(o1, l1, o2, l2, q_dtype)
    torch.testing.assert_close(scale[:, 2:2 + s], scales, rtol=BF16_ULP, atol=0)
    # the codes: within one bf16 step of the merged value, plus e4m3's own rounding on a GPU
    tolerance = BF16_ULP * 448 + (16 if device == "cuda" else 0)
    assert (got - codes.float()).abs().max() <= tolerance


def test_a_masked_part_is_not_read():
    """lse2 = -inf on some rows (a sample whose second key set is all padding): those rows are the first part's,
    whatever NaN the second part's output holds there."""
    (o1, l1, o2, l2), _ = parts(2, 4, 2, 16)
    l2[1] = float("-inf")
    o2[1] = float("nan")
    out = torch.empty(2, 4, 32, dtype=torch.bfloat16)
    merge_attention(o1, l1, o2, l2, out)
    assert torch.equal(out[1], o1[1].flatten(1))
    assert torch.isfinite(out).all()


def test_refusals():
    (o1, l1, o2, l2), _ = parts(1, 3, 2, 16)
    out = torch.empty(1, 3, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"lse2 must have shape \(1, 2, 3\)"):
        merge_attention(o1, l1, o2, l2.transpose(1, 2), out)
    with pytest.raises(ValueError, match="out has dtype torch.float32; without a scale tensor"):
        merge_attention(o1, l1, o2, l2, out.float())
    with pytest.raises(ValueError, match="q_dtype=torch.bfloat16"):
        merge_attention(o1, l1, o2, l2, out, torch.empty(1, 3))
    with pytest.raises(ValueError, match="o1 must have contiguous heads"):
        merge_attention(o1.transpose(1, 2).contiguous().transpose(1, 2), l1, o2, l2, out)  # [B, H, S, D] memory
