"""`qwen-image-fast render` with bad input: exit status 2, usage and one line naming the problem, before any
model is loaded, no folder left; what --help imports; the fast preset without the interpreter."""

import subprocess
import sys

import pytest
from PIL import Image

from qwen_image_fast.command import main
from qwen_image_fast.cli.models import (DEFAULT_ENHANCER_ID, TINY_ENHANCER_ID, TINY_MODEL_ID, resolve_model)

from cli_helpers import BASELINE, TINY, write_lines
from helpers import tiny_lora


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


def qwen21_model(tmp_path, *args):
    """A Qwen-Image-2.1 checkpoint's model_index.json and its transformer's and VAE's configs (what render reads
    before loading), then `args`."""
    import json

    for part, config in (("transformer", {"_class_name": "QwenImage21Transformer2DModel", "num_layers": 2,
                                          "attention_head_dim": 16, "num_attention_heads": 2, "in_channels": 16,
                                          "out_channels": 16, "context_in_dim": 24}),
                         ("vae", {"_class_name": "AutoencoderKLQwenImage21", "base_dim": 8, "z_dim": 16})):
        (tmp_path / "model" / part).mkdir(parents=True)
        (tmp_path / "model" / part / "config.json").write_text(json.dumps(config))
    (tmp_path / "model" / "model_index.json").write_text(json.dumps(
        {"_class_name": "QwenImage21Pipeline", "transformer": ["diffusers", "QwenImage21Transformer2DModel"]}))
    return ["--model", str(tmp_path / "model"), *args, "a cat"]


def qwen21_long_prompt(tmp_path):
    """A 2.1 checkpoint's configs and its processor (the tiny one's), --max-memory 16 and a prompt past the budget's
    planned prefix (qwen_image21/memory.PLANNED_TEXT_TOKENS)."""
    from diffusers import QwenImage21Pipeline

    from qwen_image_fast.pipelines.tiny import tiny_qwen21_components

    args = qwen21_model(tmp_path, "--preset", "fast", "--max-memory", "16")
    QwenImage21Pipeline(**tiny_qwen21_components()).processor.save_pretrained(tmp_path / "model" / "processor")
    return args[:-1] + ["a cat " * 600]


