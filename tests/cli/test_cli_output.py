"""`qwen-image-fast render` output on the CPU with the tiny random model: files, embedded settings, manifest."""

import json
import warnings
import zlib

import numpy as np
import pytest
from PIL import Image

from qwen_image_fast.command import main
from qwen_image_fast.cli.jobs import NEGATIVE_PROMPT, Defaults, make_jobs
from qwen_image_fast.cli.models import (TINY_ENHANCER_NOTE, TINY_NOTE, labels_for)
from qwen_image_fast.cli.output import prepare_out_dir, read_settings
from qwen_image_fast.cli.run import render_jobs
from qwen_image_fast.pipelines.core.config import FastConfig

from cli_helpers import BASELINE, manifest, needs_interpreter, pixels, write_lines
from helpers import diffusers_warnings


# ---- output: files, embedded settings, manifest


@needs_interpreter
def test_fast_preset_records_what_ran_per_image_and_tiny_is_labeled_noise(tmp_path, capsys):
    """The default preset (fused Triton kernels) with the tiny model's default size and steps (64x64, 2). Each image
    records what its own pipeline call ran: no CFG, no batched CFG; never CUDA graphs on a CPU."""
    prompts = write_lines(tmp_path / "p.jsonl", ['{"prompt": "a cat"}', '{"prompt": "a dog", "cfg": 1}'])
    out_dir = tmp_path / "out"
    assert main(["render", "--model", "tiny-random", "--device", "cpu", "--prompts", str(prompts),
                 "--out", str(out_dir)]) == 0
    out = capsys.readouterr().out
    assert "2 written, 0 skipped" in out and "noise from random weights" in out
    cat, dog = manifest(out_dir)
    assert cat["file"] == "00000-0.png" and "noise from random weights" in cat["note"]
    expected = dict(prompt="a cat", negative_prompt=NEGATIVE_PROMPT, seed=0, width=64, height=64, steps=2,
                    cfg=4.0, model="tiny-random", preset="fast", scheduler="euler", enhancer=None,
                    note=TINY_NOTE)
    embedded = read_settings(out_dir / "00000-0.png")
    assert embedded == {**expected, "applied": cat["applied"]}  # the same values and types as the manifest line
    assert {key: cat[key] for key in expected} == expected
    assert "fused_transformer" in cat["applied"] and "batched_cfg" in cat["applied"]
    assert "fused_transformer" in dog["applied"] and "batched_cfg" not in dog["applied"]
    assert not any("graph" in entry for entry in cat["applied"] + dog["applied"])
    image = pixels(out_dir / "00000-0.png")
    assert image.shape == (64, 64, 3) and image.std() > 0


def test_each_image_records_what_its_own_pipeline_call_ran(tmp_path):
    """pipe.applied is read after each call (it says what that call ran), not once at load."""

    class Pipe:
        applied = ["loaded"]

        def __call__(self, prompt, true_cfg_scale, width, height, **kwargs):
            self.applied = ["fused_transformer"] + (["batched_cfg"] if true_cfg_scale > 1 else [])
            return type("Output", (), {"images": [Image.new("RGB", (width, height))] * len(prompt)})

    jobs = make_jobs([{"prompt": "a cat"}, {"prompt": "a dog", "cfg": 1.0}, {"prompt": "a cow"}],
                     Defaults(negative_prompt="", seed=0, width=16, height=16, steps=2, cfg=4.0))
    labels = labels_for("tiny-random", "fast", FastConfig())
    summary = render_jobs(Pipe, jobs, prepare_out_dir(tmp_path), labels)
    assert summary.written == 3 and summary.applied == ("fused_transformer", "batched_cfg")
    assert [line["applied"] for line in manifest(tmp_path)] == [
        ["fused_transformer", "batched_cfg"], ["fused_transformer"], ["fused_transformer", "batched_cfg"]]
    assert read_settings(tmp_path / "00001-1.png")["applied"] == ["fused_transformer"]


