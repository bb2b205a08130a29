"""A per-tensor FP8 scale for the output of linears, from a bound instead of an amax pass over that output.

y = x @ W.T + b with x a rowwise-FP8 operand (|x_rk| <= 448 * s[r], s its row scales) is bounded by
|y| <= max(s) * row_term + bias_term, where the weight's row_term (448 * max_j ||W_j||_1, with margins) and
bias_term (max |b|) are computed once per weight by the caller. Several linears writing one tensor (the two streams
of a joint attention's v) take the largest of their bounds. One program reads the row scales (a few thousand
floats) and writes, for an FP8 consumer, scale, scale * headroom and 1 / (scale * headroom): one launch where the
same arithmetic in torch ops is nine (amax, addcmul per operand, maximum, the product, the reciprocal), each a
node of a CUDA graph.
"""

import torch
import triton
import triton.language as tl

from ._utils import check_tensor, new_output

BLOCK = 2048  # row scales read per iteration: one or two for a 1024^2 image's 4096-8192 rows


@triton.jit
def _operand_bound(S, M, BIAS_TERM, ROW_TERM, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], tl.float32)
    for start in range(0, M, BLOCK):  # a NaN row scale (NaN activations) makes the bound NaN, as torch's amax
        amax = tl.maximum(amax, tl.load(S + start + offs, mask=start + offs < M, other=0.0),
                          propagate_nan=tl.PropagateNan.ALL)
    amax = tl.where(tl.sum((amax != amax).to(tl.int32), axis=0) > 0, float("nan"), tl.max(amax, axis=0))
    return tl.load(BIAS_TERM) + amax * tl.load(ROW_TERM)


@triton.jit
def _output_bound_scales_kernel(S1, M1, BIAS1, ROW1, S2, M2, BIAS2, ROW2, OUT, headroom, TWO: tl.constexpr,
                                BLOCK: tl.constexpr):
    scale = _operand_bound(S1, M1, BIAS1, ROW1, BLOCK)
    if TWO:
        scale = tl.maximum(scale, _operand_bound(S2, M2, BIAS2, ROW2, BLOCK), propagate_nan=tl.PropagateNan.ALL)
    consumer = scale * headroom
    tl.store(OUT, scale)
    tl.store(OUT + 1, consumer)
    tl.store(OUT + 2, tl.div_rn(1.0 + 0.0 * consumer, consumer))  # IEEE, as torch's reciprocal


def _check(row_scales, terms):
    if not 1 <= len(row_scales) <= 2 or len(terms) != len(row_scales):
        raise ValueError(f"one or two operands, each with (bias_term, row_term); got {len(row_scales)} row-scale "
                         f"tensors and {len(terms)} term pairs")
    device = row_scales[0].device
    for i, (s, (bias_term, row_term)) in enumerate(zip(row_scales, terms)):
        check_tensor(f"row_scales[{i}]", s, dtypes=(torch.float32,), ndim=2, device=device)
        if s.shape[1] != 1 or s.shape[0] == 0 or not s.is_contiguous():
            raise ValueError(f"row_scales[{i}] must be a contiguous [M, 1] with M >= 1, got shape {tuple(s.shape)}")
        for name, t in (("bias_term", bias_term), ("row_term", row_term)):
            check_tensor(f"terms[{i}].{name}", t, dtypes=(torch.float32,), shape=(1,), device=device)


def output_bound_scales(row_scales, terms, headroom: float) -> torch.Tensor:
    """row_scales: one or two fp32 [M_i, 1] row scales of the linears' rowwise-FP8 operands; terms: per operand
    (bias_term [1], row_term [1]) fp32. Returns fp32 [3]: (scale, scale * headroom, 1 / (scale * headroom)), scale
    = max_i (bias_term_i + max(row_scales_i) * row_term_i)."""
    _check(row_scales, terms)
    out = new_output((3,), torch.float32, row_scales[0].device)
    two = len(row_scales) == 2
    (s1, (b1, r1)), (s2, (b2, r2)) = (row_scales[0], terms[0]), (row_scales[-1], terms[-1])  # one: s2 unread
    _output_bound_scales_kernel[(1,)](s1, s1.shape[0], b1, r1, s2, s2.shape[0], b2, r2, out, headroom, TWO=two,
                                      BLOCK=BLOCK, num_warps=4)
    return out


def output_bound_scales_ref(row_scales, terms, headroom: float) -> torch.Tensor:
    """The semantics output_bound_scales must reproduce: the torch ops it replaces."""
    scale = torch.stack([torch.addcmul(bias_term, s.amax().reshape(1), row_term)
                         for s, (bias_term, row_term) in zip(row_scales, terms)]).amax(dim=0)
    consumer = scale * headroom
    return torch.cat([scale, consumer, 1.0 / consumer])