def unloadable_model(tmp_path):
    """Passes the checks (a folder with model_index.json), fails in diffusers' loader: after the out folder exists."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "model_index.json").write_text("{}")
    return ["--model", str(tmp_path / "model"), "--out", str(tmp_path / "out" / "a" / "b"), "a cat"]


def missing_gpu(tmp_path):
    import torch

    return ["--device", "cuda:99" if torch.cuda.is_available() else "cuda", "a cat"]



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
    "jsonl-width-alone": (jsonl('{"prompt": "a cat", "width": 64}'),
                          'line 1: "width" without "height": give both, or neither'),
    "jsonl-hidden-id": (jsonl('{"prompt": "a cat", "id": ".tmp-00000"}'), "and not start with \".\""),
    "jsonl-negative-without-cfg": (jsonl('{"prompt": "a cat", "cfg": 1, "negative_prompt": "blurry"}'),
                                   "line 1: a negative_prompt with cfg 1, which runs no classifier-free guidance"),
    "negative-without-cfg": (lambda tmp: ["--cfg", "1", "--negative-prompt", "blurry", "a cat"],
                             "--negative-prompt given, but every prompt runs with cfg <= 1 (1)"),
    "json-in-a-text-file": (lambda tmp: ["--prompts", str(write_lines(tmp / "p.JSONL.txt", ['{"prompt": "a"}']))],
                            "line 1: a JSON object in a text prompt file"),
    "prompts-csv": (lambda tmp: ["--prompts", str(write_lines(tmp / "p.csv", ["prompt,seed", "a cat,1"]))],
                    "p.csv: a .csv file, which render does not read; allowed: .txt"),
    "jsonl-lone-surrogate": (jsonl('{"prompt": "a cat"}', '{"prompt": "a \\ud800 fox"}'),
                             'line 2: "prompt" holds a lone surrogate (U+D800 at character 2)'),
    "jsonl-negative-lone-surrogate": (jsonl('{"prompt": "a fox", "negative_prompt": "\\udfff", "cfg": 4}'),
                                      'line 1: "negative_prompt" holds a lone surrogate (U+DFFF at character 0)'),
    "argument-lone-surrogate": (lambda tmp: ["a cat", "a \udc80 fox"],
                                "prompt 2 holds a lone surrogate (U+DC80 at character 2)"),
    "fp8-attention-off-gpu": (lambda tmp: ["--preset", "fast", "--fp8-attention", "cudnn", "a cat"],
                              "--fp8-attention cudnn runs on a CUDA GPU, and this run's device is cpu: use "
                              "--fp8-attention off or auto there"),
    "attention-fa4-off-gpu": (lambda tmp: ["--preset", "fast", "--attention", "fa4", "a cat"],
                              "--attention fa4 runs on a CUDA GPU, and this run's device is cpu"),
    "compare-uncached-inside-out": (lambda tmp: ["--preset", "fast", "--cache", "every:2,1,0", "--out",
                                                 str(tmp / "new" / "o"), "--compare-uncached",
                                                 str(tmp / "new" / "o" / "uncached"), "a cat"],
                                    "one folder is inside the other"),
    "out-inside-compare-uncached": (lambda tmp: ["--preset", "fast", "--cache", "every:2,1,0", "--out",
                                                 str(tmp / "new" / "u" / "o"), "--compare-uncached",
                                                 str(tmp / "new" / "u"), "a cat"],
                                    "one folder is inside the other"),
    "unwritable-out": (unwritable_out, "not a writable folder"),
    "unwritable-compare-uncached": (lambda tmp: ["--preset", "fast", "--cache", "every:2,1,0", "--out",
                                                 str(tmp / "new" / "o"), "--compare-uncached",
                                                 str(unwritable_out(tmp)[1]), "a cat"],
                                    "--compare-uncached {tmp}/a_file/images: not a writable folder"),
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
    "qwen21-lightning": (lambda tmp: qwen21_model(tmp, "--lightning"),
                         "--lightning samples for Qwen-Image-2512's Lightning LoRAs"),
    "qwen21-max-memory-12": (lambda tmp: qwen21_model(tmp, "--preset", "fast", "--max-memory", "12"),
                             "--max-memory 12: the pipeline needs at least 14 GiB (with memory='low': 19.9 GiB "
                             "reserved at 1024x1024, measured; below 21 its blocks and text encoder layers stream "
                             "from the host)"),
    "qwen21-max-memory-16-image": (lambda tmp: qwen21_model(tmp, "--preset", "fast", "--max-memory", "16",
                                                            "--image", str(tmp / "a.png")),
                                   "FastConfig(max_memory_gib=16) is planned for text-to-image calls; this call has 1 "
                                   "condition image(s)"),
    "qwen21-max-memory-16-long-prompt": (qwen21_long_prompt, "prompt 1: its prompt has 3619 tokens; --max-memory 16 "
                                                             "is planned for prompts of at most 1024: shorten it"),
    "qwen21-max-memory-batch": (lambda tmp: qwen21_model(tmp, "--preset", "fast", "--max-memory", "24",
                                                         "--batch-size", "2"),
                                "--batch-size 2 with --max-memory 24: Qwen-Image-2.1's memory='low' runs one image "
                                "a call"),
    "qwen21-cache-too-deep": (lambda tmp: qwen21_model(tmp, "--preset", "fast", "--cache", "every:2,1,1"),
                              "--cache dbcache:F1B1:every2:w0: Fn=1 + Bn=1 leaves no middle block to cache in "
                              "{model}'s transformer of 2 blocks"),
    "qwen21-scheduler": (lambda tmp: qwen21_model(tmp, "--preset", "fast", "--scheduler", "unipc",
                                                  "--cfg-fraction", "0.5"),
                         "--scheduler unipc, --cfg-fraction 0.5: for text-to-image checkpoints only; {model} is a "
                         "QwenImage21Pipeline checkpoint, which runs diffusers' own sampling loop: leave them out"),
    "qwen21-jpg": (lambda tmp: qwen21_model(tmp, "--format", "jpg"),
                   "renders RGBA images, and JPEG has no alpha channel: use --format png or webp"),
    "qwen21-size": (lambda tmp: qwen21_model(tmp, "--width", "48", "--height", "64"),
                    "prompt 1: 48x64: {model} renders sizes in multiples of 32 pixels (its pipeline would render "
                    "32x64); give multiples of 32"),
    "qwen21-mask": (lambda tmp: qwen21_model(tmp, "--image", str(tmp / "a.png"), "--mask", str(tmp / "a.png")),
                    "--mask given, but QwenImage21Pipeline"),
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
    "cache-not-a-number": (lambda tmp: ["--preset", "fast", "--cache", "dbcache:x", "a cat"],
                           "argument --cache: cache 'dbcache:x': 'x' is not an integer"),
    "cache-unknown-rule": (lambda tmp: ["--preset", "fast", "--cache", "fbcache:0.2", "a cat"],
                           "argument --cache: cache 'fbcache:0.2': allowed: dbcache[:Fn,Bn,threshold] or every:k"),
    # cache-dit's default Fn=8 on tiny-random's 2 blocks (the README's --cache lines): refused before loading
    "cache-deeper-than-the-model": (lambda tmp: ["--preset", "fast", "--cache", "dbcache", "a cat"],
                                    "--cache dbcache:F8B0:0.08: Fn=8 + Bn=0 leaves no middle block to cache in "
                                    "tiny-random's transformer of 2 blocks; allowed: Fn >= 1 and Fn + Bn < 2"),
    "cache-deeper-than-the-model-dry-run": (lambda tmp: ["--preset", "fast", "--cache", "every:2,1,1", "--dry-run",
                                                         "a cat"], "Fn=1 + Bn=1 leaves no middle block"),
    "parallel-not-a-mode": (lambda tmp: ["--parallel", "tensor", "a cat"], "argument --parallel: invalid choice"),
    "max-memory-too-small": (lambda tmp: ["--preset", "fast", "--max-memory", "8", "a cat"],
                             "--max-memory 8: the pipeline needs at least 10 GiB"),
    "max-memory-streaming-batch": (lambda tmp: ["--preset", "fast", "--max-memory", "16", "--batch-size", "2",
                                                "a cat"],
                                   "--batch-size 2 with --max-memory 16: below 22 GiB memory='low' is planned for "
                                   "one image a call"),
    "max-memory-streaming-steps": (lambda tmp: ["--preset", "fast", "--max-memory", "16", "--steps", "60",
                                                "a cat"],
                                   "FastConfig(max_memory_gib=16) is planned for one image a call of at most "
                                   "1328x1328 pixels and 50 steps; this call has 1 image(s) of"),
    "max-memory-not-a-number": (lambda tmp: ["--max-memory", "lots", "a cat"], "must be a number, got 'lots'"),
    "max-memory-negative": (lambda tmp: ["--max-memory", "-4", "a cat"], "must be a finite number > 0, got '-4'"),
    "max-memory-inf": (lambda tmp: ["--max-memory", "inf", "a cat"], "must be a finite number > 0, got 'inf'"),
    "out-empty": (lambda tmp: ["--out", "", "a cat"], "argument --out: must name a folder, got '' (for the current"),
    "size-beyond-the-rotary-table": (lambda tmp: ["--width", "100000", "--height", "64", "a cat"],
                                     "prompt 1: 100000x64: tiny-random's rotary position table reaches 49152 pixels"),
    "size-beyond-memory": (lambda tmp: ["--width", "40000", "--height", "40000", "--max-memory", "100", "a cat"],
                           "prompt 1: 40000x40000: needs at least 286.1 GiB (tiny-random's VAE decode and "
                           "transformer at this size), cpu has 100.0 GiB"),
    "sigmas-above-one": (lambda tmp: ["--sigmas", "1.0,1.2", "a cat"],
                         "argument --sigmas: each value must be in (0, 1], got '1.0,1.2'"),
    "sigmas-rising": (lambda tmp: ["--sigmas", "1.0,0.5,0.7", "a cat"],
                      "argument --sigmas: must decrease from each value to the next, got '1.0,0.5,0.7'"),
    "sigmas-one-value": (lambda tmp: ["--sigmas", "0.9", "a cat"], "argument --sigmas: needs at least 2"),
    "sigmas-and-other-steps": (lambda tmp: ["--sigmas", "1,0.5", "--steps", "3", "a cat"],
                               "--steps 3 with --sigmas of 2 values (one per step): give one or the other"),
    "sigmas-with-dpm": (lambda tmp: ["--preset", "fast", "--scheduler", "dpm++2m", "--sigmas", "1,0.5", "a cat"],
                        "--sigmas with --scheduler dpm++2m: DPMSolverMultistepScheduler takes no sigmas"),
    "sigmas-and-a-row-s-steps": (lambda tmp: ["--sigmas", "1,0.5", *jsonl('{"prompt": "a cat", "steps": 4}')(tmp)],
                                 'line 1: "steps" 4, but --sigmas gives 2 (one per step)'),
    "max-memory-stock": (lambda tmp: ["--max-memory", "24", "a cat"],
                         "needs memory='low', which runs in the fast text-to-image and Qwen-Image-2.1 pipelines alone; "
                         "--preset baseline"),
}


@pytest.mark.parametrize("make_args, message", BAD_INPUT.values(), ids=BAD_INPUT.keys())
def test_bad_input_exits_2_with_one_line_and_leaves_no_folder(make_args, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    args = ["render", *BASELINE, "--out", str(tmp_path / "out"), *make_args(tmp_path)]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    usage, error = err.splitlines()  # argparse's one usage line, then one line saying what is wrong
    assert usage.startswith("usage: qwen-image-fast render") and error.startswith("qwen-image-fast render: error: ")
    assert message.format(model=tmp_path / "model", tmp=tmp_path) in error
    assert not (tmp_path / "out").exists() and not (tmp_path / "new").exists()


def test_help_imports_neither_torch_nor_diffusers_nor_the_model_code():
    """`--help` answers at once: torch, diffusers, triton, transformers and the Qwen3.5 code stay unimported."""
    code = ("import sys\nfrom qwen_image_fast.command import main\n"
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

    assert (TINY_MODEL_ID, TINY_ENHANCER_ID) == (tiny.TINY_MODEL_ID, enhance.TINY_ENHANCER_ID)
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
