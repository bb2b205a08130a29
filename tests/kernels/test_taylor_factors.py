import pytest
import torch
from diffusers.hooks.taylorseer_cache import TaylorSeerState
from helpers import DEVICES, DTYPES

from qwen_image_fast.kernels.taylor_factors import taylor_factors_update, taylor_factors_update_ref

SHAPES = [(1,), (3, 37, 123), (2, 5, 3072)]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.mark.parametrize("factors_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("max_order", [1, 2])
def test_ref_matches_diffusers_taylorseer(max_order, dtype, factors_dtype):
    """The reference, fed the outputs diffusers' TaylorSeerState.update is fed (steps 0, 2, 3, 7: deltas 2, 1, 4),
    holds the state's factors bit for bit after each update, as the orders grow to max_order + 1."""
    state = TaylorSeerState(taylor_factors_dtype=factors_dtype, max_order=max_order)
    factors = torch.full((max_order + 1, 2, 5, 48), float("nan"), dtype=factors_dtype)
    orders, last = 0, None
    for step in (0, 2, 3, 7):
        out = (torch.randn(2, 5, 48) * 3).to(dtype)
        state.current_step = step
        state.update((out,))
        delta = torch.tensor([float(step - last if last is not None else 1)])
        taylor_factors_update_ref(out, factors, orders, delta)
        orders, last = min(orders + 1, max_order + 1), step
        expected = state.taylor_factors[0]
        assert len(expected) == orders
        for j in range(orders):
            assert expected[j].dtype == factors_dtype and torch.equal(factors[j], expected[j]), (step, j)
        orders = min(orders, max_order)  # the orders the next update differences: up to max_order


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("factors_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("orders", [0, 1, 2])
def test_kernel_matches_ref(device, dtype, factors_dtype, shape, orders):
    """Bit-equal: each step one rounding of upstream's (IEEE division), no reduction. The slots past the held
    factors start as NaN: the new one must be written, the ones after it left alone."""
    out = (torch.randn(shape, device=device) * 3).to(dtype)
    factors = (torch.randn((4, *shape), device=device) * 2).to(factors_dtype)
    factors[orders:] = float("nan")
    expected, before = factors.clone(), factors.clone()
    delta = torch.tensor([3.0], device=device)
    taylor_factors_update(out, factors, orders, delta)
    taylor_factors_update_ref(out, expected, orders, delta)
    got, want = factors[:orders + 1], expected[:orders + 1]
    assert torch.equal(got, want), first_difference(got, want, out, before)
    assert factors[orders + 1:].isnan().all()


@pytest.mark.gpu
@pytest.mark.parametrize("orders", [1, 2])
def test_in_place_update_over_many_launches(orders):
    """The in-place update read back its own new factors in a few warps where Triton gave a slot's load and store
    to different threads (an H200: 24 of 5400 seeded cases, fp16 out with fp32 factors): 200 launches at an
    unaligned tile (stride 13653) make that a near-certain failure, where one launch found it as timing allowed."""
    shape = (3, 37, 123)
    delta = torch.tensor([3.0], device="cuda")
    for seed in range(200):
        torch.manual_seed(seed)
        out = (torch.randn(shape, device="cuda") * 3).half()
        factors = torch.randn((4, *shape), device="cuda") * 2
        factors[orders:] = float("nan")
        expected, before = factors.clone(), factors.clone()
        taylor_factors_update(out, factors, orders, delta)
        taylor_factors_update_ref(out, expected, orders, delta)
        got, want = factors[:orders + 1], expected[:orders + 1]
        assert torch.equal(got, want), f"seed {seed}: " + first_difference(got, want, out, before)


def first_difference(got, want, out, before) -> str:
    """Where the kernel and the reference first differ, with the inputs there (the slots past the new factors are
    NaN in both, so a max-abs difference over the whole tensor says nothing)."""
    differ = ~((got == want) | (got.isnan() & want.isnan()))
    k, *at = differ.nonzero()[0].tolist()
    return (f"{int(differ.sum())} values differ; first: factor {k} at {tuple(at)}: kernel {got[(k, *at)].item()!r}, "
            f"reference {want[(k, *at)].item()!r}; out {out[tuple(at)].item()!r}, factors before "
            f"{[before[(j, *at)].item() for j in range(before.shape[0])]}")


def test_validation_names_the_value():
    out, factors, delta = torch.randn(2, 3), torch.randn(2, 2, 3), torch.ones(1)
    with pytest.raises(ValueError, match=r"factors must have shape \[K, \*out.shape\] = \[K, 2, 3\], got \(2, 2, 4\)"):
        taylor_factors_update(out, torch.randn(2, 2, 4), 0, delta)
    with pytest.raises(ValueError, match=r"orders=2: the factors held must be 0..1"):
        taylor_factors_update(out, factors, 2, delta)
    with pytest.raises(ValueError, match=r"delta must have shape \(1,\), got \(\)"):
        taylor_factors_update(out, factors, 1, torch.tensor(1.0))
