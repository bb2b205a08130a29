"""Update of stacked Taylor factors by divided differences, in one pass (TaylorSeer's update of a cached output).

factors [K, *shape] hold f_0 .. f_{orders-1} of the last update; a new output `out` [*shape] taken `delta` steps
later replaces them with

    new_0 = out,    new_{j+1} = (new_j - f_j) / delta    for j < orders,

stored as new_0 .. new_orders (orders + 1 <= K), with diffusers' casts (TaylorSeerState.update): each f_j read in
out's dtype, each difference and quotient rounded to out's dtype, the new factors to the factors' dtype. In place:
each slot is read before it is overwritten, so one pass reads out and the old factors and writes the new ones,
where the tensor expressions read and write each slot several times.
"""

import torch
import triton
import triton.language as tl

from ._utils import FLOAT_DTYPES, TILE_ELEMENTS, check_tensor, interpreted_fit, round_to


@triton.jit
def _taylor_factors_update_kernel(OUT, F, DELTA, stride_f, N, ORDERS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    dtype = OUT.dtype.element_ty
    f_dtype = F.dtype.element_ty
    new = tl.load(OUT + offs, mask=mask, other=0.0).to(tl.float32)
    delta = tl.load(DELTA).to(tl.float32)
    for j in tl.static_range(ORDERS):
        prev = round_to(tl.load(F + j * stride_f + offs, mask=mask, other=0.0).to(tl.float32), dtype)
        # the load and the store of slot j need not give an element to the same thread (Triton lays out each memory
        # op by its own pointer's alignment and dtype): without the barrier a thread could overwrite an old factor
        # another thread has yet to read (an H200 read `out` back as f_0 in 32-64 elements of a tile, 24 of 5400
        # seeded cases, fp16 out with fp32 factors, the suite's test failing only as timing allowed)
        tl.debug_barrier()
        tl.store(F + j * stride_f + offs, round_to(new, f_dtype).to(f_dtype), mask=mask)
        new = round_to(tl.math.div_rn(round_to(new - prev, dtype), delta), dtype)  # IEEE division, as torch's
    tl.store(F + ORDERS * stride_f + offs, round_to(new, f_dtype).to(f_dtype), mask=mask)


def _check(out, factors, orders, delta):
    check_tensor("out", out, dtypes=FLOAT_DTYPES)
    check_tensor("factors", factors, dtypes=FLOAT_DTYPES, device=out.device)
    if tuple(factors.shape[1:]) != tuple(out.shape):
        raise ValueError(f"factors must have shape [K, *out.shape] = [K, {', '.join(map(str, out.shape))}], "
                         f"got {tuple(factors.shape)}")
    if not (out.is_contiguous() and factors.is_contiguous()):
        raise ValueError(f"out and factors must be contiguous, got strides {out.stride()} and {factors.stride()}")
    if not 0 <= orders < factors.shape[0]:
        raise ValueError(f"orders={orders}: the factors held must be 0..{factors.shape[0] - 1} (K - 1, the new "
                         "ones take one slot more)")
    check_tensor("delta", delta, dtypes=(torch.float32,), shape=(1,), device=out.device)


def taylor_factors_update(out: torch.Tensor, factors: torch.Tensor, orders: int, delta: torch.Tensor) -> None:
    """out [*S]; factors [K, *S] holding `orders` factors (0: none yet), updated in place to orders + 1;
    delta: fp32 [1], the steps since the last update (a device scalar: a CUDA graph replays it)."""
    _check(out, factors, orders, delta)
    n = out.numel()
    if n == 0:
        return
    block = interpreted_fit(TILE_ELEMENTS, n)
    _taylor_factors_update_kernel[(triton.cdiv(n, block),)](
        out, factors, delta, factors.stride(0), n, ORDERS=orders, BLOCK=block, num_warps=8)


def taylor_factors_update_ref(out: torch.Tensor, factors: torch.Tensor, orders: int, delta: torch.Tensor) -> None:
    """The semantics taylor_factors_update must reproduce: diffusers' TaylorSeerState.update on these tensors."""
    new = [out]
    for j in range(orders):
        new.append((new[j] - factors[j].to(out.dtype)) / delta[0])  # a 0-dim fp32 divisor: stays in out's dtype
    for j, value in enumerate(new):
        factors[j].copy_(value)