@pytest.mark.parametrize("fmt", ["png", "jpg", "webp"])
def test_settings_round_trip_with_their_types_in_every_format(fmt, tmp_path):
    assert main(["render", *BASELINE, "--format", fmt, "--seed", "5", "--out", str(tmp_path), "un chat 猫"]) == 0
    [line] = manifest(tmp_path)
    assert line["file"] == f"00000-5.{fmt}"
    settings = read_settings(tmp_path / line["file"])
    assert settings == {key: line[key] for key in settings} and settings["seed"] == 5 and settings["cfg"] == 4.0
    assert settings["prompt"] == "un chat 猫" and settings["preset"] == "baseline" and settings["applied"] == []
    assert "note" in settings
    assert Image.open(tmp_path / line["file"]).format == {"png": "PNG", "jpg": "JPEG", "webp": "WEBP"}[fmt]


def test_a_local_checkpoint_loads_without_deprecation_warnings(tmp_path):
    """diffusers 0.42 deprecates from_pretrained's torch_dtype (a FutureWarning at every load): we pass dtype."""
    from qwen_image_fast.pipelines.tiny import tiny_pipeline

    tiny_pipeline().save_pretrained(tmp_path / "model")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["render", *BASELINE, "--model", str(tmp_path / "model"), "--out", str(tmp_path / "out"),
                     "a cat"]) == 0
    assert [str(w.message) for w in caught if "dtype" in str(w.message)] == []
    [line] = manifest(tmp_path / "out")
    assert line["model"] == str(tmp_path / "model")
    assert line["note"] == "from a test-size model (transformer width 48), not a full-size rendering of the prompt"


def test_jsonl_fields_ids_and_seeds(tmp_path):
    prompts = write_lines(tmp_path / "p.jsonl", [
        json.dumps({"prompt": "a cat", "id": "cat", "seed": 7, "width": 48, "height": 32}),
        json.dumps({"prompt": "a dog", "id": "dog", "cfg": 1.0}),
        json.dumps({"prompt": "a cow", "negative_prompt": "blurry", "steps": 3}),
    ])
    out_dir = tmp_path / "out"
    assert main(["render", *BASELINE, "--seed", "100", "--prompts", str(prompts), "--out", str(out_dir)]) == 0
    lines = {line["prompt"]: line for line in manifest(out_dir)}
    dog_seed = 100 + zlib.crc32(b"dog")
    assert [lines[p]["file"] for p in ("a cat", "a dog", "a cow")] == ["cat-7.png", f"dog-{dog_seed}.png",
                                                                       "00002-102.png"]
    assert Image.open(out_dir / "cat-7.png").size == (48, 32)
    assert lines["a dog"]["negative_prompt"] is None and lines["a dog"]["cfg"] == 1.0
    assert lines["a cow"]["negative_prompt"] == "blurry" and lines["a cow"]["steps"] == 3


def test_batches_give_the_same_images_as_one_at_a_time(tmp_path):
    prompts = ["a cat", "a dog", "a cow"]
    assert main(["render", *BASELINE, "--out", str(tmp_path / "one"), *prompts]) == 0
    assert main(["render", *BASELINE, "--batch-size", "3", "--out", str(tmp_path / "three"), *prompts]) == 0
    for line in manifest(tmp_path / "one"):
        assert np.abs(pixels(tmp_path / "one" / line["file"]) - pixels(tmp_path / "three" / line["file"])).max() <= 1


