"""FastQwen35ForCausalLM against transformers' Qwen3_5ForCausalLM: forward, prefill and step-by-step decode logits
(fp32, tiny config), bf16 closeness, packed weights, the vision-language text tower, from_pretrained round trips.
GPU tests run the real widths (Qwen3.5-9B, default Qwen3_5TextConfig) with 4 layers and random weights."""

import copy

import pytest
import torch
from helpers import assert_close
from transformers import Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5TextConfig

from qwen_image_fast.kernels._utils import rel_rms_error
from qwen_image_fast.pipelines.qwen35 import FastQwen35ForCausalLM

TINY_TEXT = dict(
    vocab_size=101,  # 248320
    hidden_size=45,  # 4096
    intermediate_size=71,  # 12288
    num_hidden_layers=2,  # 32
    layer_types=["linear_attention", "full_attention"],  # 3 linear : 1 full, x8
    num_attention_heads=4,  # 16
    num_key_value_heads=2,  # 4
    head_dim=24,  # 256; partial_rotary_factor 0.25 rotates 6 of 24 dims (64 of 256)
    linear_num_key_heads=2,  # 16
    linear_num_value_heads=4,  # 32: two value heads per key head, as in the real model
    linear_key_head_dim=12,  # 128
    linear_value_head_dim=20,  # 128
    initializer_range=0.1,  # 0.02: larger weights keep the greedy choices far from ties
)


def randomize(model):
    """Non-trivial norm weights and dt_bias (upstream initializes them to constants), so a dropped one shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "dt_bias" in name:
                p.add_(torch.randn_like(p) * 0.2)
    return model


def tiny_hf(seed=0, dtype=torch.float32, **overrides) -> Qwen3_5ForCausalLM:
    torch.manual_seed(seed)
    return randomize(Qwen3_5ForCausalLM(Qwen3_5TextConfig(**{**TINY_TEXT, **overrides}))).to(dtype).eval()


def tiny_hf_vl(seed=0) -> Qwen3_5ForConditionalGeneration:
    torch.manual_seed(seed)
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64,  # 27, 1152, 16, 4304
                  out_hidden_size=TINY_TEXT["hidden_size"])
    return randomize(Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=TINY_TEXT, vision_config=vision))).eval()


@torch.no_grad()
def hf_step(hf, token_ids, cache=None):
    """One upstream forward with its own cache; returns (last logits [V] fp32, cache)."""
    out = hf(torch.as_tensor(token_ids).view(1, -1), past_key_values=cache, use_cache=True)
    return out.logits[0, -1].float(), out.past_key_values


def test_packed_weights_equal_originals():
    hf = tiny_hf()
    fast = FastQwen35ForCausalLM.from_transformers(hf)
    gdn, attn = hf.model.layers[0], hf.model.layers[1]
    la, sa = gdn.linear_attn, attn.self_attn
    fl, fa = fast.layers
    assert torch.equal(fl.in_proj, torch.cat([la.in_proj_qkv.weight, la.in_proj_z.weight, la.in_proj_b.weight,
                                              la.in_proj_a.weight]))
    assert torch.equal(fl.conv_weight, la.conv1d.weight[:, 0])
    assert torch.equal(fa.qkv_proj, torch.cat([sa.q_proj.weight, sa.k_proj.weight, sa.v_proj.weight]))
    for fast_layer, layer in ((fl, gdn), (fa, attn)):
        assert torch.equal(fast_layer.gate_up, torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]))
        assert torch.equal(fast_layer.down, layer.mlp.down_proj.weight)
    assert torch.equal(fast.lm_head, hf.lm_head.weight) and fast.lm_head is not fast.embed_tokens

    fast_tied = FastQwen35ForCausalLM.from_transformers(tiny_hf(tie_word_embeddings=True))
    assert fast_tied.lm_head is fast_tied.embed_tokens  # one tensor, as upstream ties them


def test_forward_matches_transformers():
    hf = tiny_hf()
    fast = FastQwen35ForCausalLM.from_transformers(hf)
    ids = torch.randint(0, TINY_TEXT["vocab_size"], (2, 67))  # past one 64-token chunk of the delta rule
    with torch.no_grad():
        ref = hf(ids).logits
    assert_close(fast(ids), ref, 1e-4, "forward logits vs transformers (fp32)")


def test_prefill_and_decode_match_transformers():
    """Two sequences of different lengths in one cache; 32 decode steps, each compared with upstream running the
    same tokens through its own cache."""
    hf = tiny_hf()
    fast = FastQwen35ForCausalLM.from_transformers(hf)
    gen = torch.Generator().manual_seed(1)
    vocab = TINY_TEXT["vocab_size"]
    prompts = [torch.randint(0, vocab, (5,), generator=gen), torch.randint(0, vocab, (13,), generator=gen)]
    cache = fast.new_cache(batch=2, max_len=48)
    fast.prefill(torch.randint(0, vocab, (30,), generator=gen), cache, slot=0)  # overwritten by the next prefill
    hf_caches = []
    for slot, prompt in enumerate(prompts):
        ref, hf_cache = hf_step(hf, prompt)
        hf_caches.append(hf_cache)
        assert_close(fast.prefill(prompt, cache, slot), ref, 1e-4, f"prefill logits, sequence {slot}")
    assert cache.lengths.tolist() == [5, 13]
    for step in range(32):
        tokens = torch.randint(0, vocab, (2,), generator=gen)
        logits = fast.decode(tokens, cache)
        assert logits.dtype == torch.float32 and logits.shape == (2, vocab)
        for i in range(2):
            ref, hf_caches[i] = hf_step(hf, tokens[i], hf_caches[i])
            assert_close(logits[i], ref, 1e-4, f"decode step {step}, sequence {i}")
    assert cache.lengths.tolist() == [37, 45]


def test_bf16_close_to_transformers():
    """bf16 rounding differs from upstream's in order, not in amount: against the fp32 model, the fast bf16 logits
    (prefill and 6 decode steps together) are within 2x of upstream bf16's error."""
    hf32 = tiny_hf()
    hf16 = copy.deepcopy(hf32).to(torch.bfloat16)
    fast = FastQwen35ForCausalLM.from_transformers(hf16)
    assert fast.dtype == torch.bfloat16
    ids = torch.randint(0, TINY_TEXT["vocab_size"], (1, 9))
    with torch.no_grad():
        forward = (fast(ids), hf16(ids).logits, hf32(ids).logits)
    assert torch.isfinite(forward[0]).all()
    assert rel_rms_error(forward[0], forward[2]) <= 2 * rel_rms_error(forward[1], forward[2])

    cache = fast.new_cache(batch=1, max_len=16)
    (ref32, cache32), (ref16, cache16) = hf_step(hf32, ids[0]), hf_step(hf16, ids[0])
    steps = [(fast.prefill(ids[0], cache, 0), ref16, ref32)]
    for token in (3, 50, 7, 99, 0, 64):
        (ref32, cache32), (ref16, cache16) = hf_step(hf32, token, cache32), hf_step(hf16, token, cache16)
        steps.append((fast.decode(torch.tensor([token]), cache)[0], ref16, ref32))
    out, ref16, ref32 = (torch.stack(x) for x in zip(*steps))
    assert torch.isfinite(out).all()
    err, upstream_err = rel_rms_error(out, ref32), rel_rms_error(ref16, ref32)
    assert err <= 2 * upstream_err, f"fast bf16 rel-RMS {err:.3e} vs fp32; upstream bf16 {upstream_err:.3e}"
    assert_close(out, ref16, 5e-2, "fast bf16 vs upstream bf16")


