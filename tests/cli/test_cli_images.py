"""`qwen-image-fast render` with image-conditioned checkpoints: --image, --mask, --strength."""

import json

import numpy as np
import pytest
from PIL import Image

from qwen_image_fast.command import main
from qwen_image_fast.cli.output import read_settings
from qwen_image_fast.cli.run import ENCODE_AHEAD_IMAGES, encode_ahead

from cli_helpers import BASELINE, manifest, needs_interpreter


# ---- image-conditioned checkpoints: --image, --mask, --strength

@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Tiny Edit-2511-style (EditPlus, zero_cond_t), inpainting and text-to-image folders, and input images."""
    import diffusers

    from qwen_image_fast.pipelines.tiny import tiny_pipeline, tiny_qwen21_components

    root = tmp_path_factory.mktemp("checkpoints")
    tiny_pipeline(diffusers.QwenImageEditPlusPipeline, transformer_config=dict(zero_cond_t=True)).save_pretrained(
        root / "edit")
    tiny_pipeline(diffusers.QwenImageInpaintPipeline).save_pretrained(root / "inpaint")
    diffusers.QwenImage21Pipeline(**tiny_qwen21_components()).save_pretrained(root / "qwen21")
    rng = np.random.default_rng(0)
    for name, shape in (("a.png", (32, 48, 3)), ("b.png", (40, 24, 3)), ("c.png", (32, 48, 3))):
        Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(root / name)
    Image.fromarray(rng.integers(0, 256, (32, 64, 4), dtype=np.uint8)).save(root / "rgba.png")
    Image.fromarray(((rng.random((32, 48)) > 0.5) * 255).astype(np.uint8)).save(root / "mask.png")
    Image.fromarray(np.zeros((16, 16), dtype=np.uint8)).save(root / "small_mask.png")
    (root / "not_an_image.png").write_text("hello")
    return root


EDIT_BAD_INPUT = {
    "image-missing": (lambda c: ["--model", c / "edit", "--image", c / "none.png"], "--image {c}/none.png: cannot read"),
    "image-unreadable": (lambda c: ["--model", c / "edit", "--image", c / "not_an_image.png"],
                         "--image {c}/not_an_image.png: not a readable image (not a format PIL reads)"),
    "image-with-text-to-image-model": (lambda c: ["--image", c / "a.png"],
                                       "--image given, but tiny-random is a text-to-image model"),
    "edit-without-image": (lambda c: ["--model", c / "edit"], "QwenImageEditPlusPipeline ({c}/edit) needs an input"),
    "strength-zero": (lambda c: ["--strength", "0"], "argument --strength: must be in (0, 1], got '0'"),
    "strength-above-one": (lambda c: ["--strength", "1.5"], "argument --strength: must be in (0, 1], got '1.5'"),
    "strength-for-edit": (lambda c: ["--model", c / "edit", "--image", c / "a.png", "--strength", "0.5"],
                          "--strength given, but QwenImageEditPlusPipeline"),
    "mask-for-edit": (lambda c: ["--model", c / "edit", "--image", c / "a.png", "--mask", c / "mask.png"],
                      "--mask given, but QwenImageEditPlusPipeline"),
    "inpaint-without-mask": (lambda c: ["--model", c / "inpaint", "--image", c / "a.png"], "inpaints: give --mask"),
    "mask-of-another-size": (lambda c: ["--model", c / "inpaint", "--image", c / "a.png", "--mask",
                                        c / "small_mask.png"], "is 16x16, the image {c}/a.png 48x32"),
    "inpaint-two-images": (lambda c: ["--model", c / "inpaint", "--image", c / "a.png", "--image", c / "b.png",
                                      "--mask", c / "mask.png"], "takes 1 input image, got 2"),
    "enhance-an-edit": (lambda c: ["--model", c / "edit", "--image", c / "a.png", "--enhance=tiny-random"],
                        "--enhance rewrites text-to-image prompts"),
}


@pytest.mark.parametrize("make_args, message", EDIT_BAD_INPUT.values(), ids=EDIT_BAD_INPUT.keys())
def test_bad_image_input_exits_2_with_one_line_and_leaves_no_folder(make_args, message, checkpoints, tmp_path,
                                                                      capsys):
    args = ["render", *BASELINE, "--out", str(tmp_path / "out"), *map(str, make_args(checkpoints)), "a cat"]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    usage, error = capsys.readouterr().err.splitlines()
    assert message.format(c=checkpoints) in error
    assert not (tmp_path / "out").exists()


@needs_interpreter
def test_edit_renders_records_its_inputs_resumes_and_compares(checkpoints, tmp_path, capsys):
    """The class comes from model_index.json; both presets render the same edit; the inputs' paths and hashes are
    recorded; resume skips a finished image and refuses one whose input image changed; compare pairs them. A
    test-size checkpoint: 2 steps by default, its input images shrunk (diffusers' 1024x1024 area / 256), and so
    said, on the command line and with each image."""
    from qwen_image_fast.command import main as cli

    edit = ["--model", str(checkpoints / "edit"), "--device", "cpu", "--image", str(checkpoints / "a.png"),
            "--image", str(checkpoints / "b.png"), "make it blue"]
    for preset in ("baseline", "fast"):
        assert cli(["render", *edit, "--preset", preset, "--out", str(tmp_path / preset)]) == 0
    out = capsys.readouterr().out
    assert ("QwenImageEditPlusPipeline, a test-size model: 2 steps unless given, input images at 1/256 of "
            "diffusers' area)") in out
    (line,) = manifest(tmp_path / "fast")
    assert line["steps"] == 2 and line["note"] == (
        "from a test-size model (transformer width 48), not a full-size rendering of the prompt; its input images "
        "resized to 1/256 of the area diffusers resizes them to")
    digest = __import__("hashlib").sha256((checkpoints / "a.png").read_bytes()).hexdigest()
    assert line["images"][0] == {"path": str(checkpoints / "a.png"), "sha256": digest}
    assert line["mask"] is None and line["strength"] is None and len(line["images"]) == 2
    assert "batched_cfg" in line["applied"] and "fused_transformer" in line["applied"]
    assert read_settings(tmp_path / "fast" / line["file"])["images"] == line["images"]
    sizes = {Image.open(tmp_path / preset / line["file"]).size for preset in ("baseline", "fast")}
    assert sizes == {(64, 96)}  # the pipeline's own choice from the last input image's aspect, in both presets
    assert cli(["render", *edit, "--preset", "fast", "--out", str(tmp_path / "fast")]) == 0
    assert "1 skipped" in capsys.readouterr().out
    changed = [str(checkpoints / "c.png") if a == str(checkpoints / "a.png") else a for a in edit]
    with pytest.raises(SystemExit) as exit_info:
        cli(["render", *changed, "--preset", "fast", "--out", str(tmp_path / "fast")])
    assert exit_info.value.code == 2 and "made with other settings (images" in capsys.readouterr().err
    assert cli(["compare", str(tmp_path / "baseline"), str(tmp_path / "fast"), "--out", str(tmp_path / "report"),
                "--min-psnr", "30"]) == 0


@needs_interpreter
def test_qwen21_renders_rgba_with_its_defaults_and_condition_images(checkpoints, tmp_path, capsys, monkeypatch):
    """A Qwen-Image-2.1 checkpoint: its class from model_index.json; its defaults (no CFG, so no negative prompt;
    a test-size model: 64x64 and 2 steps), a line with an input image sized by the pipeline from it (area shrunk as
    for the edit pipelines), the image given to the pipeline as RGBA with its alpha; RGBA images out; both presets
    render the same images (compare, alpha included)."""
    import diffusers

    from qwen_image_fast.command import main as cli

    seen = []
    call = diffusers.QwenImage21Pipeline.__call__

    def spy(self, *args, **kwargs):
        image = kwargs.get("image")
        seen.append([i.mode for i in (image if isinstance(image, list) else [image] if image is not None else [])])
        return call(self, *args, **kwargs)

    monkeypatch.setattr(diffusers.QwenImage21Pipeline, "__call__", spy)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "a cat"}) + "\n"
                       + json.dumps({"prompt": "make it blue", "images": str(checkpoints / "rgba.png")}) + "\n")
    for preset in ("baseline", "fast"):
        assert cli(["render", "--model", str(checkpoints / "qwen21"), "--device", "cpu", "--preset", preset,
                    "--prompts", str(prompts), "--out", str(tmp_path / preset)]) == 0
    assert seen == [[], ["RGBA"]] * 2
    assert "(as asked, QwenImage21Pipeline, a test-size model: 2 steps unless given" in capsys.readouterr().out
    text, conditioned = manifest(tmp_path / "fast")
    assert (text["steps"], text["cfg"], text["negative_prompt"]) == (2, 1.0, None)
    assert (text["width"], text["height"]) == (64, 64) and conditioned["width"] is None
    assert cli(["render", "--model", str(checkpoints / "qwen21"), "--device", "cpu", "--prompts", str(prompts),
                "--dry-run"]) == 0
    # what runs; batched CFG would with CFG, which none of these prompts has (the dry run says so on its line)
    planned = [line.split()[2] for line in capsys.readouterr().out.splitlines()[2:]
               if "(no image has CFG: no)" not in line]
    assert "fused_transformer" in text["applied"]
    assert text["applied"] == [runs for runs in planned if runs not in ("no", "off")]  # the dry run said so
    for line, size in ((text, (64, 64)), (conditioned, (96, 32))):  # 2:1 at 1024^2 / 256, multiples of 32
        for preset in ("baseline", "fast"):
            image = Image.open(tmp_path / preset / line["file"])
            assert (image.mode, image.size) == ("RGBA", size), (preset, image.mode, image.size)
    assert cli(["compare", str(tmp_path / "baseline"), str(tmp_path / "fast"), "--out", str(tmp_path / "report"),
                "--min-psnr", "30"]) == 0


def test_qwen21_samples_on_a_few_step_schedule_from_the_command_line(checkpoints, tmp_path):
    """--sigmas on a Qwen-Image-2.1 checkpoint (a turbo LoRA's kind of schedule): the baseline preset's image is the
    stock pipeline's called with the same sigmas= and seed, pixel for pixel; the fast preset's compares with it."""
    import diffusers
    import torch

    from qwen_image_fast.command import main as cli
    from qwen_image_fast.pipelines.core.pipeline.base import load_stock

    sigmas = [1.0, 0.8, 0.5, 0.3]
    for preset in ("baseline", "fast"):
        assert cli(["render", "--model", str(checkpoints / "qwen21"), "--device", "cpu", "--preset", preset,
                    "--sigmas", ",".join(map(str, sigmas)), "--out", str(tmp_path / preset), "a cat"]) == 0
    (line,) = manifest(tmp_path / "baseline")
    assert (line["sigmas"], line["steps"]) == (sigmas, 4)
    # diffusers' from_pretrained in BF16, as render loads a checkpoint (its processor built without torchvision:
    # core/vl_processor.py)
    stock = load_stock(diffusers.QwenImage21Pipeline, checkpoints / "qwen21", dtype=torch.bfloat16)
    def ref(**schedule):
        return np.asarray(stock("a cat", true_cfg_scale=1.0, width=64, height=64, num_inference_steps=4,
                                generator=[torch.Generator("cpu").manual_seed(line["seed"])], **schedule).images[0])

    assert np.array_equal(np.asarray(Image.open(tmp_path / "baseline" / line["file"])), ref(sigmas=sigmas))
    assert not np.array_equal(ref(sigmas=sigmas), ref())  # not the default schedule's image
    assert cli(["compare", str(tmp_path / "baseline"), str(tmp_path / "fast"), "--out", str(tmp_path / "report"),
                "--min-psnr", "30"]) == 0


def test_qwen21_step_cache_with_compare_uncached_from_the_command_line(checkpoints, tmp_path, capsys):
    """--cache on a Qwen-Image-2.1 checkpoint with --compare-uncached: both rendered (one model load) and compared;
    every:2,1,0 on its 2 blocks over 4 steps runs block 1 alone at steps 1 and 3: 6 of 8 blocks."""
    from qwen_image_fast.command import main as cli

    cached, uncached = tmp_path / "cached", tmp_path / "uncached"
    assert cli(["render", "--model", str(checkpoints / "qwen21"), "--device", "cpu", "--preset", "fast", "--steps",
                "4", "--cache", "every:2,1,0", "--out", str(cached), "--compare-uncached", str(uncached),
                "a cat"]) == 0
    out = capsys.readouterr().out
    [line], [plain] = manifest(cached), manifest(uncached)
    assert line["blocks_computed"] == 0.75 and "blocks_computed" not in plain, (line, plain)
    assert "A | B: blocks computed 100% | 75%" in out and "pass: 1 pair(s) measured" in out, out
    assert not np.array_equal(np.asarray(Image.open(cached / line["file"])),
                              np.asarray(Image.open(uncached / plain["file"])))


@pytest.mark.parametrize("condition", [False, True], ids=["prompts-encoded-ahead", "condition-image"])
def test_qwen21_max_memory_renders_the_same_images_with_memory_low(checkpoints, tmp_path, condition):
    """--max-memory 24 on a Qwen-Image-2.1 checkpoint: memory='low' (the text encoder and the blocks taking turns,
    recorded in applied), the same pixels as without it, with CFG: three prompts, one a call (encoded ahead, in one
    turn of the text encoder), or one with a condition image (its call encodes it)."""
    from qwen_image_fast.command import main as cli

    common = ["render", "--model", str(checkpoints / "qwen21"), "--device", "cpu", "--preset", "fast", "--steps", "2",
              "--cfg", "2", "--negative-prompt", "blurry"]
    if condition:
        common += ["--image", str(checkpoints / "a.png"), "a cat"]
    else:
        common += ["a cat", "a large dog on a rug", "a cow"]
    assert cli([*common, "--out", str(tmp_path / "fast")]) == 0
    assert cli([*common, "--max-memory", "24", "--out", str(tmp_path / "low")]) == 0
    fast, low = manifest(tmp_path / "fast"), manifest(tmp_path / "low")
    assert len(fast) == len(low) == (1 if condition else 3)
    for fast_line, low_line in zip(fast, low):
        assert "memory:low" in low_line["applied"] and "memory:low" not in fast_line["applied"], low_line["applied"]
        assert np.array_equal(np.asarray(Image.open(tmp_path / "fast" / fast_line["file"])),
                              np.asarray(Image.open(tmp_path / "low" / low_line["file"])))


def test_inpainting_from_jsonl_with_images_mask_and_strength(checkpoints, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "a cat", "images": str(checkpoints / "a.png"),
                                   "mask": str(checkpoints / "mask.png"), "strength": 0.7}) + "\n")
    assert main(["render", *BASELINE, "--model", str(checkpoints / "inpaint"), "--prompts", str(prompts),
                 "--out", str(tmp_path / "out")]) == 0
    (line,) = manifest(tmp_path / "out")
    assert line["strength"] == 0.7 and line["mask"]["path"] == str(checkpoints / "mask.png")
    assert Image.open(tmp_path / "out" / line["file"]).size == (32, 32)


def test_encode_ahead_covers_a_window_of_images_and_skips_image_inputs():
    from types import SimpleNamespace

    import torch

    calls, negative_mask = [], torch.tensor([[1, 1, 0], [1, 0, 0]])

    def encode_prompt(prompts, device):
        """[B, 3, 4] embeds; the prompts' mask all ones (so None, as diffusers returns it), the negatives' padded."""
        calls.append(prompts)
        embeds = torch.full((len(prompts), 3, 4), float(len(calls)))
        return embeds, negative_mask if prompts[0] == "bad" else None

    pipe = SimpleNamespace(_execution_device="cpu", encode_prompt=encode_prompt)

    def job(prompt, images=()):
        return SimpleNamespace(prompt=prompt, negative_prompt="bad", images=images)

    batches = [[job(f"p{i}"), job(f"q{i}")] for i in range(10)]  # 20 images
    batches[1] = [job("edit this", images=("in.png",))]  # an edit batch: its own call encodes it
    encoded, until = encode_ahead(pipe, batches, 0)
    assert ENCODE_AHEAD_IMAGES == 16 and until == 9  # 2 + 1 + 2 x 7 = 17 images: the window is full
    assert sorted(encoded) == [0, 2, 3, 4, 5, 6, 7, 8]
    assert calls[:2] == [["p0", "q0"], ["bad", "bad"]] and len(calls) == 16
    first = encoded[0]
    assert torch.equal(first["prompt_embeds"], torch.full((2, 3, 4), 1.0))
    # no mask (all ones) goes back in as an all-ones mask: diffusers' check_inputs warns about a missing one
    assert torch.equal(first["prompt_embeds_mask"], torch.ones(2, 3, dtype=torch.long))
    assert torch.equal(first["negative_prompt_embeds"], torch.full((2, 3, 4), 2.0))
    assert first["negative_prompt_embeds_mask"] is negative_mask
    encoded, until = encode_ahead(pipe, batches, until)
    assert sorted(encoded) == [9] and until == 10