@needs_interpreter
def test_max_memory_renders_the_same_images_with_memory_low(tmp_path):
    """--max-memory below the fast pipeline's need: memory='low' (recorded in applied), the prompts of the job
    encoded ahead, and the same pixels as without it (batches of 2, one alone, one without CFG)."""
    prompts = write_lines(tmp_path / "p.jsonl", ['{"prompt": "a cat"}', '{"prompt": "a large dog"}',
                                                 '{"prompt": "a cow", "cfg": 1}'])
    common = ["render", "--model", "tiny-random", "--device", "cpu", "--batch-size", "2", "--prompts", str(prompts)]
    assert main([*common, "--out", str(tmp_path / "fast")]) == 0
    with diffusers_warnings() as warned:
        assert main([*common, "--max-memory", "24", "--out", str(tmp_path / "low")]) == 0
    assert warned == []  # the prompts encoded ahead go in with their (all-ones) masks: no "mask not provided"
    for fast, low in zip(manifest(tmp_path / "fast"), manifest(tmp_path / "low")):
        assert "memory:low" in low["applied"] and "memory:low" not in fast["applied"]
        assert np.array_equal(pixels(tmp_path / "fast" / fast["file"]), pixels(tmp_path / "low" / low["file"]))


def test_max_memory_below_22_gib_plans_the_budget(tmp_path):
    """--max-memory 16: memory='low' planned in 16 GiB (FastConfig.max_memory_gib, recorded in applied as
    low16gib); the tiny model fits it whole, so nothing streams here (tests/pipelines/test_streaming.py streams), and
    the pixels equal the fast pipeline's."""
    common = ["render", "--model", "tiny-random", "--device", "cpu", "a cat"]
    assert main([*common, "--out", str(tmp_path / "fast")]) == 0
    assert main([*common, "--max-memory", "16", "--out", str(tmp_path / "low")]) == 0
    [fast], [low] = manifest(tmp_path / "fast"), manifest(tmp_path / "low")
    assert "memory:low16gib" in low["applied"] and not any(a.startswith("memory") for a in fast["applied"])
    assert np.array_equal(pixels(tmp_path / "fast" / fast["file"]), pixels(tmp_path / "low" / low["file"]))


@needs_interpreter
def test_enhance_tiny_random_records_the_rewrites_and_resumes(tmp_path, capsys):
    out_dir = tmp_path / "out"
    args = ["render", *BASELINE, "--batch-size", "2", "--out", str(out_dir), "a cat", "a dog", "--enhance",
            "tiny-random"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "2 written, 0 skipped" in out and "rewriting the prompt" in out and "gibberish from random weights" in out
    lines = manifest(out_dir)
    assert [line["prompt"] for line in lines] == ["a cat", "a dog"]
    for line in lines:
        assert line["enhancer"] == "tiny-random" and line["enhancer_note"] == TINY_ENHANCER_NOTE
        assert line["enhanced_prompt"] not in ("", line["prompt"]) and line["enhance_seconds"] >= 0
        embedded = read_settings(out_dir / line["file"])
        assert list(embedded)[:2] == ["prompt", "enhanced_prompt"]
        assert {key: embedded[key] for key in ("prompt", "enhanced_prompt", "enhancer", "enhancer_note")} == {
            key: line[key] for key in ("prompt", "enhanced_prompt", "enhancer", "enhancer_note")}
    # What was rendered is the rewrite: the rewrites as prompts (same seeds) give the same images.
    rewrites = write_lines(tmp_path / "rewrites.jsonl", [json.dumps({"prompt": line["enhanced_prompt"]})
                                                         for line in lines])
    assert main(["render", *BASELINE, "--prompts", str(rewrites), "--out", str(tmp_path / "plain")]) == 0
    for line in lines:
        assert np.abs(pixels(out_dir / line["file"]) - pixels(tmp_path / "plain" / line["file"])).max() <= 1
    capsys.readouterr()

    assert main(args) == 0  # the same prompts and --enhance: done
    assert "0 written, 2 skipped" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # no --enhance: other settings, which would overwrite the images
        main(args[:-2])
    assert "exists, made with other settings (enhancer 'tiny-random', now None" in capsys.readouterr().err
    assert main([*args[:-2], "--no-resume"]) == 0
    assert "2 written, 0 skipped" in capsys.readouterr().out
    assert all(line["enhancer"] is None and "enhanced_prompt" not in line for line in manifest(out_dir))
