"""Qwen-Image-2.1's image decode (pipelines/qwen_image21/vae.py: 2D convolutions with their padding inside, the
fused channel norm, no frame cache) against diffusers' AutoencoderKLQwenImage21.decode, and where
FastAutoencoderKLQwenImage21 chooses it (FastConfig.vae_2d_decode)."""

import copy

import numpy as np
import pytest
import torch
import torch.nn as nn
from diffusers import AutoencoderKLQwenImage21, QwenImage21Pipeline
from diffusers.models.autoencoders.autoencoder_kl_qwenimage21 import QwenImage21Resample, QwenImage21RMS_norm
from helpers import assert_close

from qwen_image_fast import FastConfig, optimize
from qwen_image_fast.pipelines.core.model import vae_2d
from qwen_image_fast.pipelines.core.model.vae_2d import as_vae_class, decodes_2d
from qwen_image_fast.pipelines.core.optimizations import EXACT_TOL
from qwen_image_fast.pipelines.qwen_image21 import vae as vae21
from qwen_image_fast.pipelines.qwen_image21.vae import FastAutoencoderKLQwenImage21, decode_image
from qwen_image_fast.pipelines.tiny import TINY_QWEN21_VAE, tiny_qwen21_components

# The tiny pipeline's VAE has one width and no time upsampling. These add what the real one has (channels that
# change between levels: the residual blocks' shortcut convolutions; "upsample3d" levels: DupUp3D's two time
# phases), the non-residual up blocks, and a patched output.
VAES = {
    "pipeline": TINY_QWEN21_VAE,
    "widths-time": TINY_QWEN21_VAE | dict(dim_mult=[1, 2, 2, 1, 1], temperal_downsample=[False, True, True, False]),
    "not-residual": TINY_QWEN21_VAE | dict(dim_mult=[1, 2, 2, 1, 1], temperal_downsample=[False, True, True, False],
                                           is_residual=False),
    "patched": TINY_QWEN21_VAE | dict(patch_size=2),
}


def random_vae(config: dict, dtype=torch.float32) -> AutoencoderKLQwenImage21:
    """The VAE with its decoder norms' gammas away from their init of ones, so that a decode that drops them differs."""
    torch.manual_seed(0)
    vae = AutoencoderKLQwenImage21(**config).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for norm in (m for m in vae.decoder.modules() if isinstance(m, QwenImage21RMS_norm)):
            norm.gamma.copy_(1 + 0.5 * torch.randn(norm.gamma.shape, generator=g))
    return vae.to(dtype)


def latents(vae, batch=2, frames=1, h=6, w=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, vae.config.z_dim, frames, h, w, generator=g).to(vae.dtype)


@pytest.mark.parametrize("name", list(VAES))
def test_decode_image_matches_the_stock_decode_fp32(name):
    vae = random_vae(VAES[name])
    blocks = vae.decoder.up_blocks
    if name in ("widths-time", "not-residual"):
        assert any(not isinstance(r.conv_shortcut, nn.Identity) for b in blocks for r in b.resnets)
        assert any(isinstance(m, QwenImage21Resample) and m.mode == "upsample3d" for m in vae.decoder.modules())
    z = latents(vae)
    ref = vae.decode(z).sample
    out = torch.full_like(ref, float("nan"))
    out.copy_(decode_image(vae, z))
    assert_close(out, ref, EXACT_TOL, name)  # fp32 sums in another order (the norm's, the convolutions')


def test_decode_image_without_the_kernel_matches_the_stock_decode(monkeypatch):
    """The channel norm + SiLU as upstream's ops, where Triton does not run (a CPU without its interpreter)."""
    monkeypatch.setattr(vae_2d, "INTERPRETED", False)
    monkeypatch.setattr(vae_2d, "channel_norm", None)  # not called
    vae = random_vae(VAES["widths-time"])
    z = latents(vae)
    assert_close(decode_image(vae, z), vae.decode(z).sample, EXACT_TOL, "without the kernel")


def test_decode_image_fp64_and_bf16():
    """fp64 (no kernel takes it): upstream's ops, as stock's. bf16: a few roundings of values in [-1, 1] apart."""
    vae64 = random_vae(VAES["widths-time"], torch.float64)
    z = latents(vae64)
    torch.testing.assert_close(decode_image(vae64, z), vae64.decode(z).sample, atol=1e-12, rtol=0)
    vae16 = random_vae(VAES["widths-time"], torch.bfloat16)
    z = latents(vae16)
    err = (decode_image(vae16, z).float() - vae16.decode(z).sample.float()).abs().max().item()
    assert err <= 2 * 2**-7, err


