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
import warnings
import zlib

import numpy as np
import pytest
from PIL import Image

from qwen_image_fast.cli import main
from qwen_image_fast.cli.jobs import NEGATIVE_PROMPT, Defaults, make_jobs
from qwen_image_fast.cli.models import (DEFAULT_ENHANCER_ID, TINY_ENHANCER_ID, TINY_ENHANCER_NOTE, TINY_MODEL_ID,
                                        TINY_NOTE, labels_for, resolve_model)
from qwen_image_fast.cli.output import prepare_out_dir, read_settings
from qwen_image_fast.cli.run import ENCODE_AHEAD_IMAGES, encode_ahead, render_jobs
from qwen_image_fast.pipelines.qwen_image.config import FastConfig

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


# ---- bad input: exit status 2, usage + one line naming the problem, before any model is loaded; no folder left


def empty_prompt_file(tmp_path):
    return ["--prompts", str(write_lines(tmp_path / "p.txt", ["# only a comment", "", "   "]))]


def malformed_jsonl(tmp_path):
    return ["--prompts", str(write_lines(tmp_path / "p.jsonl", ['{"prompt": "a cat"}', '{"prompt": "a dog",}']))]


def jsonl_bad_width(tmp_path):
    lines = ['{"prompt": "a cat"}', "", '{"prompt": "a dog", "width": 40, "height": 32}']
    return ["--prompts", str(write_lines(tmp_path / "p.jsonl", lines))]


def jsonl(*lines):
    return lambda tmp_path: ["--prompts", str(write_lines(tmp_path / "p.jsonl", lines))]


def unwritable_out(tmp_path):
    (tmp_path / "a_file").write_text("")
    return ["--out", str(tmp_path / "a_file" / "images"), "a cat"]


def folder_without_model_index(tmp_path):
    (tmp_path / "model").mkdir()
    return ["--model", str(tmp_path / "model"), "a cat"]


def unloadable_model(tmp_path):
    """Passes the checks (a folder with model_index.json), fails in diffusers' loader: after the out folder exists."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "model_index.json").write_text("{}")
    return ["--model", str(tmp_path / "model"), "--out", str(tmp_path / "out" / "a" / "b"), "a cat"]


def missing_gpu(tmp_path):
    import torch

    return ["--device", "cuda:99" if torch.cuda.is_available() else "cuda", "a cat"]


def tiny_lora(path, targets=("transformer_blocks.0.attn.to_q", "transformer_blocks.1.img_mlp.net.2"), seed=0):
    """A LoRA for the tiny model in lightx2v's key format (lora_down / lora_up / alpha), strong enough to see."""
    import torch
    from safetensors.torch import save_file

    from qwen_image_fast.pipelines.tiny import tiny_pipeline

    model = tiny_pipeline().transformer
    g = torch.Generator().manual_seed(seed)
    sd = {}
    q = model.transformer_blocks[0].attn.to_q
    for name in targets:
        linear = dict(model.named_modules()).get(name, q)  # a name the model lacks: to_q's shape
        k, n = linear.in_features, linear.out_features
        sd[f"{name}.lora_down.weight"] = torch.randn(4, k, generator=g) / k**0.5
        sd[f"{name}.lora_up.weight"] = torch.randn(n, 4, generator=g)
        sd[f"{name}.alpha"] = torch.tensor(4.0)
    save_file(sd, path)
    return path


def lora_not_safetensors(tmp_path):
    (tmp_path / "l.safetensors").write_bytes(b"\x00" * 64)
    return ["--lora", str(tmp_path / "l.safetensors"), "a cat"]


def lora_without_factors(tmp_path):
    import torch
    from safetensors.torch import save_file

    save_file({"transformer_blocks.0.attn.to_q.weight": torch.zeros(2, 2)}, tmp_path / "l.safetensors")
    return ["--lora", str(tmp_path / "l.safetensors"), "a cat"]


def lora_naming_a_missing_module(tmp_path):
    """A valid LoRA file naming a module the model lacks: found when it loads, after the folder exists."""
    return ["--lora", str(tiny_lora(tmp_path / "l.safetensors", targets=("blocks.0.attn.to_q",))),
            "--out", str(tmp_path / "out" / "a"), "a cat"]


