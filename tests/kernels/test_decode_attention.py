import re

import pytest
import torch
import torch.nn.functional as F

from helpers import DEVICES, DTYPES, assert_close, assert_matches_ref
from qwen_image_fast.kernels.decode_attention import decode_attention, decode_attention_ref

DTYPE_IDS = [str(d).removeprefix("torch.") for d in DTYPES]
FP32_SUMS_TOL = 5e-6  # fp32 softmax and sums over up to L keys and D dims, in another order than the reference's


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def bits(t: torch.Tensor) -> torch.Tensor:
    """t's bit patterns, so that equality holds through NaN (any strides)."""
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def attention_inputs(bsz, h, kvh, d, max_len, positions, dtype, device, strided_cache=False, garbage=float("nan")):
    """q, gate: [B, H, D] views of one [B, H, 2D] projection output ([query | gate] per head, as Qwen3.5's q_proj);
    k, v: [B, KVH, D] views of one [B, 2, KVH, D] tensor; caches [B, L, KVH, D] holding `garbage` at and past each
    sequence's position (the step writes the key at the position); positions [B] int64. strided_cache: the caches
    are [KVH, B, L, D] buffers seen as [B, L, KVH, D]."""
    qg = torch.randn(bsz, h, 2 * d, device=device).to(dtype)
    kv = torch.randn(bsz, 2, kvh, d, device=device).to(dtype)
    caches = []
    for _ in range(2):
        if strided_cache:
            cache = torch.randn(kvh, bsz, max_len, d, device=device).to(dtype).permute(1, 2, 0, 3)
        else:
            cache = torch.randn(bsz, max_len, kvh, d, device=device).to(dtype)
        for b, p in enumerate(positions):
            cache[b, p:] = garbage
        caches.append(cache)
    pos = torch.tensor(positions, dtype=torch.int64, device=device)
    return qg[..., :d], kv[:, 0], kv[:, 1], caches[0], caches[1], pos, qg[..., d:]


# Hop 1: the reference against what the model runs today (index_put + masked SDPA, output * sigmoid(gate)).


