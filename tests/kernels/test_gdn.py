import re

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.models.qwen3_5 import modeling_qwen3_5 as upstream
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

from helpers import (
    DEVICES,
    DTYPES,
    TOL,
    assert_close,
    assert_matches_ref,
    assert_nearly_exact,
    assert_truncated,
)
from qwen_image_fast.kernels.gdn import (
    causal_conv1d,
    causal_conv1d_ref,
    chunk_gated_delta_rule_ref,
    conv_ring,
    gated_delta_rule_decode,
    gated_delta_rule_decode_ref,
    recurrent_gated_delta_rule_ref,
    ring_window,
)

DTYPE_IDS = [str(d).removeprefix("torch.") for d in DTYPES]
UPSTREAM_FUNCS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                  "causal_conv1d_update")


def torch_impl(name):
    """transformers' own PyTorch function, not the fla / causal-conv1d kernel it dispatches to when installed."""
    f = getattr(upstream, name)
    while hasattr(f, "__wrapped__"):
        f = f.__wrapped__
    return f


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def torch_upstream(monkeypatch):
    """Qwen3_5GatedDeltaNet.forward on transformers' PyTorch paths, even where fla / causal-conv1d are installed."""
    for name in UPSTREAM_FUNCS:
        monkeypatch.setattr(upstream, name, torch_impl(name))


def gdn_inputs(b, t, h, hv, dk, dv, dtype=torch.float32, device="cpu"):
    """q, k [B, T, H, Dk]; v [B, T, HV, Dv] in dtype; g (log decay as the model makes it), beta [B, T, HV] fp32."""
    q = torch.randn(b, t, h, dk, device=device).to(dtype)
    k = torch.randn(b, t, h, dk, device=device).to(dtype)
    v = torch.randn(b, t, hv, dv, device=device).to(dtype)
    a = torch.randn(b, t, hv, device=device)
    a_log = torch.empty(hv, device=device).uniform_(0.01, 16).log()
    g = -a_log.exp() * F.softplus(a + 1.0)
    beta = torch.randn(b, t, hv, device=device).sigmoid()
    return q, k, v, g, beta


# Hop 1: references against transformers' qwen3_5 functions and Qwen3_5GatedDeltaNet.


