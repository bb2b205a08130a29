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


@pytest.mark.parametrize("gib, pipeline, expected", [
    (79.2, "QwenImagePipeline", None),  # an H100: the fast pipeline fits
    (44.4, "QwenImagePipeline", None),  # an L40S (48 GB): 42.5 GiB peak and the context fit
    (39.4, "QwenImagePipeline", "has 39.4 GiB, and the fast pipeline needs about 43: add --max-memory 39"),
    (23.6, "QwenImagePipeline", "has 23.6 GiB, and the fast pipeline needs about 43: add --max-memory 23 "
                                "(memory='low': the same images bit for bit in about 22 GiB)"),
    (23.6, "QwenImageEditPlusPipeline", "its low-memory mode (--max-memory) runs the text-to-image pipeline only, "
                                        "not QwenImageEditPlusPipeline"),
    (15.6, "QwenImagePipeline", "has 15.6 GiB, and the fast pipeline needs about 43: add --max-memory 15 "
                                "(memory='low': the same images bit for bit; below 22 GiB the blocks and text encoder "
                                "layers that do not fit stream from the host)"),  # a 16 GB card
    (7.6, "QwenImagePipeline", "has 7.6 GiB, and the fast pipeline needs about 43 (10 with --max-memory, its "
                               "low-memory mode): GPUs this small are not served yet"),
    # a Qwen-Image-2.1-size model: its own numbers (35.7 and 19.9 GiB reserved at 1024^2, measured; streamed from
    # QWEN21_STREAMING_MIN_GIB)
    (39.4, "QwenImage21Pipeline", None),
    (23.6, "QwenImage21Pipeline", "has 23.6 GiB, and the fast pipeline needs about 38: add --max-memory 23 "
                                  "(memory='low': the same images bit for bit in about 21 GiB)"),
    (15.6, "QwenImage21Pipeline", "has 15.6 GiB, and the fast pipeline needs about 38: add --max-memory 15 "
                                  "(memory='low': the same images bit for bit; below 21 GiB the blocks and text "
                                  "encoder layers that do not fit stream from the host)"),  # a 16 GB card
    (11.6, "QwenImage21Pipeline", "has 11.6 GiB, and the fast pipeline needs about 38 (14 with --max-memory, its "
                                  "low-memory mode): GPUs this small are not served yet"),
])
def test_a_gpu_too_small_for_the_fast_pipeline_is_told_the_memory_mode_before_loading(monkeypatch, gib, pipeline,
                                                                                         expected):
    """Without --max-memory, a Qwen-Image-2512-size (or 2.1-size) model on a GPU below the fast pipeline's measured
    peak: refused before anything loads, naming the --max-memory that runs it (or that none does). Not checked: with
    --max-memory (memory_setting's rules), the stock preset, another model size, the CPU."""
    from types import SimpleNamespace

    from qwen_image_fast.cli.devices import check_gpu_fits

    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(total_memory=int(gib * 2**30), name="a mocked GPU"))
    cuda = torch.device("cuda", 0)
    size_2512 = ModelShape(width=3072, layers=60, patch=2, vae_scale=8, vae_channels=96, dtype_bytes=2)
    size_21 = ModelShape(width=4096, layers=32, patch=1, vae_scale=16, vae_channels=96, dtype_bytes=2)
    size = size_21 if pipeline == "QwenImage21Pipeline" else size_2512
    if expected is None:
        check_gpu_fits(cuda, None, "fast", pipeline, size)
    else:
        with pytest.raises(ValueError, match="cuda:0 \\(a mocked GPU\\) ") as refused:
            check_gpu_fits(cuda, None, "fast", pipeline, size)
        assert expected in str(refused.value)
    other = ModelShape(width=2560, layers=40, patch=1, vae_scale=16, vae_channels=96, dtype_bytes=2)
    cpu = torch.device("cpu")
    for unchecked in ((cuda, 24.0, "fast", pipeline, size), (cuda, None, "baseline", pipeline, size),
                      (cuda, None, "fast", pipeline, other), (cpu, None, "fast", pipeline, size)):
        check_gpu_fits(*unchecked)


@pytest.mark.parametrize("gib", [44.4, 42.9])
def test_one_number_says_whether_the_fast_pipeline_fits(monkeypatch, gib):
    """A GPU of `gib` without --max-memory and --max-memory `gib` get the same answer: the fast pipeline where it
    fits (an L40S's 44.4 GiB), memory='low' (with the flag) or a refusal naming it (without) where it does not."""
    from types import SimpleNamespace

    from qwen_image_fast.cli.devices import check_gpu_fits, memory_setting

    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(total_memory=int(gib * 2**30), name="a mocked GPU"))
    size_2512 = ModelShape(width=3072, layers=60, patch=2, vae_scale=8, vae_channels=96, dtype_bytes=2)
    setting = memory_setting(gib, "fast", "QwenImagePipeline", None)
    if gib > 43:
        assert setting == "fast"
        check_gpu_fits(torch.device("cuda", 0), None, "fast", "QwenImagePipeline", size_2512)
    else:
        assert setting == "low"
        with pytest.raises(ValueError, match="add --max-memory 42"):
            check_gpu_fits(torch.device("cuda", 0), None, "fast", "QwenImagePipeline", size_2512)


def test_render_checks_the_gpu_s_size_before_anything_loads(monkeypatch, capsys):
    """check_render asks check_gpu_fits (above) with the run's device, --max-memory, preset, pipeline and the model's
    shape: a GPU cannot run here, so the check is seen through its arguments."""
    from qwen_image_fast.cli import render_plan

    asked = []
    monkeypatch.setattr(render_plan, "check_gpu_fits", lambda *args: asked.append(args))
    dry_run(capsys, "--model", "tiny-random", "--preset", "fast", "--max-memory", "30")
    [(device, max_memory, preset, pipeline, shape)] = asked
    assert (device.type, max_memory, preset, pipeline) == ("cpu", 30.0, "fast", "QwenImagePipeline")
    assert shape == ModelShape.of("tiny-random")