def test_conditional_generation_uses_text_tower():
    vl = tiny_hf_vl()
    fast = FastQwen35ForCausalLM.from_transformers(vl)
    ids = torch.randint(0, TINY_TEXT["vocab_size"], (2, 11))
    with torch.no_grad():
        ref = vl(input_ids=ids).logits
    assert_close(fast(ids), ref, 1e-4, "fast from the VL model vs the VL model on text")


@pytest.mark.parametrize("kind", ["text", "vision-language"])
def test_from_pretrained_round_trip(tmp_path, kind):
    hf = tiny_hf() if kind == "text" else tiny_hf_vl()
    hf.save_pretrained(tmp_path)
    loaded = FastQwen35ForCausalLM.from_pretrained(str(tmp_path), device="cpu", dtype=torch.float32)
    direct = FastQwen35ForCausalLM.from_transformers(hf)
    assert loaded.dtype == torch.float32 and loaded.device.type == "cpu"
    for (name, p), (_, q) in zip(loaded.named_parameters(), direct.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    ids = torch.randint(0, TINY_TEXT["vocab_size"], (1, 6))
    assert torch.equal(loaded(ids), direct(ids))


def test_prefill_rejects_bad_lengths():
    fast = FastQwen35ForCausalLM.from_transformers(tiny_hf())
    cache = fast.new_cache(batch=1, max_len=8)
    with pytest.raises(ValueError, match="prompt length 9"):
        fast.prefill(torch.zeros(9, dtype=torch.int64), cache, 0)
    with pytest.raises(ValueError, match="prompt length 0"):
        fast.prefill(torch.zeros(0, dtype=torch.int64), cache, 0)
    with pytest.raises(ValueError, match="slot=1"):
        fast.prefill(torch.zeros(3, dtype=torch.int64), cache, 1)


def real_width_hf(num_layers=4, dtype=torch.bfloat16) -> Qwen3_5ForCausalLM:
    """Qwen3.5-9B layer shapes (transformers' default Qwen3_5TextConfig), `num_layers` of them, random weights."""
    torch.manual_seed(0)
    config = Qwen3_5TextConfig(num_hidden_layers=num_layers,
                               layer_types=["linear_attention"] * (num_layers - 1) + ["full_attention"])
    with torch.device("cuda"):
        model = Qwen3_5ForCausalLM(config)
    return randomize(model).to(dtype).eval()


@pytest.mark.gpu
def test_real_width_matches_transformers_on_gpu():
    hf = real_width_hf()
    fast = FastQwen35ForCausalLM.from_transformers(hf)
    vocab = hf.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, 100), generator=gen).cuda()
    with torch.no_grad():
        ref = hf(ids).logits
    assert_close(fast(ids), ref, 3e-2, "real-width bf16 forward")

    prompts = [torch.randint(0, vocab, (n,), generator=gen).cuda() for n in (37, 150)]
    cache = fast.new_cache(batch=2, max_len=256)
    hf_caches = []
    for slot, prompt in enumerate(prompts):
        ref, hf_cache = hf_step(hf, prompt)
        hf_caches.append(hf_cache)
        assert_close(fast.prefill(prompt, cache, slot), ref, 3e-2, f"real-width prefill {slot}")
    for step in range(8):
        tokens = torch.randint(0, vocab, (2,), generator=gen).cuda()
        logits = fast.decode(tokens, cache)
        for i in range(2):
            ref, hf_caches[i] = hf_step(hf, tokens[i], hf_caches[i])
            assert_close(logits[i], ref, 3e-2, f"real-width decode step {step}, sequence {i}")
