import pytest
import torch
from diffusers.models.transformers import transformer_qwenimage
from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope, QwenImageTransformerBlock

from helpers import DEVICES, DTYPES, assert_close, assert_matches_ref
from qwen_image_fast.kernels._utils import FP8_DTYPE, FP8_MAX
from qwen_image_fast.kernels.qkv_pack import qkv_pack, qkv_pack_ref, rms_norm_fp8_scale
from qwen_image_fast.kernels.rms_norm import rms_norm_ref
from qwen_image_fast.kernels.rope import rope_qwen_image_ref

SENTINEL = 7.0  # pre-filled into the joint buffers; rows outside [seq_offset, seq_offset + L) must keep it
# q, k: the norm rounds where diffusers' does, the rotation is fp32 and rounds once. rstd's sum runs in another order
# (on the GPU also through an approximate rsqrt), so a normed value can round the other way, and the rotation's
# difference of products can cancel that ulp into several. The last step is a plain cast: under the interpreter
# bf16 truncates there (assert_truncated).
QK_BOUNDS = dict(max_ulp=None, max_frac=1e-3, gpu=(None, 1e-2), truncating_store=True)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def joint_buffers(b, s, h, d, dtype, device):
    return [torch.full((b, s, h, d), SENTINEL, dtype=dtype, device=device) for _ in range(3)]


