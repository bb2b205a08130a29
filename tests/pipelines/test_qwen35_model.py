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

# Real sizes: transformers' default Qwen3_5TextConfig ("Qwen3.5-9B style" in its docstring), which real_width_hf
# uses; tiny.py's TINY_QWEN35 shrinks the enhancer's 4B instead (hidden 2560, MLP 9216: a guess).
TINY_TEXT = dict(
    vocab_size=101,  # 248320
    hidden_size=45,  # 4096 (9B)
    intermediate_size=71,  # 12288 (9B)
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


def run_cached(fast, upstream, prompt_lengths, steps, gen):
    """Prefills random prompts of `prompt_lengths` into one fast cache (slot 0 first holds a longer junk prompt,
    which its prefill must replace), then decodes `steps` random tokens for all of them. Each upstream model runs
    every sequence alone through its own cache. Returns logits [1 + steps, B, V] fp32: fast, then each upstream."""
    vocab, device = fast.embed_tokens.shape[0], fast.device
    prompts = [torch.randint(0, vocab, (n,), generator=gen).to(device) for n in prompt_lengths]
    tokens = torch.randint(0, vocab, (steps, len(prompts)), generator=gen).to(device)
    cache = fast.new_cache(batch=len(prompts), max_len=max(prompt_lengths) + steps + 3)
    fast.prefill(torch.randint(0, vocab, (max(prompt_lengths) + 2,), generator=gen), cache, slot=0)
    out = [torch.stack([fast.prefill(p, cache, slot) for slot, p in enumerate(prompts)])]
    assert cache.lengths.tolist() == list(prompt_lengths)
    out += [fast.decode(t, cache) for t in tokens]
    assert cache.lengths.tolist() == [n + steps for n in prompt_lengths]
    refs = []
    for hf in upstream:
        per_sequence = []
        for i, prompt in enumerate(prompts):
            logits, hf_cache = [], None
            for ids in [prompt, *tokens[:, i]]:
                last, hf_cache = hf_step(hf, ids, hf_cache)
                logits.append(last)
            per_sequence.append(torch.stack(logits))  # [1 + steps, V]
        refs.append(torch.stack(per_sequence, dim=1))
    return torch.stack(out), *refs


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
    """Two sequences of different lengths in one cache; prefill and 16 decode steps (past the 4-token convolution
    window), each compared with upstream running the same tokens through its own cache."""
    hf = tiny_hf()
    fast = FastQwen35ForCausalLM.from_transformers(hf)
    out, ref = run_cached(fast, [hf], (5, 13), 16, torch.Generator().manual_seed(1))
    assert out.dtype == torch.float32 and out.shape == (17, 2, TINY_TEXT["vocab_size"])
    for step in range(17):
        for i in range(2):
            assert_close(out[step, i], ref[step, i], 1e-4, f"step {step} (0: prefill), sequence {i}")


def assert_bf16_like_upstream(out16, ref16, ref32):
    """bf16 rounds in another order than upstream, not by more: against the fp32 model, the fast bf16 logits are
    within 2x of upstream bf16's error."""
    assert torch.isfinite(out16).all()
    err, upstream_err = rel_rms_error(out16, ref32), rel_rms_error(ref16, ref32)
    assert err <= 2 * upstream_err, f"fast bf16 rel-RMS {err:.3e} vs fp32; upstream bf16 {upstream_err:.3e}"


def test_bf16_close_to_transformers():
    hf32 = tiny_hf()
    hf16 = copy.deepcopy(hf32).to(torch.bfloat16)
    fast = FastQwen35ForCausalLM.from_transformers(hf16)
    assert fast.dtype == torch.bfloat16
    ids = torch.randint(0, TINY_TEXT["vocab_size"], (2, 9))
    with torch.no_grad():
        assert_bf16_like_upstream(fast(ids), hf16(ids).logits, hf32(ids).logits)
    assert_bf16_like_upstream(*run_cached(fast, [hf16, hf32], (9, 4), 6, torch.Generator().manual_seed(2)))


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
    """Qwen3.5-9B widths, 4 layers, bf16, against upstream bf16 and fp32: forward (T=100), then prefill of
    prompts of 37 and 150 tokens (several fla chunks) and 8 decode steps."""
    hf32 = real_width_hf(dtype=torch.float32)
    hf16 = copy.deepcopy(hf32).to(torch.bfloat16)
    fast = FastQwen35ForCausalLM.from_transformers(hf16)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, hf32.config.vocab_size, (2, 100), generator=gen).cuda()
    with torch.no_grad():
        assert_bf16_like_upstream(fast(ids), hf16(ids).logits, hf32(ids).logits)
    assert_bf16_like_upstream(*run_cached(fast, [hf16, hf32], (37, 150), 8, gen))
    # one sequence: decode's single-row GEMMs run the Triton GEMV, its attention the B=1 path
    assert_bf16_like_upstream(*run_cached(fast, [hf16, hf32], (61,), 8, gen))