def lora_for_the_text_encoder_only(tmp_path):
    import torch
    from safetensors.torch import save_file

    name = "text_encoder.model.layers.0.self_attn.q_proj"
    save_file({f"{name}.lora_A.weight": torch.zeros(4, 8), f"{name}.lora_B.weight": torch.zeros(8, 4)},
              tmp_path / "l.safetensors")
    return ["--lora", str(tmp_path / "l.safetensors"), "a cat"]


BAD_INPUT = {
    "aspect": (lambda tmp: ["--aspect", "5:4", "a cat"], "argument --aspect: invalid choice: '5:4'"),
    "seed": (lambda tmp: ["--seed", "1.5", "a cat"], "argument --seed: must be an integer, got '1.5'"),
    "seed-too-large": (lambda tmp: ["--seed", "99999999999999999999999", "a cat"],
                       f"argument --seed: must be in 0..{2**64 - 1}, got 99999999999999999999999"),
    "seed-negative": (lambda tmp: ["--seed", "-1", "a cat"], f"argument --seed: must be in 0..{2**64 - 1}, got -1"),
    "derived-seed-too-large": (lambda tmp: ["--seed", str(2**64 - 1), "a cat", "a dog"],
                               f"prompt 2: its seed {2**64} (--seed {2**64 - 1} + its index 1) is beyond"),
    "cfg-nan": (lambda tmp: ["--cfg", "nan", "a cat"], "argument --cfg: must be a finite number, got 'nan'"),
    "cfg-inf": (lambda tmp: ["--cfg", "inf", "a cat"], "argument --cfg: must be a finite number, got 'inf'"),
    "empty-prompt": (lambda tmp: ["a cat", ""], "prompt 2 is empty"),
    "blank-prompt": (lambda tmp: ["a cat", " \t "], "prompt 2 is only whitespace"),
    "width": (lambda tmp: ["--width", "100", "--height", "64", "a cat"],
              "--width: must be a positive multiple of 16, got 100"),
    "steps": (lambda tmp: ["--steps", "1", "a cat"], "--steps: must be >= 2"),
    "empty-file": (empty_prompt_file, "no prompts in it"),
    "malformed-jsonl": (malformed_jsonl, "line 2: not valid JSON"),
    "jsonl-width": (jsonl_bad_width, 'line 3: "width" must be a positive multiple of 16, got 40'),
    "jsonl-cfg-nan": (jsonl('{"prompt": "a cat", "cfg": NaN}'), 'line 1: "cfg" must be a finite number, got nan'),
    "jsonl-cfg-inf": (jsonl('{"prompt": "a cat"}', '{"prompt": "a dog", "cfg": 1e999}'),
                      'line 2: "cfg" must be a finite number, got inf'),
    "jsonl-seed": (jsonl(f'{{"prompt": "a cat", "seed": {2**64}}}'), f'line 1: "seed" must be in 0..{2**64 - 1}'),
    "jsonl-derived-seed": (lambda tmp: ["--seed", str(2**64 - 1), *jsonl('{"prompt": "a cat", "id": "cat"}')(tmp)],
                           "line 1: its seed"),
    "unwritable-out": (unwritable_out, "not a writable folder"),
    "no-prompt": (lambda tmp: [], "no prompts"),
    "baseline-scheduler": (lambda tmp: ["--scheduler", "unipc", "a cat"],
                           "--preset baseline runs the stock diffusers pipeline"),
    "enhance-takes-the-prompt": (lambda tmp: ["--enhance", "a cat"], "'a cat': neither a local folder nor a hub id"),
    "enhance-not-cached": (lambda tmp: ["a cat", "--enhance=nobody/no-such-model"],
                           "--enhance nobody/no-such-model: not in the local Hugging Face cache, and HF_HUB_OFFLINE=1"),
    "model-no-such-path": (lambda tmp: ["--model", "/nonexistent/path", "a cat"],
                           "--model /nonexistent/path: no such local folder, and not a hub id"),
    "model-not-cached": (lambda tmp: ["--model", "nobody/no-such-model", "a cat"],
                         "--model nobody/no-such-model: not in the local Hugging Face cache, and HF_HUB_OFFLINE=1"),
    "model-folder-not-a-pipeline": (folder_without_model_index, "without model_index.json, not a checkpoint"),
    "model-fails-to-load": (unloadable_model, "cannot read its model_index.json ('_class_name')"),
    "device-missing-gpu": (missing_gpu, "--device cuda"),
    "device-not-a-device": (lambda tmp: ["--device", "tpu9", "a cat"], "--device tpu9: not a device"),
    "lora-missing": (lambda tmp: ["--lora", str(tmp / "none.safetensors"), "a cat"],
                     "none.safetensors: no such file, and not a file in a hub repo (OWNER/NAME/FILE.safetensors)"),
    "lora-folder": (lambda tmp: ["--lora", str(tmp), "a cat"], "a folder; name the LoRA file in it"),
    "lora-not-cached": (lambda tmp: ["--lora", "nobody/no-lora/l.safetensors:0.5", "a cat"],
                        "--lora nobody/no-lora/l.safetensors: cannot get l.safetensors from the hub repo nobody/no-lora"),
    "lora-not-safetensors": (lora_not_safetensors, "l.safetensors: not a safetensors file"),
    "lora-not-a-lora": (lora_without_factors, "l.safetensors: not a LoRA (none of its 1 tensors is a LoRA factor"),
    "lora-missing-module": (lora_naming_a_missing_module, "l.safetensors: cannot load it (NoMatchingPeftModuleError"),
    "lora-targets-nothing": (lora_for_the_text_encoder_only,
                             "l.safetensors: targets no layer of this model's transformer"),
    "lora-scale-nan": (lambda tmp: ["--lora", "x.safetensors:nan", "a cat"], "the scale must be a finite number"),
    "lora-scale-text": (lambda tmp: ["--lora", "x.safetensors:strong", "a cat"],
                        "the part after the last ':' must be a scale (a number), got 'strong'"),
    "lightning-scheduler": (lambda tmp: ["--preset", "fast", "--lightning", "--scheduler", "unipc", "a cat"],
                            "--lightning samples with the Euler schedule"),
    "parallel-one-process": (lambda tmp: ["--preset", "fast", "--parallel", "cfg", "a cat"],
                             "--parallel cfg splits one image over several processes: launch with torchrun"),
    "ulysses-without-parallel": (lambda tmp: ["--ulysses", "2", "a cat"], "--ulysses 2 needs --parallel ulysses"),
    "parallel-not-a-mode": (lambda tmp: ["--parallel", "tensor", "a cat"], "argument --parallel: invalid choice"),
    "max-memory-too-small": (lambda tmp: ["--preset", "fast", "--max-memory", "12", "a cat"],
                             "--max-memory 12: the pipeline needs at least 22 GiB"),
    "max-memory-not-a-number": (lambda tmp: ["--max-memory", "lots", "a cat"], "must be a number, got 'lots'"),
    "max-memory-negative": (lambda tmp: ["--max-memory", "-4", "a cat"], "must be > 0, got -4"),
    "max-memory-stock": (lambda tmp: ["--max-memory", "24", "a cat"],
                         "needs memory='low', which runs in the fast text-to-image pipeline alone; --preset baseline"),
}