def upstream_joint_qkv(block, img, txt, image_rotary_emb, monkeypatch):
    """Runs the block's attention processor and captures the joint [B, S, H, D] q, k, v it hands to attention."""
    captured = {}

    def capture(query, key, value, **kwargs):
        captured.update(q=query, k=key, v=value)
        return query

    monkeypatch.setattr(transformer_qwenimage, "dispatch_attention_fn", capture)
    block.attn(hidden_states=img, encoder_hidden_states=txt, image_rotary_emb=image_rotary_emb)
    return captured["q"], captured["k"], captured["v"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qkv_pack_ref_matches_diffusers(dtype, device, monkeypatch):
    torch.manual_seed(0)
    b, h, d = 2, 3, 16  # Qwen-Image: H=24, D=128
    block = QwenImageTransformerBlock(dim=h * d, num_attention_heads=h, attention_head_dim=d)  # dim 3072
    for norm in (block.attn.norm_q, block.attn.norm_k, block.attn.norm_added_q, block.attn.norm_added_k):
        norm.weight.data = 1.0 + 0.3 * torch.randn(d)  # upstream initializes them to ones
    block = block.to(device=device, dtype=dtype)
    frame_hw, l_txt = (1, 4, 6), 7  # 24 image tokens; Qwen-Image at 1328x1328: 4096 image + up to ~218 text
    rope = QwenEmbedRope(10000, [8, 4, 4], scale_rope=True)  # [16, 56, 56]
    img_freqs, txt_freqs = rope([frame_hw], device=torch.device(device), max_txt_seq_len=l_txt)
    l_img = img_freqs.shape[0]
    img = torch.randn(b, l_img, h * d, device=device).to(dtype)
    txt = torch.randn(b, l_txt, h * d, device=device).to(dtype)
    with torch.no_grad():
        joint = upstream_joint_qkv(block, img, txt, (img_freqs, txt_freqs), monkeypatch)  # [text, image] rows
        attn = block.attn
        img_qkv = torch.cat([attn.to_q(img), attn.to_k(img), attn.to_v(img)], dim=-1)
        txt_qkv = torch.cat([attn.add_q_proj(txt), attn.add_k_proj(txt), attn.add_v_proj(txt)], dim=-1)
    img_args = (img_qkv, attn.norm_q.weight.detach(), attn.norm_k.weight.detach(), torch.view_as_real(img_freqs))
    txt_args = (txt_qkv, attn.norm_added_q.weight.detach(), attn.norm_added_k.weight.detach(),
                torch.view_as_real(txt_freqs))

    out = joint_buffers(b, l_txt + l_img, h, d, dtype, device)
    qkv_pack_ref(*txt_args, *out, seq_offset=0)
    qkv_pack_ref(*img_args, *out, seq_offset=l_txt)
    for name, got, expected in zip("qkv", out, joint):
        assert torch.equal(got, expected), f"{name} (text first) differs from diffusers"

    out = joint_buffers(b, l_txt + l_img, h, d, dtype, device)
    qkv_pack_ref(*img_args, *out, seq_offset=0)
    qkv_pack_ref(*txt_args, *out, seq_offset=l_img)
    for name, got, expected in zip("qkv", out, joint):
        assert torch.equal(got, torch.cat([expected[:, l_txt:], expected[:, :l_txt]], dim=1)), f"{name} (image first)"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "b, l, h, d, s, seq_offset, pad",
    [
        (1, 1, 3, 16, 1, 0, 0),  # one token filling the whole buffer
        (1, 1, 3, 16, 5, 4, 0),  # the last row
        (2, 37, 3, 16, 45, 5, 8),  # odd L in the middle; qkv rows strided (pad columns)
        (1, 4, 2, 24, 6, 2, 0),  # D=24: masked tail of the [BLOCK_H, 32] tile
        (1, 3, 24, 128, 5, 1, 0),  # Qwen-Image: H=24, D=128, three head blocks
    ],
)
def test_qkv_pack_matches_ref(b, l, h, d, s, seq_offset, pad, dtype, device):
    if device == "cuda":
        l, s = 64 * l, 64 * s
    qkv = torch.randn(b, l, 3 * h * d + pad, device=device).to(dtype)[..., : 3 * h * d]
    w_q = (1.0 + 0.3 * torch.randn(d, device=device)).to(dtype)
    w_k = (1.0 + 0.3 * torch.randn(d, device=device)).to(dtype)
    freqs = torch.view_as_real(torch.polar(torch.ones(l, d // 2), 6.0 * torch.rand(l, d // 2))).to(device)
    out = joint_buffers(b, s, h, d, dtype, device)
    ref = joint_buffers(b, s, h, d, dtype, device)
    qkv_pack(qkv, w_q, w_k, freqs, *out, seq_offset=seq_offset)
    qkv_pack_ref(qkv, w_q, w_k, freqs, *ref, seq_offset=seq_offset)
    rows = slice(seq_offset, seq_offset + l)
    for name, got, expected in zip("qk", out, ref):
        assert_matches_ref(got[:, rows], expected[:, rows], f"qkv_pack {name} {(b, l, h, d)} {dtype}", **QK_BOUNDS)
    for name, got in zip("qkv", out):
        outside = torch.cat([got[:, :seq_offset], got[:, seq_offset + l :]], dim=1)
        assert (outside == SENTINEL).all(), f"{name}: a row outside [{seq_offset}, {seq_offset + l}) was written"
    assert torch.equal(out[2][:, rows], qkv[..., 2 * h * d :].unflatten(-1, (h, d))), "v must be copied exactly"


# ---- FP8 attention operands: q and k quantized with the RMSNorm bound's scale, v as it is

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_fp8_scale_bounds_every_input(dtype):
    """|rope(rms_norm(x) * w)| <= 448 * scale for any x: random rows, and the worst case (x one-hot where |w| is
    largest: sqrt(D) * max|w| in one pair, rotated), which comes within the margin of 448."""
    d, h = 128, 4
    w_img, w_txt = (1.0 + 0.3 * torch.randn(d)).to(dtype), (1.0 + 0.6 * torch.randn(d)).to(dtype)
    scale = rms_norm_fp8_scale([w_img, w_txt], d)
    top = max(w_img.float().abs().max(), w_txt.float().abs().max())
    assert scale.shape == (1,) and scale.dtype == torch.float32
    x = torch.randn(3, 64, h, d).to(dtype) * torch.logspace(-3, 3, 64)[:, None, None]
    worst = torch.argmax(w_txt.float().abs())
    x[0, 0] = 0
    x[0, 0, :, worst] = 5.0
    freqs = torch.view_as_real(torch.polar(torch.ones(64, d // 2), 6.0 * torch.rand(64, d // 2)))
    for w in (w_img, w_txt):
        values = rope_qwen_image_ref(rms_norm_ref(x, w).float(), freqs) / scale
        assert values.abs().max() <= FP8_MAX
    worst_value = rope_qwen_image_ref(rms_norm_ref(x[:1, :1], w_txt).float(), freqs[:1]).abs().max() / scale
    assert worst_value > FP8_MAX * 0.7 * float(w_txt.float().abs().max() / top), worst_value


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8_v", [False, True])
@pytest.mark.parametrize("b, l, h, d, s, seq_offset", [(2, 37, 3, 16, 45, 5), (1, 3, 24, 128, 5, 1)])
def test_qkv_pack_fp8_matches_ref(b, l, h, d, s, seq_offset, fp8_v, dtype, device):
    """q and k as FP8 with the bound's scales (the values before the cast: the rotation's fp32 output times
    1 / scale, to the rotation's ulps; e4m3 codes on a GPU, a code apart where those ulps straddle a rounding), v
    as in BF16 mode or, given a scale, as FP8 too (bit-equal), nothing outside the rows written."""
    if device == "cuda":
        l, s = 64 * l, 64 * s
    qkv = torch.randn(b, l, 3 * h * d, device=device).to(dtype)
    w_q = (1.0 + 0.3 * torch.randn(d, device=device)).to(dtype)
    w_k = (1.0 + 0.3 * torch.randn(d, device=device)).to(dtype)
    freqs = torch.view_as_real(torch.polar(torch.ones(l, d // 2), 6.0 * torch.rand(l, d // 2))).to(device)
    scales = (rms_norm_fp8_scale([w_q], d), rms_norm_fp8_scale([w_k], d))
    v_scale = (qkv[..., 2 * h * d:].float().abs().amax() * 3 / 448).reshape(1) if fp8_v else None
    for q_dtype in (torch.float32,) + ((FP8_DTYPE,) if device == "cuda" else ()):
        out = [torch.full((b, s, h, d), SENTINEL, dtype=q_dtype, device=device) for _ in range(2)]
        out.append(torch.full((b, s, h, d), SENTINEL, dtype=q_dtype if fp8_v else dtype, device=device))
        ref = [t.clone() for t in out]
        qkv_pack(qkv, w_q, w_k, freqs, *out, seq_offset=seq_offset, qk_scales=scales, v_scale=v_scale)
        qkv_pack_ref(qkv, w_q, w_k, freqs, *ref, seq_offset=seq_offset, qk_scales=scales, v_scale=v_scale)
        rows = slice(seq_offset, seq_offset + l)
        for name, got, expected in zip("qk", out, ref):
            got, expected = got[:, rows].float(), expected[:, rows].float()
            if q_dtype == torch.float32:  # a GPU's approximate rsqrt flips a normed value's rounding now and then
                assert_close(got, expected, 1e-6 if device == "cpu" else 3e-4, f"qkv_pack fp8 {name} pre-cast")
                assert got.abs().max() <= FP8_MAX
            else:  # e4m3: 3 mantissa bits, a code is up to 2^-3 relative apart
                differ = got != expected
                assert differ.float().mean() < 1e-3, f"{name}: {differ.float().mean():.2e} of the codes differ"
                assert ((got - expected).abs() <= expected.abs() / 8 + 2**-9)[differ].all()
        if fp8_v:  # a product and a clamp: bit-equal (the cast itself only on a GPU)
            assert torch.equal(out[2][:, rows].float(), ref[2][:, rows].float()), "v's FP8 values"
        else:
            assert torch.equal(out[2][:, rows], qkv[..., 2 * h * d:].unflatten(-1, (h, d))), "v copied exactly"
        for name, got in zip("qkv", out):
            outside = torch.cat([got[:, :seq_offset], got[:, seq_offset + l:]], dim=1).float()
            assert (outside == SENTINEL).all(), f"{name}: a row outside [{seq_offset}, {seq_offset + l}) was written"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qkv_pack_ref_fp8_branch_is_the_bf16_branch_scaled(dtype):
    """The reference's FP8 branch ties to its diffusers-checked one (test_qkv_pack_ref_matches_diffusers): its
    values before the cast, times their scales, are the plain branch's q, k and v (q, k: the rotation kept in fp32
    instead of rounded to the model's dtype, so to that dtype's rounding; v: to fp32's)."""
    b, l, h, d, s, offset = 2, 7, 3, 16, 9, 2
    qkv = torch.randn(b, l, 3 * h * d).to(dtype)
    w_q, w_k = ((1.0 + 0.3 * torch.randn(d)).to(dtype) for _ in range(2))
    freqs = torch.view_as_real(torch.polar(torch.ones(l, d // 2), 6.0 * torch.rand(l, d // 2)))
    scales = (rms_norm_fp8_scale([w_q], d), rms_norm_fp8_scale([w_k], d))
    v_scale = (qkv[..., 2 * h * d:].float().abs().amax() * 3 / 448).reshape(1)
    plain = [torch.zeros(b, s, h, d, dtype=dtype) for _ in range(3)]
    codes = [torch.zeros(b, s, h, d) for _ in range(3)]  # fp32: the values before the e4m3 cast
    qkv_pack_ref(qkv, w_q, w_k, freqs, *plain, seq_offset=offset)
    qkv_pack_ref(qkv, w_q, w_k, freqs, *codes, seq_offset=offset, qk_scales=scales, v_scale=v_scale)
    rows = slice(offset, offset + l)
    tol = 1e-6 if dtype == torch.float32 else 2**-8
    for name, expected, got, scale in zip("qkv", plain, codes, (*scales, v_scale)):
        assert_close(got[:, rows] * scale, expected[:, rows].float(), tol if name != "v" else 1e-6, name)


def test_qkv_pack_validation():
    b, l, h, d, s = 1, 4, 2, 16, 6
    qkv, w = torch.randn(b, l, 3 * h * d), torch.ones(d)
    freqs = torch.randn(l, d // 2, 2)
    out = joint_buffers(b, s, h, d, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"qkv has shape \(1, 4, 95\); expected \[B=1, L, 3 \* H \* D = 96\]"):
        qkv_pack(qkv[..., :95], w, w, freqs, *out, seq_offset=0)
    with pytest.raises(ValueError, match=r"freqs must have shape \(4, 8, 2\), got \(4, 16, 2\)"):
        qkv_pack(qkv, w, w, torch.randn(l, d, 2), *out, seq_offset=0)
    with pytest.raises(ValueError, match=r"seq_offset=3 with L=4 rows does not fit the joint buffers' S=6"):
        qkv_pack(qkv, w, w, freqs, *out, seq_offset=3)
    with pytest.raises(ValueError, match=r"seq_offset=-1"):
        qkv_pack(qkv, w, w, freqs, *out, seq_offset=-1)
    with pytest.raises(ValueError, match=r"norm_k_weight has dtype torch.float16"):
        qkv_pack(qkv, w, w.half(), freqs, *out, seq_offset=0)
    with pytest.raises(ValueError, match=r"q_out must have shape \(1, 5, 2, 16\), got \(1, 6, 2, 16\)"):
        qkv_pack(qkv, w, w, freqs, *out[:2], out[2][:, :5], seq_offset=0)
    scale = torch.ones(1)
    with pytest.raises(ValueError, match=r"q_out has dtype torch.bfloat16; allowed: torch.float8_e4m3fn, "):
        qkv_pack(qkv, w, w, freqs, out[0].bfloat16(), *out[1:], seq_offset=0, qk_scales=(scale, scale))
    with pytest.raises(ValueError, match=r"k_scale must have shape \(1,\), got \(2,\)"):
        qkv_pack(qkv, w, w, freqs, *out, seq_offset=0, qk_scales=(scale, torch.ones(2)))
    for t in out:
        assert (t == SENTINEL).all()
