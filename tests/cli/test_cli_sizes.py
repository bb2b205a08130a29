"""What a checkpoint can render, decided before anything loads (cli/sizes.py): test-size models render tiny by
default, sizes beyond the rotary table or the memory are refused, a slow CPU render is announced."""

import pytest
import torch
from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope

from qwen_image_fast.command import main
from qwen_image_fast.cli.sizes import ROPE_POSITIONS, TEXT_POSITIONS, ModelShape
from qwen_image_fast.pipelines.tiny import TINY_TRANSFORMER


def test_the_largest_side_is_where_diffusers_rotary_table_ends():
    """diffusers' own table: the largest side's image and text positions fit, two patches more do not."""
    shape = ModelShape.of("tiny-random")
    rope = QwenEmbedRope(theta=10000, axes_dim=list(TINY_TRANSFORMER["axes_dims_rope"]), scale_rope=True)
    patches = shape.largest_side() // shape.pixels_per_token
    assert rope.pos_freqs.shape[0] == ROPE_POSITIONS
    for width, fits in ((patches, True), (patches + 2, False)):
        image, text = rope([(1, 4, width)], torch.device("cpu"), max_txt_seq_len=TEXT_POSITIONS)
        assert image.shape[0] == 4 * width and (text.shape[0] == TEXT_POSITIONS) == fits


def test_qwen21s_largest_side_is_where_its_negative_positions_end(local_qwen21):
    """Qwen-Image-2.1's QwenImage21Rope centres an image on zero: a side of n tokens reaches position -(n - n // 2),
    and its table holds as many negative positions as the largest side's half (beyond, indices wrap silently)."""
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21Rope

    shape = ModelShape.of(local_qwen21, "QwenImage21Pipeline")
    assert (shape.pixels_per_token, shape.size_multiple, shape.test_size) == (16, 32, True)
    rope = QwenImage21Rope(theta=10000, axes_dim=[4, 6, 6])
    negative = rope.freqs[1].shape[0] - 8192  # [positions 0..8191; -1024..-1]
    tokens = shape.largest_side() // shape.pixels_per_token
    assert tokens - tokens // 2 == negative


def dry_run(capsys, *args) -> tuple[str, str]:
    assert main(["render", "--device", "cpu", "--dry-run", *args, "a cat"]) == 0
    captured = capsys.readouterr()
    return captured.out.splitlines()[0], captured.err


@pytest.fixture(scope="module")
def local_tiny(tmp_path_factory):
    """A local test-size checkpoint (the tiny model saved): its size is read from its config."""
    from qwen_image_fast.pipelines.tiny import tiny_pipeline

    path = tmp_path_factory.mktemp("checkpoints") / "tiny"
    tiny_pipeline().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def local_qwen21(tmp_path_factory):
    """A test-size Qwen-Image-2.1 checkpoint (the tiny one saved)."""
    from diffusers import QwenImage21Pipeline

    from qwen_image_fast.pipelines.tiny import tiny_qwen21_components

    path = tmp_path_factory.mktemp("checkpoints") / "qwen21"
    QwenImage21Pipeline(**tiny_qwen21_components()).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("args, planned", [
    ([], "64x64 in 2 steps"),
    (["--aspect", "9:16"], "32x96 in 2 steps"),  # 9:16 at about 64x64 pixels, in multiples of 32
    (["--width", "128", "--height", "64", "--steps", "3"], "128x64 in 3 steps"),
])
def test_qwen21_sizes_and_steps(args, planned, local_qwen21, capsys):
    capsys.readouterr()
    first, err = dry_run(capsys, "--model", local_qwen21, *args)
    assert f"1 image(s) ({planned})" in first and err == ""


@pytest.mark.parametrize("args, planned", [
    ([], "64x64 in 2 steps"),
    (["--aspect", "16:9"], "80x48 in 2 steps"),
    (["--aspect", "2:3", "--steps", "3"], "48x80 in 3 steps"),
    (["--width", "128", "--height", "64"], "128x64 in 2 steps"),
])
def test_a_test_size_model_renders_tiny_sizes_and_steps_by_default(args, planned, local_tiny, capsys):
    capsys.readouterr()  # the checkpoint's saving
    for model in ("tiny-random", local_tiny):
        first, err = dry_run(capsys, "--model", model, *args)
        assert f"1 image(s) ({planned})" in first and err == ""


def test_a_large_size_on_the_cpu_warns_with_an_estimate(capsys):
    _, err = dry_run(capsys, "--model", "tiny-random", "--width", "1664", "--height", "928")
    assert err == ("warning: 1664x928 on the CPU: about 21 s a step, 42 s for 2 steps before the VAE decode (measured "
                   "on 2 cores with the tiny model, scaled by size); a test-size model renders 64x64 unless told "
                   "otherwise\n")
    _, err = dry_run(capsys, "--model", "tiny-random", "--width", "512", "--height", "512")
    assert err == ""  # ~4 s a step: no warning