@pytest.mark.parametrize("make_args, message", BAD_INPUT.values(), ids=BAD_INPUT.keys())
def test_bad_input_exits_2_with_one_line_and_leaves_no_folder(make_args, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    args = ["render", *BASELINE, "--out", str(tmp_path / "out"), *make_args(tmp_path)]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    usage, error = err.splitlines()  # argparse's one usage line, then one line saying what is wrong
    assert usage.startswith("usage: qwen-image-fast render") and error.startswith("qwen-image-fast render: error: ")
    assert message in error
    assert not (tmp_path / "out").exists()


def test_help_imports_neither_torch_nor_diffusers_nor_the_model_code():
    """`--help` answers at once: torch, diffusers, triton, transformers and the Qwen3.5 code stay unimported."""
    code = ("import sys\nfrom qwen_image_fast.cli import main\n"
            "for argv in (['--help'], ['render', '--help'], ['compare', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit as e:\n        assert e.code == 0, e\n"
            "heavy = ('torch', 'diffusers', 'triton', 'transformers', 'numpy', 'qwen_image_fast.pipelines.qwen35')\n"
            "print(sorted(m for m in heavy if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines()[-1] == "[]"


def test_ids_copied_into_the_cli_match_their_modules():
    """cli/models.py keeps copies of ids from modules that import torch (tiny.py, the enhancer): they must agree."""
    from qwen_image_fast.pipelines import tiny
    from qwen_image_fast.pipelines.qwen35 import enhance

    assert (TINY_MODEL_ID, TINY_ENHANCER_ID) == (tiny.TINY_MODEL_ID, tiny.TINY_ENHANCER_ID)
    assert DEFAULT_ENHANCER_ID == enhance.DEFAULT_ENHANCER_ID


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

    monkeypatch.setattr("qwen_image_fast.cli.models.cached_locally", lambda repo_id: False)
    assert resolve_model("auto", torch.device("cuda"))[0] == "tiny-random"
    monkeypatch.setattr("qwen_image_fast.cli.models.cached_locally", lambda repo_id: True)
    assert resolve_model("auto", torch.device("cpu"))[0] == "tiny-random"
    assert resolve_model("auto", torch.device("cuda"))[0] == "Qwen/Qwen-Image-2512"
    assert resolve_model("some/model", torch.device("cpu")) == ("some/model", "as asked")


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
    assert line["model"] == str(tmp_path / "model") and "note" not in line


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
    assert main([*common, "--max-memory", "24", "--out", str(tmp_path / "low")]) == 0
    for fast, low in zip(manifest(tmp_path / "fast"), manifest(tmp_path / "low")):
        assert "memory:low" in low["applied"] and "memory:low" not in fast["applied"]
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


# ---- resume


@needs_interpreter
def test_lora_is_fused_recorded_and_part_of_what_resume_compares(tmp_path, capsys):
    """--lora with the fast preset (fused into the BF16 weights, then quantized): the image is the stock pipeline's
    with the same LoRA within FP8 error, and far from the LoRA-free one; path, scale and sha256 are recorded; resume
    skips the same LoRA content (even moved) and refuses another strength or no LoRA in the same folder."""
    lora = tiny_lora(tmp_path / "style.safetensors")
    common = [*TINY, "a cat"]
    fast, stock, plain = tmp_path / "fast", tmp_path / "stock", tmp_path / "plain"
    assert main(["render", *common, "--lora", f"{lora}:0.8", "--out", str(fast)]) == 0
    assert main(["render", *common, "--preset", "baseline", "--lora", f"{lora}:0.8", "--out", str(stock)]) == 0
    assert main(["render", *common, "--out", str(plain)]) == 0
    line = manifest(fast)[0]
    digest = __import__("hashlib").sha256(lora.read_bytes()).hexdigest()
    assert line["loras"] == [{"path": f"{lora}", "scale": 0.8, "sha256": digest}]
    assert read_settings(fast / line["file"])["loras"] == line["loras"]
    image, same, without = (pixels(folder / line["file"]) for folder in (fast, stock, plain))
    off, lora_effect = np.abs(image - same).mean(), np.abs(image - without).mean()
    assert off < lora_effect / 4, (off, lora_effect)
    capsys.readouterr()

    moved = tmp_path / "moved.safetensors"
    moved.write_bytes(lora.read_bytes())
    assert main(["render", *common, "--lora", f"{moved}:0.8", "--out", str(fast)]) == 0
    assert "0 written, 1 skipped" in capsys.readouterr().out
    for other in (["--lora", f"{lora}:0.5"], []):
        with pytest.raises(SystemExit) as exit_info:
            main(["render", *common, *other, "--out", str(fast)])
        assert exit_info.value.code == 2
        assert "made with other settings (loras" in capsys.readouterr().err


def test_lightning_flag_sets_the_few_step_sampler(tmp_path, capsys):
    """--lightning: recorded as scheduler "lightning", no CFG by default, and the stock pipeline with
    lightning_scheduler() gives the same image."""
    import torch

    from qwen_image_fast import lightning_scheduler
    from qwen_image_fast.pipelines.tiny import tiny_pipeline

    assert main(["render", *BASELINE, "--lightning", "--out", str(tmp_path), "a cat"]) == 0
    line = manifest(tmp_path)[0]
    assert (line["scheduler"], line["cfg"], line["negative_prompt"], line["steps"]) == ("lightning", 1.0, None, 2)
    pipe = tiny_pipeline()
    pipe.scheduler = lightning_scheduler()
    ref = pipe("a cat", true_cfg_scale=1.0, width=32, height=32, num_inference_steps=2,
               generator=torch.Generator("cpu").manual_seed(0)).images[0]
    assert np.array_equal(pixels(tmp_path / line["file"]), np.asarray(ref).astype(np.int16))


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

    before = {path.name: path.stat().st_mtime_ns for path in tmp_path.iterdir()}
    with pytest.raises(SystemExit) as exit_info:  # other settings would overwrite the images: refused
        main([*args, "--cfg", "3"])
    assert exit_info.value.code == 2
    assert "00000-0.png exists, made with other settings (cfg 4.0, now 3.0); rendering would overwrite it: use " \
           "another --out, or --no-resume" in capsys.readouterr().err
    assert {path.name: path.stat().st_mtime_ns for path in tmp_path.iterdir()} == before
    assert main([*args, "--cfg", "3", "--no-resume"]) == 0  # on purpose
    assert "3 written, 0 skipped" in capsys.readouterr().out
    assert [line["cfg"] for line in manifest(tmp_path)] == [3.0, 3.0, 3.0]


def test_a_file_not_made_by_this_tool_is_never_overwritten(tmp_path, capsys):
    Image.new("RGB", (8, 8)).save(tmp_path / "00000-0.png")
    with pytest.raises(SystemExit) as exit_info:
        main(["render", *BASELINE, "--out", str(tmp_path), "a cat"])
    assert exit_info.value.code == 2
    assert "00000-0.png exists and was not made by this tool" in capsys.readouterr().err
    assert Image.open(tmp_path / "00000-0.png").size == (8, 8) and sorted(tmp_path.iterdir()) == [
        tmp_path / "00000-0.png"]


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


def test_ctrl_c_exits_130_with_one_line_and_keeps_finished_images(tmp_path):
    prompts = write_lines(tmp_path / "p.txt", [f"prompt number {i}" for i in range(6)])
    out_dir = tmp_path / "out"
    args = ["render", "--model", "tiny-random", "--device", "cpu", "--preset", "baseline", "--width", "64",
            "--height", "64", "--steps", "20", "--prompts", str(prompts), "--out", str(out_dir)]
    # SIGINT as a terminal sends it; a child of a non-interactive shell may inherit it ignored: restore the default.
    process = subprocess.Popen([sys.executable, "-m", "qwen_image_fast", *args], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    manifest_path = out_dir / "manifest.jsonl"
    deadline = time.monotonic() + 60
    while not (manifest_path.exists() and manifest_path.read_text().count("\n") >= 1) and time.monotonic() < deadline:
        assert process.poll() is None, f"the render exited (status {process.returncode}) before it was interrupted"
        time.sleep(0.01)
    process.send_signal(signal.SIGINT)
    err = process.communicate(timeout=60)[1]

    assert process.returncode == 130 and "Traceback" not in err
    last = err.splitlines()[-1]
    assert last.startswith("interrupted; ") and last.endswith(f"kept in {out_dir} (the same command resumes)")
    listed = [line["file"] for line in manifest(out_dir)]
    assert f"; {len(listed)} image(s) finished by this run" in last and 1 <= len(listed) < 6
    on_disk = {path.name for path in images(out_dir)}
    assert set(listed) <= on_disk and len(on_disk - set(listed)) <= 1  # at most one between its save and its line
    for name in on_disk:
        Image.open(out_dir / name).load()
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


PARALLEL_BAD_SETUP = {
    "baseline": (2, ["--preset", "baseline", "--parallel", "cfg"], "--parallel runs in the fast pipeline"),
    "heads": (2, ["--parallel", "ulysses"], "ulysses degree 2 does not divide the transformer's 3 attention heads"),
    "world": (3, ["--parallel", "cfg"], "cfg degree 2 x ulysses degree 1 = 2 does not divide the world size 3"),
    "no-cfg": (2, ["--parallel", "cfg", "--cfg", "1"], "prompt 1 (00000-0) has cfg 1 and no negative prompt: give every prompt cfg > 1"),
}


@pytest.mark.parametrize("world, extra, message", PARALLEL_BAD_SETUP.values(), ids=PARALLEL_BAD_SETUP.keys())
def test_bad_parallel_setup_exits_2_before_loading(world, extra, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(SystemExit) as exit_info:
        main(["render", *TINY, "--preset", "fast", *extra, "--out", str(tmp_path / "out"), "a cat"])
    assert exit_info.value.code == 2
    usage, error = capsys.readouterr().err.splitlines()
    assert message in error
    assert not (tmp_path / "out").exists()


@needs_interpreter
def test_parallel_cfg_with_two_image_groups_writes_once_per_image_and_resumes(tmp_path, capsys):
    """4 processes, --parallel cfg: two image groups of two; each group's leader writes its prompts (manifest
    shards numbered by group), the images equal one process's, which then finds everything done."""
    prompts = write_lines(tmp_path / "p.txt", ["a cat", "a dog", "a cow"])
    out_dir = tmp_path / "out"

    def torchrun(nproc: int) -> str:
        args = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m",
                "qwen_image_fast", "render", *TINY, "--preset", "fast", "--parallel", "cfg", "--prompts",
                str(prompts), "--out", str(out_dir)]
        done = subprocess.run(args, capture_output=True, text=True, timeout=600, env={**os.environ,
                                                                                   "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        return done.stdout

    output = torchrun(4)
    assert "rank 0/2: 2 written" in output and "rank 1/2: 1 written" in output
    assert output.count("written") == 2  # the followers print no summary
    lines = manifest(out_dir)
    assert sorted(line["index"] for line in lines) == [0, 1, 2]
    assert all("parallel:cfg2" in line["applied"] and "batched_cfg" not in line["applied"] for line in lines)
    for group, indices in ((0, [0, 2]), (1, [1])):
        shard = [json.loads(line) for line in (out_dir / f"manifest.rank{group}.jsonl").read_text().splitlines()]
        assert sorted(line["index"] for line in shard) == indices
    one = ["render", *TINY, "--preset", "fast", "--prompts", str(prompts), "--out"]
    assert main([*one, str(tmp_path / "one")]) == 0
    for line in lines:
        assert np.abs(pixels(out_dir / line["file"]) - pixels(tmp_path / "one" / line["file"])).max() <= 1
    capsys.readouterr()
    assert main([*one, str(out_dir)]) == 0 and "0 written, 3 skipped" in capsys.readouterr().out


# ---- image-conditioned checkpoints: --image, --mask, --strength

@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Tiny Edit-2511-style (EditPlus, zero_cond_t), inpainting and text-to-image folders, and input images."""
    import diffusers

    from qwen_image_fast.pipelines.tiny import tiny_pipeline

    root = tmp_path_factory.mktemp("checkpoints")
    tiny_pipeline(diffusers.QwenImageEditPlusPipeline, transformer_config=dict(zero_cond_t=True)).save_pretrained(
        root / "edit")
    tiny_pipeline(diffusers.QwenImageInpaintPipeline).save_pretrained(root / "inpaint")
    rng = np.random.default_rng(0)
    for name, shape in (("a.png", (32, 48, 3)), ("b.png", (40, 24, 3)), ("c.png", (32, 48, 3))):
        Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(root / name)
    Image.fromarray(((rng.random((32, 48)) > 0.5) * 255).astype(np.uint8)).save(root / "mask.png")
    Image.fromarray(np.zeros((16, 16), dtype=np.uint8)).save(root / "small_mask.png")
    (root / "not_an_image.png").write_text("hello")
    return root


EDIT_BAD_INPUT = {
    "image-missing": (lambda c: ["--model", c / "edit", "--image", c / "none.png"], "--image {c}/none.png: cannot read"),
    "image-unreadable": (lambda c: ["--model", c / "edit", "--image", c / "not_an_image.png"],
                         "--image {c}/not_an_image.png: not a readable image"),
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
@pytest.mark.usefixtures("small_condition_images")
def test_edit_renders_records_its_inputs_resumes_and_compares(checkpoints, tmp_path, capsys):
    """The class comes from model_index.json; both presets render the same edit; the inputs' paths and hashes are
    recorded; resume skips a finished image and refuses one whose input image changed; compare pairs them."""
    from qwen_image_fast.cli import main as cli

    edit = ["--model", str(checkpoints / "edit"), "--device", "cpu", "--steps", "2", "--image",
            str(checkpoints / "a.png"), "--image", str(checkpoints / "b.png"), "make it blue"]
    for preset in ("baseline", "fast"):
        assert cli(["render", *edit, "--preset", preset, "--out", str(tmp_path / preset)]) == 0
    assert "QwenImageEditPlusPipeline" in capsys.readouterr().out
    (line,) = manifest(tmp_path / "fast")
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

    calls = []

    def encode_prompt(prompts, device):
        calls.append(prompts)
        return f"embeds of {prompts}", None

    pipe = SimpleNamespace(_execution_device="cpu", encode_prompt=encode_prompt)

    def job(prompt, images=()):
        return SimpleNamespace(prompt=prompt, negative_prompt="bad", images=images)

    batches = [[job(f"p{i}"), job(f"q{i}")] for i in range(10)]  # 20 images
    batches[1] = [job("edit this", images=("in.png",))]  # an edit batch: its own call encodes it
    encoded, until = encode_ahead(pipe, batches, 0)
    assert ENCODE_AHEAD_IMAGES == 16 and until == 9  # 2 + 1 + 2 x 7 = 17 images: the window is full
    assert sorted(encoded) == [0, 2, 3, 4, 5, 6, 7, 8]
    assert encoded[0] == dict(prompt_embeds="embeds of ['p0', 'q0']", prompt_embeds_mask=None,
                              negative_prompt_embeds="embeds of ['bad', 'bad']", negative_prompt_embeds_mask=None)
    assert len(calls) == 16
    encoded, until = encode_ahead(pipe, batches, until)
    assert sorted(encoded) == [9] and until == 10


# ---- the registry's options: one per optimization, recorded with the images; --dry-run


def test_every_registered_optimization_has_its_option():
    from qwen_image_fast.cli.parser import OWN_OPTIONS, build_parser
    from qwen_image_fast.cli.plan import option_of
    from qwen_image_fast.pipelines.qwen_image.optimizations import REGISTRY

    render_help = build_parser()._subparsers._group_actions[0].choices["render"].format_help()
    for opt in REGISTRY:
        assert option_of(opt) in render_help, opt.name
        if opt.field not in OWN_OPTIONS and getattr(FastConfig(), opt.field) is True:
            assert option_of(opt) == f"--no-{opt.field.replace('_', '-')}"


@needs_interpreter
def test_dry_run_says_what_would_run_and_writes_nothing(tmp_path, capsys):
    from qwen_image_fast.pipelines.qwen_image.optimizations import REGISTRY

    out = tmp_path / "out"
    assert main(["render", *TINY, "--out", str(out), "--no-cuda-graphs", "--cfg-fraction", "0.5", "--dry-run",
                 "a cat", "a dog"]) == 0
    text = capsys.readouterr().out
    rows = {line.split()[0]: line for line in text.splitlines()[2:]}
    assert sorted(rows) == sorted(opt.name for opt in REGISTRY)
    assert " off " in rows["cuda_graphs"] and "cfg_fraction:0.5" in rows["cfg_fraction"]
    assert "lossy" in rows["fp8"] and "rel-RMS vs stock <= 0.02" in rows["fp8"]
    assert not out.exists()
    assert main(["render", *BASELINE, "--out", str(out), "--dry-run", "a cat"]) == 0
    assert "diffusers' own pipeline runs, untouched" in capsys.readouterr().out and not out.exists()


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