@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "initial-state"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_recurrent_ref_matches_transformers(dtype, with_state):
    b, t, h, hv, dk, dv = 2, 6, 2, 4, 16, 8  # Qwen3.5-9B: H=16, HV=32, Dk=Dv=128
    q, k, v, g, beta = gdn_inputs(b, t, h, hv, dk, dv, dtype)
    state = torch.randn(b, hv, dk, dv) if with_state else None
    o, final = recurrent_gated_delta_rule_ref(q, k, v, g, beta, initial_state=state)
    # Qwen3_5GatedDeltaNet repeat_interleaves q and k to the value heads before the call
    o_up, final_up = torch_impl("torch_recurrent_gated_delta_rule")(
        q.repeat_interleave(hv // h, dim=2), k.repeat_interleave(hv // h, dim=2), v, g, beta,
        initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True,
    )
    assert o.dtype == dtype and final.dtype == torch.float32
    assert torch.equal(o, o_up)
    assert torch.equal(final, final_up)


@pytest.mark.parametrize("t, chunk_size", [(1, 64), (63, 64), (130, 64), (63, 16)])
def test_chunk_ref_matches_recurrent_and_transformers(t, chunk_size):
    b, h, hv, dk, dv = 2, 2, 4, 16, 8
    q, k, v, g, beta = gdn_inputs(b, t, h, hv, dk, dv)
    state = torch.randn(b, hv, dk, dv)
    o, final = chunk_gated_delta_rule_ref(q, k, v, g, beta, initial_state=state, chunk_size=chunk_size)
    o_rec, final_rec = recurrent_gated_delta_rule_ref(q, k, v, g, beta, initial_state=state)
    assert_close(o, o_rec, 1e-5, "o vs recurrent")
    assert_close(final, final_rec, 1e-5, "state vs recurrent")
    o_up, final_up = torch_impl("torch_chunk_gated_delta_rule")(
        q.repeat_interleave(2, dim=2), k.repeat_interleave(2, dim=2), v, g, beta, chunk_size=chunk_size,
        initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True,
    )
    assert_close(o, o_up, 1e-5, "o vs transformers' chunked form")
    assert_close(final, final_up, 1e-5, "state vs transformers' chunked form")


def test_chunk_ref_bf16_and_zero_state():
    q, k, v, g, beta = gdn_inputs(1, 70, 1, 2, 32, 16, torch.bfloat16)
    o, final = chunk_gated_delta_rule_ref(q, k, v, g, beta)
    o_rec, final_rec = recurrent_gated_delta_rule_ref(q, k, v, g, beta)
    assert o.dtype == torch.bfloat16
    assert_close(o, o_rec, TOL[torch.bfloat16], "o")
    assert_close(final, final_rec, 1e-5, "state")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_causal_conv1d_ref_matches_transformers(dtype):
    bsz, c, width = 2, 24, 3  # conv kernel K = 4
    weight = torch.randn(c, width + 1).to(dtype)
    x = torch.randn(bsz, 9, c).to(dtype)
    y, state = causal_conv1d_ref(x, weight)
    y_up = torch_impl("causal_conv1d_fn")(x.transpose(1, 2), weight, None, activation="silu").transpose(1, 2)
    assert torch.equal(y, y_up)
    assert torch.equal(state, x[:, -width:].transpose(1, 2))
    # decode: upstream keeps K entries (the oldest unused), we keep K-1
    x1 = torch.randn(bsz, 1, c).to(dtype)
    state_up = torch.cat([torch.randn(bsz, c, 1).to(dtype), state], dim=-1)
    y1, state1 = causal_conv1d_ref(x1, weight, state)
    y1_up = torch_impl("causal_conv1d_update")(x1.transpose(1, 2), state_up, weight, None, "silu").transpose(1, 2)
    assert torch.equal(y1, y1_up)
    assert torch.equal(state1, state_up[..., 1:])
    # fewer tokens than the state holds: zeros on the left
    _, short = causal_conv1d_ref(x[:, :2], weight)
    assert torch.equal(short, torch.cat([torch.zeros(bsz, c, 1, dtype=dtype), x[:, :2].transpose(1, 2)], dim=-1))


def tiny_gdn_layer(dtype):
    config = Qwen3_5TextConfig(
        hidden_size=32,  # 4096
        linear_num_key_heads=2,  # 16
        linear_num_value_heads=4,  # 32
        linear_key_head_dim=16,  # 128
        linear_value_head_dim=8,  # 128
        linear_conv_kernel_dim=4,  # 4
        num_hidden_layers=1, layer_types=["linear_attention"],
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=64, intermediate_size=64,
    )
    layer = upstream.Qwen3_5GatedDeltaNet(config, 0)
    with torch.no_grad():
        layer.dt_bias.normal_()  # upstream initializes it to ones
        layer.norm.weight.normal_(1.0, 0.3)
    return layer.to(dtype), config


def in_proj(layer, x):
    return layer.in_proj_qkv(x), layer.in_proj_z(x), layer.in_proj_a(x), layer.in_proj_b(x)


def out_proj(layer, o, z):
    """The rest of Qwen3_5GatedDeltaNet.forward: gated RMSNorm per value head, out_proj. o, z: [B, T, HV, Dv]."""
    bsz, t = z.shape[:2]
    normed = layer.norm(o.reshape(-1, layer.head_v_dim), z.reshape(-1, layer.head_v_dim))
    return layer.out_proj(normed.reshape(bsz, t, -1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_refs_match_gated_deltanet_prefill_and_decode(dtype, torch_upstream):
    layer, config = tiny_gdn_layer(dtype)
    h, dk, dv = layer.num_k_heads, layer.head_k_dim, layer.head_v_dim
    bsz, t = 2, 5
    cache = DynamicCache(config=config)
    x = torch.randn(bsz, t, config.hidden_size).to(dtype)
    with torch.no_grad():
        expected = layer(x, cache_params=cache)
        # prefill on our references: conv + SiLU, chunked gated delta rule
        qkv, z, a, b = in_proj(layer, x)
        y, conv_state = causal_conv1d_ref(qkv, layer.conv1d.weight.squeeze(1))
        q, k, v = y.split([h * dk, h * dk, layer.num_v_heads * dv], dim=-1)
        g = -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias)
        o, state = chunk_gated_delta_rule_ref(
            q.unflatten(-1, (h, dk)), k.unflatten(-1, (h, dk)), v.unflatten(-1, (-1, dv)), g, b.sigmoid()
        )
        out = out_proj(layer, o, z.unflatten(-1, (-1, dv)))
        assert_close(out, expected, TOL[dtype] if dtype != torch.float32 else 1e-5, "prefill output")
        cache_layer = cache.layers[0]
        assert torch.equal(conv_state, cache_layer.conv_states[0][..., 1:])
        assert_close(state, cache_layer.recurrent_states[0], 1e-5, "prefill state")

        for step in range(2):  # decode from upstream's cache: bit-exact
            x1 = torch.randn(bsz, 1, config.hidden_size).to(dtype)
            position = t + step
            conv_state = conv_ring(cache_layer.conv_states[0][..., 1:], position)
            state = cache_layer.recurrent_states[0].clone()
            expected = layer(x1, cache_params=cache)
            qkv, z, a, b = in_proj(layer, x1)
            o = gated_delta_rule_decode_ref(
                qkv[:, 0], a[:, 0], b[:, 0], conv_state, torch.full((bsz,), position), layer.conv1d.weight.squeeze(1),
                layer.A_log, layer.dt_bias, state, h, dk, dv,
            )
            assert o.shape == (bsz, layer.num_v_heads, dv) and o.dtype == dtype
            assert torch.equal(out_proj(layer, o[:, None], z.unflatten(-1, (-1, dv))), expected), f"step {step}"
            assert torch.equal(ring_window(conv_state, torch.full((bsz,), position + 1)),
                               cache_layer.conv_states[0][..., 1:])
            assert torch.equal(state, cache_layer.recurrent_states[0])


def test_conv_ring_round_trip():
    # K = 4: positions 0 .. 6 of one channel; after each prefix the ring holds its last 3 inputs (zeros before 0)
    x = torch.arange(1.0, 8.0)[None, None]  # [1, 1, 7]: the input at position p is p + 1
    for t in range(8):
        last = F.pad(x[..., :t], (3, 0))[..., -3:]  # positions t-3 .. t-1
        ring = conv_ring(last, t)
        for p in range(t - 3, t):
            assert ring[0, 0, p % 4] == (p + 1 if p >= 0 else 0), (t, p)
        assert ring[0, 0, t % 4] == 0
        assert torch.equal(ring_window(ring, torch.tensor([t])), last)


# Hop 2: the fused decode kernel against its reference.


def decode_inputs(bsz, h, hv, dk, dv, kernel_size, dtype, device, strided=False):
    """A random conv ring (every slot nonzero, so a slot read at the wrong position shows) and positions that
    differ per sequence and start at 0, K-1 and beyond, so slots wrap around differently."""
    c = 2 * h * dk + hv * dv
    mixed_qkv = (2 * torch.randn(bsz, c + (7 if strided else 0), device=device)).to(dtype)[:, :c]
    a = torch.randn(bsz, hv, device=device).to(dtype)
    b = torch.randn(bsz, hv, device=device).to(dtype)
    conv_state = (2 * torch.randn(bsz, c, kernel_size, device=device)).to(dtype)
    positions = (torch.arange(bsz, device=device) * (kernel_size + 2)) % 11
    conv_weight = (0.5 * torch.randn(c, kernel_size, device=device)).to(dtype)
    a_log = torch.empty(hv, device=device).uniform_(0.01, 16).log()
    dt_bias = torch.randn(hv, device=device).to(dtype)
    state = 0.1 * torch.randn(bsz, hv, dk, dv, device=device)
    return mixed_qkv, a, b, conv_state, positions, conv_weight, a_log, dt_bias, state


# fp32 results of the step's short sums (Dk = 128 products) in another order, exp and rsqrt
FP32_SUMS_TOL = 2e-6


def check_decode(args, h, dk, dv, steps, what, nearly_exact=False):
    """Runs `steps` decode steps of kernel and reference (positions advancing), each on its own copy of the
    states."""
    mixed_qkv, a, b, conv_state, positions, conv_weight, a_log, dt_bias, state = args
    dtype = mixed_qkv.dtype
    conv_ref, state_ref = conv_state.clone(), state.clone()
    for step in range(steps):
        if step:
            mixed_qkv = (2 * torch.randn_like(mixed_qkv, dtype=torch.float32)).to(dtype)
            positions = positions + 1
        o = gated_delta_rule_decode(mixed_qkv, a, b, conv_state, positions, conv_weight, a_log, dt_bias, state,
                                    h, dk, dv)
        o_ref = gated_delta_rule_decode_ref(mixed_qkv, a, b, conv_ref, positions, conv_weight, a_log, dt_bias,
                                            state_ref, h, dk, dv)
        assert o.dtype == dtype
        check_decode_output(o, o_ref, f"{what} step {step}: o", nearly_exact)
        assert torch.equal(conv_state, conv_ref), f"{what} step {step}: conv_state"
        # state is fp32; a bf16/fp16 SiLU output that rounds the other way (an fp32 ulp of exp apart from torch's,
        # on a rounding boundary: seen on the CPU too) moves its row or column by that output's ulp
        assert_close(state, state_ref, FP32_SUMS_TOL if dtype == torch.float32 else 3e-4,
                     f"{what} step {step}: recurrent_state")


def check_decode_output(o, o_ref, what, nearly_exact):
    """The conv, SiLU and beta round where upstream rounds, the state math is fp32 and o rounds once. A q/k SiLU
    output that rounds the other way (the kernel's exp within an fp32 ulp of torch's) moves every output of the value
    heads reading that key head by under an ulp, so any share of a small head's outputs can round the other way:
    under the interpreter every output is within an ulp (bf16: o's last step is a plain cast, which truncates
    there); on the GPU, at real sizes, ~1% of them differ."""
    if o.dtype == torch.float32:
        assert_close(o, o_ref, FP32_SUMS_TOL, what)
        return
    assert_close(o, o_ref, TOL[o.dtype], what)
    if o.device.type == "cpu" and o.dtype == torch.bfloat16:
        assert_truncated(o, o_ref, what, max_frac=5e-2)
    elif o.device.type == "cpu":
        assert_nearly_exact(o, o_ref, what, max_ulp=1.0, max_frac=1.0)
    elif nearly_exact:
        assert_nearly_exact(o, o_ref, what, max_ulp=None, max_frac=3e-2)


DECODE_SHAPES = [
    (1, 1, 1, 16, 16, 4),  # one sequence, one head
    (2, 2, 4, 16, 32, 4),  # grouped value heads (HV = 2 H), as Qwen3.5
    (3, 1, 3, 24, 40, 2),  # Dk, Dv not powers of 2 (masked tiles, two Dv blocks), conv K=2, 3 value heads a key head
]


@pytest.mark.parametrize("strided", [False, True], ids=["packed", "strided-rows"])
@pytest.mark.parametrize("bsz, h, hv, dk, dv, kernel_size", DECODE_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("device", DEVICES)
def test_decode_kernel_matches_ref(device, dtype, bsz, h, hv, dk, dv, kernel_size, strided):
    args = decode_inputs(bsz, h, hv, dk, dv, kernel_size, dtype, device, strided)
    check_decode(args, h, dk, dv, steps=2, what=f"{(bsz, h, hv, dk, dv, kernel_size)} {dtype}")


@pytest.mark.parametrize("device", DEVICES)
def test_decode_kernel_real_width(device):
    # Qwen3.5-9B: 16 key heads, 32 value heads, Dk = Dv = 128, conv K = 4; one sequence on the CPU
    bsz = 1 if device == "cpu" else 8
    args = decode_inputs(bsz, 16, 32, 128, 128, 4, torch.bfloat16, device)
    check_decode(args, 16, 128, 128, steps=1, what="9B widths", nearly_exact=device == "cuda")


@pytest.mark.parametrize("bsz", [1, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.gpu
def test_decode_kernel_real_shapes_gpu(dtype, bsz):
    args = decode_inputs(bsz, 16, 32, 128, 128, 4, dtype, "cuda", strided=True)
    check_decode(args, 16, 128, 128, steps=4, what=f"9B B={bsz} {dtype}", nearly_exact=True)


@pytest.mark.gpu
def test_decode_kernel_fp32_gpu():
    args = decode_inputs(4, 16, 32, 128, 128, 4, torch.float32, "cuda")
    check_decode(args, 16, 128, 128, steps=3, what="9B fp32")


@pytest.mark.parametrize("device", DEVICES)
def test_decode_kernel_decay_over_the_softplus_range(device):
    # Zero input and conv state make q = k = v = 0, so the step only decays the state: S = S * exp(g) with
    # g = -exp(A_log) * softplus(a + dt_bias). a runs over softplus's series (exp(a) < 1e-2), log and linear
    # (a > 20) branches; exp(A_log) = 16 below a = 4, 0.05 above, to keep exp(g) inside fp32's range.
    args = list(decode_inputs(1, 2, 64, 16, 16, 4, torch.float32, device))
    args[0], args[3] = torch.zeros_like(args[0]), torch.zeros_like(args[3])
    a = torch.cat([torch.linspace(-30, 4, 48), torch.linspace(18, 30, 16)]).double().to(device)
    rate = torch.where(a < 10, 16.0, 0.05)
    args[1], args[6], args[7] = a[None].float(), rate.float().log(), args[7].zero_()
    before = args[8].clone()
    gated_delta_rule_decode(*args, 2, 16, 16)
    g = (args[8] / before).double().mean(dim=(0, 2, 3)).log()  # [HV]
    expected = -rate * torch.nn.functional.softplus(a)
    # fp32 exp and the state product round: ~1e-7 of |g|; softplus as plain log(1 + e) fails this (5e-7 at a = -3)
    assert ((g - expected).abs() <= 2.5e-7 * expected.abs().clamp(min=1)).all(), (g - expected)


def test_decode_validation():
    args = list(decode_inputs(2, 2, 4, 16, 32, 4, torch.bfloat16, "cpu"))
    calls = [
        ((1, 16, 16), "do not fit num_k_heads=1"),
        ((2, 16, 16), "do not fit num_k_heads=2, head_k_dim=16, head_v_dim=16"),
    ]
    for (h, dk, dv), message in calls:
        with pytest.raises(ValueError, match=re.escape(message)):
            gated_delta_rule_decode(*args, h, dk, dv)
    bad = {
        3: (args[3].float(), "conv_state has dtype torch.float32"),
        4: (args[4].int(), "positions has dtype torch.int32"),
        5: (args[5][:, :3], "conv_weight must have shape (192, 4), got (192, 3)"),
        8: (args[8].bfloat16(), "recurrent_state has dtype torch.bfloat16"),
        2: (args[2][:1], "b must have shape (2, 4), got (1, 4)"),
    }
    for i, (value, message) in bad.items():
        call = list(args)
        call[i] = value
        with pytest.raises(ValueError, match=re.escape(message)):
            gated_delta_rule_decode(*call, 2, 16, 32)
    with pytest.raises(ValueError, match=re.escape("conv_state must have shape [B, C, K] = [2, 192, K] with K >= 2")):
        gated_delta_rule_decode(*args[:3], args[3][..., :1], *args[4:], 2, 16, 32)
    state_dv_major = args[8].transpose(2, 3).contiguous().transpose(2, 3)  # right shape, wrong layout
    with pytest.raises(ValueError, match="recurrent_state must be contiguous"):
        gated_delta_rule_decode(*args[:8], state_dv_major, 2, 16, 32)


# ---- the prefill's causal conv + SiLU kernel

CONV_SHAPES = [  # (B, T, C, K, initial state)
    (1, 1, 5, 4, False),  # one token: the taps before it read zeros
    (1, 2, 33, 4, True),  # T < K-1: the final state keeps part of the initial one
    (2, 37, 70, 4, True),  # odd T and C, partial tiles in both
    (2, 40, 64, 2, False),
]


def conv_inputs(bsz, t, c, k, with_state, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    packed = torch.randn(bsz, t, c + 9, generator=g).to(device, dtype)  # x is a strided slice of a projection
    weight = (torch.randn(c, k, generator=g) * 0.5).to(device, dtype)
    state = torch.randn(bsz, c, k - 1, generator=g).to(device, dtype) if with_state else None
    return packed[..., 3:3 + c], weight, state


@pytest.mark.parametrize("shape", CONV_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("device", DEVICES)
def test_causal_conv1d_matches_ref(device, dtype, shape):
    x, weight, state = conv_inputs(*shape, dtype, device)
    y, final_state = causal_conv1d(x, weight, state)
    y_ref, final_ref = causal_conv1d_ref(x, weight, state)
    assert y.is_contiguous() and torch.equal(final_state, final_ref)
    # The conv's fp32 sum (K taps) runs in another order than F.conv1d's and rounds once, SiLU rounds again: a sum
    # that rounds the other way moves SiLU's output by up to 2 ulp. SiLU's output is a plain cast, which truncates
    # bf16 under the interpreter; the conv's output without SiLU is rounded (round_to) first.
    assert_matches_ref(y, y_ref, f"{shape} {dtype}", max_ulp=2.0, max_frac=1e-3, gpu=(2.0, 1e-2),
                       truncating_store=True)
    y_linear, _ = causal_conv1d(x, weight, state, activation=None)
    y_linear_ref = causal_conv1d_ref(x, weight, state, activation=None)[0]
    assert_matches_ref(y_linear, y_linear_ref, f"{shape} {dtype} no SiLU", max_ulp=1.0, max_frac=1e-3, gpu=(1.0, 1e-2))
    # split: the channel groups as separate contiguous tensors, the same values (an empty group included)
    c = x.shape[-1]
    for split in ((c // 4, c // 4, c - 2 * (c // 4)), (0, c - 1, 1)):
        parts, split_state = causal_conv1d(x, weight, state, split=split)
        assert all(p.is_contiguous() and p.shape == (*x.shape[:2], n) for p, n in zip(parts, split))
        assert torch.equal(torch.cat(parts, dim=-1), y) and torch.equal(split_state, final_ref), split


@pytest.mark.parametrize("t", [128, 2048])
@pytest.mark.gpu
def test_causal_conv1d_real_width_gpu(t):
    # Qwen3.5-9B: C = 2 x 16 x 128 + 32 x 128 = 8192 conv channels, K = 4, one prompt
    x, weight, _ = conv_inputs(1, t, 8192, 4, False, torch.bfloat16, "cuda")
    y, final_state = causal_conv1d(x, weight)
    y_ref, final_ref = causal_conv1d_ref(x, weight)
    assert torch.equal(final_state, final_ref)
    assert torch.equal(torch.cat(causal_conv1d(x, weight, split=(2048, 2048, 4096))[0], dim=-1), y)  # q | k | v
    # fp32 sums in another order than cuDNN's: an ulp where a rounding flips, then through SiLU
    assert_nearly_exact(y, y_ref, f"T={t}", max_ulp=2, max_frac=1e-2)


def test_causal_conv1d_validation():
    x, weight, state = conv_inputs(2, 5, 8, 4, True, torch.float32, "cpu")
    with pytest.raises(ValueError, match=re.escape("weight has shape (9, 4); expected [C, K] = [8, K]")):
        causal_conv1d(x, weight.new_zeros(9, 4))
    with pytest.raises(ValueError, match=re.escape("initial_state must have shape (2, 8, 3), got (2, 8, 2)")):
        causal_conv1d(x, weight, state[..., :2].contiguous())
    with pytest.raises(ValueError, match="activation must be 'silu' or None, got 'gelu'"):
        causal_conv1d(x, weight, state, activation="gelu")
    message = "split=(4, 4, 1): must be three channel counts >= 0 summing to C=8"
    with pytest.raises(ValueError, match=re.escape(message)):
        causal_conv1d(x, weight, state, split=(4, 4, 1))