@pytest.mark.parametrize("h, kvh", [(8, 2), (4, 4), (4, 1)], ids=["gqa4", "mha", "kvh1"])
def test_ref_matches_masked_sdpa(h, kvh):
    bsz, d, max_len = 3, 40, 33  # Qwen3.5-9B: H=16, KVH=4, D=256
    positions = [0, 17, 32]
    q, k, v, k_cache, v_cache, pos, _ = attention_inputs(bsz, h, kvh, d, max_len, positions, torch.float32, "cpu",
                                                         garbage=0.0)
    k_cache[:, 20:].normal_()  # random keys past some positions: the mask, not zeros, must hide them
    v_cache[:, 20:].normal_()
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    o = decode_attention_ref(q, k, v, k_ref, v_ref, pos)
    # pipelines/qwen35/model.py AttentionLayer.decode
    rows = torch.arange(bsz)
    k_cache[rows, pos] = k
    v_cache[rows, pos] = v
    mask = (torch.arange(max_len)[None, :] <= pos[:, None])[:, None, None]  # [B, 1, 1, L]
    expected = F.scaled_dot_product_attention(q.reshape(bsz, kvh, h // kvh, d), k_cache.transpose(1, 2),
                                              v_cache.transpose(1, 2), attn_mask=mask).reshape(bsz, h, d)
    assert torch.equal(k_ref, k_cache) and torch.equal(v_ref, v_cache)
    assert_close(o, expected, 1e-6, "ref vs SDPA")
    o_scaled = decode_attention_ref(q, k, v, k_cache.clone(), v_cache.clone(), pos, scale=0.3)
    expected = F.scaled_dot_product_attention(q.reshape(bsz, kvh, h // kvh, d), k_cache.transpose(1, 2),
                                              v_cache.transpose(1, 2), attn_mask=mask, scale=0.3)
    assert_close(o_scaled, expected.reshape(bsz, h, d), 1e-6, "ref vs SDPA, scale=0.3")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_ref_gate_is_upstream_rounding(dtype):
    *inputs, gate = attention_inputs(2, 8, 2, 48, 9, [3, 8], dtype, "cpu")
    o = decode_attention_ref(*inputs[:3], inputs[3].clone(), inputs[4].clone(), inputs[5])
    gated = decode_attention_ref(*inputs[:3], inputs[3].clone(), inputs[4].clone(), inputs[5], gate)
    assert o.dtype == gated.dtype == dtype
    assert torch.equal(gated, o * torch.sigmoid(gate))  # Qwen3_5Attention: attn_output * torch.sigmoid(gate)
    # what the kernel computes: fp32 sigmoid rounded to the dtype, fp32 product rounded to the dtype
    assert torch.equal(gated, (o.float() * torch.sigmoid(gate.float()).to(dtype).float()).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_ref_matches_qwen35_attention_decode_step(monkeypatch, dtype):
    """One decode step of transformers' Qwen3_5Attention (the gated full-attention layer: q_proj's [query | gate]
    per head, grouped KV heads, the new key appended to the past ones, output * sigmoid(gate)): the reference given
    the same query, key, value, past keys in a cache and gate gives what upstream feeds its o_proj."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as upstream
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    bsz, h, kvh, d, past = 2, 8, 2, 16, 11  # Qwen3.5-9B: 16 query heads over 4 KV heads of 256
    config = Qwen3_5TextConfig(hidden_size=64, num_attention_heads=h, num_key_value_heads=kvh, head_dim=d)
    config._attn_implementation = "eager"
    attn = upstream.Qwen3_5Attention(config, layer_idx=0).to(dtype).eval()
    seen = {}

    def eager(module, query, key, value, *args, **kwargs):  # [B, H, 1, D], [B, KVH, past + 1, D] (cache appended)
        seen.update(query=query, key=key, value=value)
        return eager_upstream(module, query, key, value, *args, **kwargs)

    eager_upstream = upstream.eager_attention_forward
    monkeypatch.setattr(upstream, "eager_attention_forward", eager)
    attn.q_proj.register_forward_hook(lambda m, args, out: seen.update(q_proj=out))
    attn.o_proj.register_forward_pre_hook(lambda m, args: seen.update(gated=args[0]))

    class PastKeys:  # what transformers' DynamicCache does for a full-attention layer
        def __init__(self):
            self.k = torch.randn(bsz, kvh, past, d).to(dtype)
            self.v = torch.randn(bsz, kvh, past, d).to(dtype)

        def update(self, k, v, layer_idx):
            return torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)

    cache = PastKeys()
    cos, sin = torch.randn(bsz, 1, d).to(dtype), torch.randn(bsz, 1, d).to(dtype)
    with torch.no_grad():
        attn(torch.randn(bsz, 1, 64).to(dtype), (cos, sin), None, past_key_values=cache)

    gate = seen["q_proj"].view(bsz, h, 2 * d)[..., d:]  # [B, H, D]: each head's second half, as upstream chunks it
    max_len = past + 5
    k_cache = torch.full((bsz, max_len, kvh, d), float("nan")).to(dtype)  # [B, L, KVH, D], garbage past the step
    v_cache = k_cache.clone()
    k_cache[:, :past], v_cache[:, :past] = cache.k.transpose(1, 2), cache.v.transpose(1, 2)
    o = decode_attention_ref(seen["query"][:, :, 0], seen["key"][:, :, -1], seen["value"][:, :, -1], k_cache, v_cache,
                             torch.full((bsz,), past), gate)
    assert torch.equal(k_cache[:, : past + 1].transpose(1, 2), seen["key"])  # the step's key written at `past`
    # bf16: upstream's eager attention rounds its scores and probabilities to bf16 (4.4e-3 here), the reference
    # and the kernel keep them in fp32
    assert_close(o.reshape(bsz, 1, h * d), seen["gated"], 1e-6 if dtype == torch.float32 else 8e-3,
                 "reference vs Qwen3_5Attention")


# Hop 2: the kernel against the reference.

SHAPES = [  # (B, H, KVH, D, L, positions, strided caches)
    (1, 2, 2, 40, 1, [0], False),  # L=1, H == KVH, D not a power of 2
    (3, 6, 2, 48, 7, [0, 3, 6], True),  # 3 query heads per KV head, first and last position, [KVH, B, L, D] caches
    (3, 4, 1, 40, 300, [0, 150, 299], False),  # KVH=1, 19 splits of 64-key chunks: most empty at p=0 and p=150
    (1, 16, 4, 256, 300, [299], False),  # Qwen3.5-9B heads: 19 splits of one 16-key tile each
]


def check_step(inputs, gate, scale=None, what=""):
    """One step of kernel and reference, each on its own copy of the caches."""
    q, k, v, k_cache, v_cache, pos = inputs
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    o = decode_attention(q, k, v, k_cache, v_cache, pos, gate, scale)
    o_ref = decode_attention_ref(q, k, v, k_ref, v_ref, pos, gate, scale)
    assert o.dtype == q.dtype and o.is_contiguous()
    # rounded where the reference rounds (o, sigmoid, the gated product; round_to, exact under the interpreter too);
    # the fp32 softmax and sums over up to L keys run in another order and flip a few roundings, by many ulp where
    # the sum over values cancels to near zero
    assert_matches_ref(o, o_ref, f"{what}: o", max_ulp=None, max_frac=1e-2, fp32_tol=FP32_SUMS_TOL)
    assert torch.equal(bits(k_cache), bits(k_ref)), f"{what}: k_cache"
    assert torch.equal(bits(v_cache), bits(v_ref)), f"{what}: v_cache"
    rows = torch.arange(len(pos), device=pos.device)
    assert torch.equal(k_cache[rows, pos], k) and torch.equal(v_cache[rows, pos], v), f"{what}: new key/value"


@pytest.mark.parametrize("gated", [False, True], ids=["no-gate", "gate"])
@pytest.mark.parametrize("bsz, h, kvh, d, max_len, positions, strided_cache", SHAPES,
                         ids=["B1-L1-mha-D40", "B3-L7-gqa3-D48", "B3-L300-kvh1-D40", "B1-L300-9B-heads"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("device", DEVICES)
def test_decode_attention_matches_ref(device, dtype, bsz, h, kvh, d, max_len, positions, strided_cache, gated):
    *inputs, gate = attention_inputs(bsz, h, kvh, d, max_len, positions, dtype, device, strided_cache)
    check_step(inputs, gate if gated else None, what=f"{(bsz, h, kvh, d, max_len)} {dtype}")


@pytest.mark.parametrize("device", DEVICES)
def test_decode_attention_scale_and_steps(device):
    # three steps as a decode loop runs them: the positions advance, each step sees the keys the last ones wrote
    inputs = list(attention_inputs(2, 8, 2, 48, 70, [62, 0], torch.float16, device)[:6])
    for step in range(3):
        if step:
            inputs[:3] = [torch.randn_like(t, dtype=torch.float32).to(t.dtype) for t in inputs[:3]]
            inputs[5] = inputs[5] + 1
        check_step(inputs, None, scale=0.2, what=f"step {step}")


@pytest.mark.parametrize("bsz, positions", [(1, [4095]), (1, [200]), (8, [0, 1, 63, 64, 1000, 2047, 4000, 4095])])
@pytest.mark.gpu
def test_decode_attention_real_shapes_gpu(bsz, positions):
    # Qwen3.5-9B attention layers: 16 query heads, 4 KV heads, head_dim 256; a 4096-token cache
    *inputs, gate = attention_inputs(bsz, 16, 4, 256, 4096, positions, torch.bfloat16, "cuda")
    check_step(inputs, gate, what=f"B={bsz} {positions}")


@pytest.mark.gpu
def test_decode_attention_cuda_graph():
    # captured once, replayed while the positions advance on the device
    bsz, h, kvh, d, max_len = 8, 16, 4, 256, 512
    q, k, v, k_cache, v_cache, pos, gate = attention_inputs(bsz, h, kvh, d, max_len, list(range(0, 400, 50)),
                                                            torch.bfloat16, "cuda")
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    decode_attention(q, k, v, k_cache.clone(), v_cache.clone(), pos, gate)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = decode_attention(q, k, v, k_cache, v_cache, pos, gate)
    for step in range(3):
        for t in (q, k, v):
            t.copy_(torch.randn_like(t, dtype=torch.float32))
        graph.replay()
        o_ref = decode_attention_ref(q, k, v, k_ref, v_ref, pos, gate)
        assert_matches_ref(o, o_ref, f"replay {step}", max_ulp=None, max_frac=1e-2)
        assert torch.equal(bits(k_cache), bits(k_ref)) and torch.equal(bits(v_cache), bits(v_ref)), f"replay {step}"
        pos += 1


def test_decode_attention_validation():
    q, k, v, k_cache, v_cache, pos, gate = attention_inputs(2, 8, 2, 16, 5, [1, 4], torch.float32, "cpu")
    good = dict(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, positions=pos, gate=gate)
    bad = [
        ("q", q.long(), "q has dtype torch.int64; allowed: torch.float32, torch.float16, torch.bfloat16"),
        ("k", k.half(), "k has dtype torch.float16; allowed: torch.float32"),
        ("k", k[:, :1].expand(2, 3, 16), "k has shape (2, 3, 16); expected [B, KVH, D] = [2, KVH, 16] with H=8 a "
                                         "multiple of KVH"),
        ("k", k[:, :, :8], "k has shape (2, 2, 8)"),
        ("v", v[:1], "v must have shape (2, 2, 16), got (1, 2, 16)"),
        ("k_cache", k_cache[:, :, :1], "k_cache has shape (2, 5, 1, 16); expected [B, L, KVH, D] = [2, L, 2, 16]"),
        ("k_cache", k_cache[:, :0], "with L >= 1"),
        ("v_cache", v_cache.bfloat16(), "v_cache has dtype torch.bfloat16"),
        ("v_cache", v_cache[:, :4], "v_cache must have shape (2, 5, 2, 16), got (2, 4, 2, 16)"),
        ("positions", pos.int(), "positions has dtype torch.int32; allowed: torch.int64"),
        ("positions", pos[:1], "positions must have shape (2,), got (1,)"),
        ("gate", gate[:, :4], "gate must have shape (2, 8, 16), got (2, 4, 16)"),
        ("q", q.transpose(1, 2).contiguous().transpose(1, 2), "q must be contiguous in its last dim"),
    ]
    for name, value, message in bad:
        with pytest.raises(ValueError, match=re.escape(message)):
            decode_attention(**dict(good, **{name: value}))
    assert decode_attention(q[:0], k[:0], v[:0], k_cache[:0], v_cache[:0], pos[:0]).shape == (0, 8, 16)
