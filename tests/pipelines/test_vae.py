"""The VAE decode of one image as 2D convolutions (pipelines/qwen_image/model/vae.py) against diffusers'
AutoencoderKLQwenImage.decode, and where FastAutoencoderKLQwenImage chooses it."""

import copy

import numpy as np
import pytest
import torch
import torch.nn as nn
from test_pipeline import EXACT, fast_pipeline, stock_pipeline
from test_pipeline import run as run_pipeline

from qwen_image_fast.pipelines.core.model.vae_2d import as_vae_class, decodes_2d
from qwen_image_fast.pipelines.qwen_image.model.vae import FastAutoencoderKLQwenImage, decode_image


def random_norms(vae):
    """The decoder's norms with gammas away from their init of ones, so that a decode that drops them differs."""
    from diffusers.models.autoencoders.autoencoder_kl_qwenimage import QwenImageRMS_norm

    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for norm in (m for m in vae.decoder.modules() if isinstance(m, QwenImageRMS_norm)):
            norm.gamma.copy_(1 + 0.5 * torch.randn(norm.gamma.shape, generator=g))
    return vae


@pytest.fixture(scope="module")
def vae():
    return random_norms(stock_pipeline().vae.eval())


def small_tiles(vae):
    """Tiles of 16 pixels (4 latents with the tiny VAE), so that the test latents are tiled when tiling is on."""
    vae.enable_tiling(tile_sample_min_height=16, tile_sample_min_width=16, tile_sample_stride_height=12,
                      tile_sample_stride_width=12)


def latents(vae, batch=2, frames=1, h=12, w=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, vae.config.z_dim, frames, h, w, generator=g)


def test_decode_image_matches_the_stock_decode_fp32(vae):
    """The tiny VAE has an upsample3d block (its first-frame time convolution is skipped in both) and a 2D one."""
    assert any(block.upsamplers is not None and block.upsamplers[0].mode == "upsample3d"
               for block in vae.decoder.up_blocks)
    z = latents(vae)
    ref = vae.decode(z).sample
    out = torch.full_like(ref, float("nan"))
    out.copy_(decode_image(vae, z))
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_decode_image_without_the_kernel_matches_the_stock_decode(vae, monkeypatch):
    """The channel norm + SiLU as upstream's ops, where Triton does not run (a CPU without its interpreter)."""
    from qwen_image_fast.pipelines.core.model import vae_2d

    monkeypatch.setattr(vae_2d, "INTERPRETED", False)
    monkeypatch.setattr(vae_2d, "channel_norm", None)  # not called
    z = latents(vae)
    torch.testing.assert_close(decode_image(vae, z), vae.decode(z).sample, atol=1e-5, rtol=0)


def test_decode_image_fp64_matches_the_stock_decode(vae):
    """fp64 (no kernel takes it): upstream's ops, as stock's."""
    vae64 = copy.deepcopy(vae).to(torch.float64)
    z = latents(vae64).double()
    torch.testing.assert_close(decode_image(vae64, z), vae64.decode(z).sample, atol=1e-12, rtol=0)


def test_decode_image_bf16_and_slicing(vae):
    vae16 = random_norms(stock_pipeline().vae.eval()).to(torch.bfloat16)
    z = latents(vae16).to(torch.bfloat16)
    ref = vae16.decode(z).sample.float()
    err = (decode_image(vae16, z).float() - ref).abs().max().item()
    assert err <= 2 * 2**-7, err  # a few bf16 roundings of values in [-1, 1], summed in another order
    vae.enable_slicing()
    try:
        z = latents(vae)
        torch.testing.assert_close(decode_image(vae, z), vae.decode(z).sample, atol=1e-5, rtol=0)
    finally:
        vae.disable_slicing()


def test_only_where_it_computes_what_stock_does(vae):
    from diffusers.hooks import HookRegistry, ModelHook

    fast = as_vae_class(vae, FastAutoencoderKLQwenImage)
    assert not decodes_2d(vae, latents(vae)), "the stock class: never"
    assert decodes_2d(fast, latents(fast))
    assert not decodes_2d(fast, latents(fast, frames=2))
    fast.enable_tiling()  # latents within one tile: stock does not tile them either
    assert decodes_2d(fast, latents(fast))
    small_tiles(fast)
    try:
        assert not decodes_2d(fast, latents(fast))
    finally:
        fast.disable_tiling()
    registry = HookRegistry.check_if_exists_or_initialize(fast.decoder)  # the decoder is vae's too
    registry.register_hook(ModelHook(), "offload")
    try:
        assert not decodes_2d(fast, latents(fast))
    finally:
        registry.remove_hook("offload")
    fast = as_vae_class(vae, FastAutoencoderKLQwenImage).train()  # dropout p = 0: nothing changes
    assert decodes_2d(fast, latents(fast))
    dropout = fast.decoder.mid_block.resnets[0].dropout
    dropout.p = 0.1
    try:
        assert not decodes_2d(fast, latents(fast))
    finally:
        dropout.p = 0.0
        fast.eval()  # the modules are the fixture's


def test_the_fast_class_shares_the_stock_weights_and_decodes_as_stock(vae):
    fast = as_vae_class(vae, FastAutoencoderKLQwenImage)
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(fast.parameters(), vae.parameters()))
    fast.to(torch.float64)  # as on a diffusers pipeline's shared components: both move
    try:
        assert vae.dtype == torch.float64 and all(a is b for a, b in zip(fast.parameters(), vae.parameters()))
    finally:
        fast.to(torch.float32)
    fast.register_module("extra", nn.Identity())  # registries of its own
    assert not hasattr(vae, "extra")
    del fast.extra
    z = latents(vae)
    torch.testing.assert_close(fast.decode(z).sample, vae.decode(z).sample, atol=1e-5, rtol=0)
    small_tiles(fast)
    torch.testing.assert_close(fast.decode(z).sample, AutoencoderKLTiled(vae).decode(z).sample, atol=0, rtol=0)


def AutoencoderKLTiled(vae):
    stock = as_vae_class(vae, type(vae))
    small_tiles(stock)
    return stock


def test_pipeline_images_match_stock_and_say_which_decode_ran():
    stock, fast = stock_pipeline(), fast_pipeline(EXACT)
    case = dict(prompt="a cat", negative_prompt="blurry", true_cfg_scale=3.0, output_type="np")
    ref = run_pipeline(stock, **case)
    out = run_pipeline(fast, **case)
    assert "vae_2d_decode" in fast.applied
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=0)
    small_tiles(fast.vae)
    out = run_pipeline(fast, **case)
    assert "vae_2d_decode" not in fast.applied, "tiled: the stock decode"
    off = fast_pipeline(EXACT.replace(vae_2d_decode=False))
    assert type(off.vae) is type(stock.vae)
    run_pipeline(off, **case)
    assert "vae_2d_decode" not in off.applied
