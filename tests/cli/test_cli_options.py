"""`qwen-image-fast render`'s per-optimization options (from the registry), recorded with each image; --dry-run."""


import numpy as np
import pytest

from qwen_image_fast.command import main
from qwen_image_fast.cli.output import read_settings
from qwen_image_fast.pipelines.core.config import FastConfig

from cli_helpers import BASELINE, TINY, manifest, needs_interpreter, pixels


# ---- the registry's options: one per optimization, recorded with the images; --dry-run


def test_every_registered_optimization_has_its_option():
    from qwen_image_fast.cli.option_names import OWN_OPTIONS, option_of
    from qwen_image_fast.cli.parser import build_parser
    from qwen_image_fast.pipelines.core.optimizations import REGISTRY

    render_help = build_parser()._subparsers._group_actions[0].choices["render"].format_help()
    for opt in REGISTRY:
        assert option_of(opt) in render_help, opt.name
        if opt.name not in OWN_OPTIONS and getattr(FastConfig(), opt.field) is True:
            assert option_of(opt) == f"--no-{opt.field.replace('_', '-')}"


@needs_interpreter
def test_dry_run_says_what_would_run_and_writes_nothing(tmp_path, capsys):
    from qwen_image_fast.pipelines.core.optimizations import REGISTRY

    out = tmp_path / "out"
    assert main(["render", *TINY, "--out", str(out), "--no-cuda-graphs", "--cfg-fraction", "0.5", "--dry-run",
                 "--cache", "every:2,1,0", "a cat", "a dog"]) == 0
    text = capsys.readouterr().out
    rows = {line.split()[0]: line for line in text.splitlines()[2:]}
    assert sorted(rows) == sorted(opt.name for opt in REGISTRY)
    assert " off " in rows["cuda_graphs"] and "cfg_fraction:0.5" in rows["cfg_fraction"]
    assert "step_cache:dbcache:F1B0:every2:w0" in rows["step_cache"] and "lossy" in rows["step_cache"]
    assert "lossy" in rows["fp8"] and "rel-RMS vs stock <= 0.02" in rows["fp8"]
    assert not out.exists()
    assert main(["render", *BASELINE, "--out", str(out), "--dry-run", "a cat"]) == 0
    assert "diffusers' own pipeline runs, untouched" in capsys.readouterr().out and not out.exists()


@needs_interpreter
def test_compare_uncached_renders_both_and_compares_in_one_command(tmp_path, capsys):
    """--cache with --compare-uncached: the same prompts and seeds rendered with and without the step cache (one
    model load), then compare's table: which side had the cache, the fraction of the transformer's blocks each
    computed (every:2,1,0 on the tiny model's 2 blocks, 2 steps: step 2 runs block 1 only, 3 of 4), the report."""
    cached, uncached = tmp_path / "cached", tmp_path / "uncached"
    assert main(["render", *TINY, "--preset", "fast", "--cache", "every:2,1,0", "--out", str(cached),
                 "--compare-uncached", str(uncached), "a cat"]) == 0
    out = capsys.readouterr().out
    [line], [plain] = manifest(cached), manifest(uncached)
    assert line["blocks_computed"] == 0.75 and "blocks_computed" not in plain and "options" not in plain
    assert read_settings(cached / line["file"])["blocks_computed"] == 0.75
    assert ("A | B: applied on one side only: - | step_cache:dbcache:F1B0:every2:w0; options None | {'cache': "
            "'dbcache:F1B0:every2:w0'}") in out
    assert "A | B: blocks computed 100% | 75%" in out and "pass: 1 pair(s) measured" in out
    assert (cached / "compare-uncached" / "index.html").exists()
    assert main(["render", *TINY, "--preset", "fast", "--cache", "every:2,1,0", "--out", str(cached),
                 "--compare-uncached", str(uncached), "a cat"]) == 0  # both resume: nothing rendered again
    assert capsys.readouterr().out.count("0 written, 1 skipped (already done), 0 failed; nothing to render: all 1 "
                                         "image(s) were already there") == 2
    # the uncached pass, with the pipeline the cached one used, renders what a render without --cache renders
    assert main(["render", *TINY, "--preset", "fast", "--out", str(tmp_path / "plain"), "a cat"]) == 0
    assert np.array_equal(pixels(uncached / plain["file"]), pixels(tmp_path / "plain" / plain["file"]))


@pytest.mark.parametrize("args, message", [
    (["--compare-uncached", "u", "a cat"], "--compare-uncached renders the same images without the step cache"),
    (["--cache", "every:2,1,0", "--compare-uncached", "OUT", "a cat"], "is --out: give the uncached images their own"),
])
def test_compare_uncached_needs_a_cache_and_its_own_folder(args, message, tmp_path, capsys):
    out = str(tmp_path / "out")
    with pytest.raises(SystemExit) as exit_info:
        main(["render", *TINY, "--preset", "fast", "--out", out, *[out if a == "OUT" else a for a in args]])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_cache_is_recorded_as_applied_labels_it():
    from qwen_image_fast.cli.models import Labels

    labels = Labels(model="tiny-random", preset="fast", config=FastConfig(cache="every:2,1,0"), note=None)
    assert labels.options == {"cache": "dbcache:F1B0:every2:w0"}


def test_options_with_the_stock_preset_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["render", *BASELINE, "--out", str(tmp_path / "out"), "--no-fp8", "a cat"])
    assert exit_info.value.code == 2
    assert "--preset baseline runs the stock diffusers pipeline, which takes none of our options; --no-fp8" in \
        capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@needs_interpreter
def test_options_are_recorded_and_resume_tells_them_apart(tmp_path):
    out = tmp_path / "out"
    command = ["render", *TINY, "--out", str(out), "--cfg", "1", "a cat"]
    assert main([*command, "--no-fp8"]) == 0
    line = manifest(out)[0]
    assert line["options"] == {"fp8": False} and "fp8" not in line["applied"]
    assert read_settings(out / line["file"])["options"] == {"fp8": False}
    assert main([*command, "--no-fp8"]) == 0 and len(manifest(out)) == 1  # the same options: done
    with pytest.raises(SystemExit) as exit_info:  # the same file, other options: refused, not overwritten
        main(command)
    assert exit_info.value.code == 2
