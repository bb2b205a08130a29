"""`qwen-image-fast render` on the CPU with the tiny random model: bad input, metadata, resume, sharding.

Most runs use --preset baseline (the stock pipeline: ~0.03 s an image); one runs the fast preset's Triton kernels
under the interpreter. Subprocesses (kill -9, two ranks) inherit this environment (TRITON_INTERPRET, HF_HUB_OFFLINE).
"""

import json
import os
import signal
import subprocess
import sys
import time
import zlib

import numpy as np
import pytest
from PIL import Image

from qwen_image_fast import render
from qwen_image_fast.cli import main

TINY = ["--model", "tiny-random", "--device", "cpu", "--width", "32", "--height", "32", "--steps", "2"]
BASELINE = [*TINY, "--preset", "baseline"]
needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="Triton interpreter off (GPU machine): no Triton kernels on the CPU")


def manifest(out_dir) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "manifest.jsonl").read_text().splitlines()]


def images(out_dir) -> list:
    return [path for path in out_dir.glob("*.png") if not path.name.startswith(".")]


def pixels(path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB")).astype(np.int16)


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


# ---- bad input: exit status 2 and a message naming the problem, before any model is loaded


def empty_prompt_file(tmp_path):
    return ["--prompts", str(write_lines(tmp_path / "p.txt", ["# only a comment", "", "   "]))]


def malformed_jsonl(tmp_path):
    return ["--prompts", str(write_lines(tmp_path / "p.jsonl", ['{"prompt": "a cat"}', '{"prompt": "a dog",}']))]


def jsonl_bad_width(tmp_path):
    lines = ['{"prompt": "a cat"}', "", '{"prompt": "a dog", "width": 40, "height": 32}']
    return ["--prompts", str(write_lines(tmp_path / "p.jsonl", lines))]


def unwritable_out(tmp_path):
    (tmp_path / "a_file").write_text("")
    return ["--out", str(tmp_path / "a_file" / "images"), "a cat"]


@pytest.mark.parametrize("make_args, message", [
    (lambda tmp: ["--aspect", "5:4", "a cat"], "argument --aspect: invalid choice: '5:4'"),
    (lambda tmp: ["--seed", "1.5", "a cat"], "argument --seed: invalid int value: '1.5'"),
    (lambda tmp: ["--width", "100", "--height", "64", "a cat"], "--width: must be a positive multiple of 16, got 100"),
    (lambda tmp: ["--steps", "1", "a cat"], "--steps: must be >= 2"),
    (empty_prompt_file, "no prompts in it"),
    (malformed_jsonl, "line 2: not valid JSON"),
    (jsonl_bad_width, 'line 3: "width" must be a positive multiple of 16, got 40'),
    (unwritable_out, "not a writable folder"),
    (lambda tmp: [], "no prompts"),
    (lambda tmp: ["--scheduler", "unipc", "a cat"], "--preset baseline runs the stock diffusers pipeline"),
    (lambda tmp: ["--enhance", "a cat"], "'a cat': neither a local folder nor a hub id"),
], ids=["aspect", "seed", "width", "steps", "empty-file", "malformed-jsonl", "jsonl-width", "unwritable-out",
        "no-prompt", "baseline-scheduler", "enhance-takes-the-prompt"])
def test_bad_input_exits_2_with_a_message(make_args, message, tmp_path, capsys):
    args = ["render", *BASELINE, "--out", str(tmp_path / "out"), *make_args(tmp_path)]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_importing_the_cli_skips_the_qwen35_model():
    code = "import sys, qwen_image_fast.cli; print(sorted(m for m in sys.modules if 'qwen35' in m))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_fast_preset_on_cpu_without_interpreter_exits_2(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["render", *TINY, "--out", str(tmp_path), "a cat"])
    assert exit_info.value.code == 2
    assert "TRITON_INTERPRET=1" in capsys.readouterr().err


def test_enhance_on_cpu_without_interpreter_exits_2(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["render", *BASELINE, "--out", str(tmp_path), "a cat", "--enhance=tiny-random"])
    assert exit_info.value.code == 2
    assert "--enhance on the CPU" in capsys.readouterr().err


def test_model_auto_uses_the_real_model_only_when_cached_and_on_a_gpu(monkeypatch):
    import torch

    monkeypatch.setattr(render, "cached_locally", lambda repo_id: False)
    assert render.resolve_model("auto", torch.device("cuda"))[0] == "tiny-random"
    monkeypatch.setattr(render, "cached_locally", lambda repo_id: True)
    assert render.resolve_model("auto", torch.device("cpu"))[0] == "tiny-random"
    assert render.resolve_model("auto", torch.device("cuda"))[0] == "Qwen/Qwen-Image-2512"
    assert render.resolve_model("some/model", torch.device("cpu")) == ("some/model", "as asked")


# ---- output: files, embedded settings, manifest


@needs_interpreter
def test_fast_preset_png_settings_round_trip_and_tiny_is_labeled_noise(tmp_path, capsys):
    """The default preset (fused Triton kernels) with the tiny model's default size and steps (64x64, 2)."""
    assert main(["render", "--model", "tiny-random", "--device", "cpu", "--out", str(tmp_path), "a cat"]) == 0
    out = capsys.readouterr().out
    assert "1 written, 0 skipped" in out and "noise from random weights" in out
    [line] = manifest(tmp_path)
    assert line["file"] == "00000-0.png" and "fused_transformer" in line["applied"]
    assert "noise from random weights" in line["note"]
    text = render.read_settings(tmp_path / "00000-0.png")
    expected = dict(prompt="a cat", negative_prompt=render.NEGATIVE_PROMPT, seed=0, width=64, height=64, steps=2,
                    cfg=4.0, scheduler="euler", model="tiny-random", config="fused-fp8-fastacc-auto-bcfg-graphs-euler",
                    note=render.TINY_NOTE)
    assert text == {key: str(value) for key, value in expected.items()}
    assert {key: line[key] for key in expected} == expected
    image = pixels(tmp_path / "00000-0.png")
    assert image.shape == (64, 64, 3) and image.std() > 0


@pytest.mark.parametrize("fmt", ["jpg", "webp"])
def test_jpeg_and_webp_settings_round_trip(fmt, tmp_path):
    assert main(["render", *BASELINE, "--format", fmt, "--seed", "5", "--out", str(tmp_path), "un chat 猫"]) == 0
    [line] = manifest(tmp_path)
    assert line["file"] == f"00000-5.{fmt}"
    settings = render.read_settings(tmp_path / line["file"])
    assert settings == {key: line[key] for key in settings}
    assert settings["prompt"] == "un chat 猫" and settings["config"] == "stock-euler" and "note" in settings
    assert Image.open(tmp_path / line["file"]).format == {"jpg": "JPEG", "webp": "WEBP"}[fmt]


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
        assert line["enhancer"] == "tiny-random" and line["enhancer_note"] == render.TINY_ENHANCER_NOTE
        assert line["enhanced_prompt"] not in ("", line["prompt"]) and line["enhance_seconds"] >= 0
        embedded = render.read_settings(out_dir / line["file"])
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
    assert main(args[:-2]) == 0  # no --enhance: other settings, rendered again
    assert "2 written, 0 skipped" in capsys.readouterr().out
    assert all(line["enhancer"] is None and "enhanced_prompt" not in line for line in manifest(out_dir))


# ---- resume


def test_resume_renders_only_what_is_missing(tmp_path, capsys):
    args = ["render", *BASELINE, "--out", str(tmp_path), "a cat", "a dog", "a cow"]
    assert main(args) == 0
    kept = {name: (tmp_path / name).stat().st_mtime_ns for name in ("00000-0.png", "00002-2.png")}
    # As after a kill: one image gone, its manifest line gone, a half-written line and a stale temporary file.
    (tmp_path / "00001-1.png").unlink()
    lines = (tmp_path / "manifest.jsonl").read_text().splitlines()
    (tmp_path / "manifest.jsonl").write_text(lines[0] + "\n" + lines[2] + "\n" + lines[1][:40])
    (tmp_path / ".tmp-00001-1.png").write_bytes(b"\x89PNG half")
    capsys.readouterr()

    assert main(args) == 0
    assert "1 written, 2 skipped" in capsys.readouterr().out
    assert {name: (tmp_path / name).stat().st_mtime_ns for name in kept} == kept
    assert not list(tmp_path.glob(".tmp-*"))
    assert [line["file"] for line in manifest(tmp_path)] == ["00000-0.png", "00001-1.png", "00002-2.png"]

    assert main([*args, "--cfg", "3"]) == 0  # other settings: everything again
    assert "3 written, 0 skipped" in capsys.readouterr().out
    assert main([*args, "--cfg", "3", "--no-resume"]) == 0
    assert "3 written, 0 skipped" in capsys.readouterr().out
    assert len(manifest(tmp_path)) == 3


def test_kill_9_loses_no_finished_image_and_leaves_no_partial_file(tmp_path, capsys):
    prompts = write_lines(tmp_path / "p.txt", [f"prompt number {i}" for i in range(8)])
    out_dir = tmp_path / "out"
    args = ["render", "--model", "tiny-random", "--device", "cpu", "--preset", "baseline", "--width", "64",
            "--height", "64", "--steps", "20", "--prompts", str(prompts), "--out", str(out_dir)]
    process = subprocess.Popen([sys.executable, "-m", "qwen_image_fast", *args], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    manifest_path = out_dir / "manifest.jsonl"
    deadline = time.monotonic() + 60
    while not (manifest_path.exists() and manifest_path.read_text().count("\n") >= 2) and time.monotonic() < deadline:
        assert process.poll() is None, f"the render exited (status {process.returncode}) before it could be killed"
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()

    listed = [json.loads(line)["file"] for line in manifest_path.read_text().splitlines() if line.endswith("}")]
    assert len(listed) >= 2
    for path in images(out_dir):  # every image in place is complete
        Image.open(path).load()
    assert main(args) == 0
    summary = capsys.readouterr().out
    written, skipped = (int(summary.split(" written")[0].split()[-1]), int(summary.split(" skipped")[0].split()[-1]))
    assert skipped >= len(listed) and written + skipped == 8
    assert len(manifest(out_dir)) == 8 and len(images(out_dir)) == 8
    assert not list(out_dir.glob(".tmp-*"))


# ---- several processes


def test_two_ranks_render_every_prompt_once_and_merge_the_manifest(tmp_path):
    prompts = write_lines(tmp_path / "p.txt", ["a cat", "a dog", "a cow", "a hen", "a pig"])
    out_dir = tmp_path / "out"
    args = [sys.executable, "-m", "qwen_image_fast", "render", *BASELINE, "--prompts", str(prompts),
            "--out", str(out_dir)]
    ranks = [subprocess.Popen(args, env={**os.environ, "RANK": str(rank), "WORLD_SIZE": "2"},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    for rank, process in enumerate(ranks):
        output = process.communicate(timeout=120)[0]
        assert process.returncode == 0, output
        assert f"rank {rank}/2: {3 - rank} written" in output

    lines = manifest(out_dir)
    assert sorted(line["prompt"] for line in lines) == ["a cat", "a cow", "a dog", "a hen", "a pig"]
    assert sorted(line["index"] for line in lines) == [0, 1, 2, 3, 4]
    for rank, indices in ((0, [0, 2, 4]), (1, [1, 3])):
        shard = [json.loads(line) for line in (out_dir / f"manifest.rank{rank}.jsonl").read_text().splitlines()]
        assert sorted(line["index"] for line in shard) == indices
    # The same seeds as one process: the same images whatever the sharding.
    assert main(["render", *BASELINE, "--prompts", str(prompts), "--out", str(tmp_path / "single")]) == 0
    for line in lines:
        assert np.abs(pixels(out_dir / line["file"]) - pixels(tmp_path / "single" / line["file"])).max() <= 1