def test_only_where_it_computes_what_stock_does():
    from diffusers.hooks import HookRegistry, ModelHook

    vae = random_vae(VAES["pipeline"])
    fast = as_vae_class(vae, FastAutoencoderKLQwenImage21)
    assert not decodes_2d(vae, latents(vae)), "the stock class: never"
    assert decodes_2d(fast, latents(fast))
    assert not decodes_2d(fast, latents(fast, frames=2))
    for v in (vae, fast):  # stock's answer to a second frame, given by stock's decode
        with pytest.raises(RuntimeError, match="input to conv2d"):
            v.decode(latents(fast, frames=2))
    fast.enable_tiling()  # latents within one tile: stock does not tile them either
    assert decodes_2d(fast, latents(fast))
    fast.enable_tiling(tile_sample_min_height=64, tile_sample_min_width=64, tile_sample_stride_height=48,
                       tile_sample_stride_width=48)  # 4 latents: the test's are tiled
    assert not decodes_2d(fast, latents(fast))
    fast.disable_tiling()
    registry = HookRegistry.check_if_exists_or_initialize(fast.decoder)
    registry.register_hook(ModelHook(), "offload")
    assert not decodes_2d(fast, latents(fast))
    registry.remove_hook("offload")
    fast.train()  # dropout p = 0: nothing changes
    assert decodes_2d(fast, latents(fast))
    fast.decoder.mid_block.resnets[0].dropout.p = 0.1
    assert not decodes_2d(fast, latents(fast))


def test_the_fast_class_shares_the_stock_weights_and_tiles_as_stock():
    vae = random_vae(VAES["pipeline"])
    fast = as_vae_class(vae, FastAutoencoderKLQwenImage21)
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(fast.parameters(), vae.parameters()))
    z = latents(vae, h=10, w=9)
    assert_close(fast.decode(z).sample, vae.decode(z).sample, EXACT_TOL, "fast class")
    for v in (fast, vae):
        v.enable_tiling(tile_sample_min_height=64, tile_sample_min_width=64, tile_sample_stride_height=48,
                        tile_sample_stride_width=48)
    torch.testing.assert_close(fast.decode(z).sample, vae.decode(z).sample, atol=0, rtol=0)


def pipeline(seed=0):
    components = tiny_qwen21_components(seed)
    components["vae"] = random_vae(VAES["pipeline"])
    return QwenImage21Pipeline(**components)


def test_pipeline_images_match_stock_and_say_which_decode_ran(monkeypatch):
    """optimize() converts the VAE; the decoded images equal stock's (fp32, FP8 off) and applied says the 2D
    decode ran, through decode_image; switched off, the stock class and decode."""
    call = dict(prompt="a cat", negative_prompt="blurry", true_cfg_scale=3.0, num_inference_steps=2, height=64,
                width=96, output_type="np")
    ref = pipeline()(**call, generator=torch.Generator().manual_seed(0)).images
    fast = optimize(pipeline(), FastConfig(fp8=False))
    assert type(fast.vae) is FastAutoencoderKLQwenImage21 and "vae_2d_decode" in fast.applied  # the plan
    calls = []
    monkeypatch.setattr(vae21, "decode_image", lambda *a: calls.append(a) or decode_image(*a))
    out = fast(**call, generator=torch.Generator().manual_seed(0)).images
    assert "vae_2d_decode" in fast.applied and len(calls) == 1, fast.applied
    assert_close(torch.from_numpy(out), torch.from_numpy(ref), EXACT_TOL, "pipeline images")
    off = optimize(pipeline(), FastConfig(fp8=False, vae_2d_decode=False))
    assert type(off.vae) is AutoencoderKLQwenImage21 and "vae_2d_decode" not in off.applied
    np.testing.assert_allclose(off(**call, generator=torch.Generator().manual_seed(0)).images, ref, atol=1e-5, rtol=0)
    assert "vae_2d_decode" not in off.applied and len(calls) == 1


def test_saved_and_loaded_with_the_fast_vae(tmp_path):
    import json

    from qwen_image_fast import from_pretrained

    pipe = optimize(pipeline(), FastConfig(fp8=False))
    pipe.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "model_index.json").read_text())["vae"][-1] == "FastAutoencoderKLQwenImage21"
    (tmp_path / "fast_config.json").unlink()  # the options from what the folder names (base.saved_options)
    loaded = from_pretrained(tmp_path)
    assert type(loaded.vae) is FastAutoencoderKLQwenImage21 and loaded.fast_config.vae_2d_decode
    assert from_pretrained(tmp_path, FastConfig(fp8=False, vae_2d_decode=False)).vae.__class__ is \
        AutoencoderKLQwenImage21


@pytest.mark.gpu
def test_decode_on_gpu_within_bf16_rounding_of_stock():
    """The real decoder's config (144 channels at the top, 1152 at the bottom) at 256² in bf16 on the GPU, where
    the norms run as the Triton kernel: within a few bf16 roundings of stock's decode, the same distance from an
    fp32 decode as stock's."""
    vae = random_vae({}, torch.bfloat16).cuda()
    vae32 = copy.deepcopy(vae).float()
    z = latents(vae, batch=1, h=16, w=16).cuda()
    ref, out = vae.decode(z).sample.float(), decode_image(vae, z).float()
    exact = vae32.decode(z.float()).sample
    assert (out - ref).abs().max().item() <= 8 * 2**-8
    assert (out - exact).abs().max().item() <= 1.25 * (ref - exact).abs().max().item() + 2**-8
