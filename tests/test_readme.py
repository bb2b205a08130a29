"""The README's command lines: every `qwen-image-fast ...` line of its code blocks runs here, in this process, on the
tiny CPU model (`--model tiny-random` added where the line names no model: the default, Qwen-Image-2512, is not in
CI's cache), at that model's test size and steps, in a fresh folder; or exits 2 with the message NEEDS_MORE gives
(a rule the tiny model cannot take); or is listed in NEEDS with what it needs that CI does not have. A README line
that stops working turns this red, and so does an entry of NEEDS or NEEDS_MORE that is no longer in the README.
The README's Python blocks likewise: each runs as written on tiny checkpoints written under the hub ids it names,
on the CPU, at the test's size and steps (PY_RUNS), or is listed in PY_NEEDS with what it needs."""

import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from qwen_image_fast.command import main

README = Path(__file__).parents[1] / "README.md"

# what a line needs that CI has not: real weights, a GPU, several processes, files of the user's
NEEDS = {
    'qwen-image-fast render --model Qwen/Qwen-Image-Edit-2511 --image in.png "Make the sky stormy" --steps 40':
        "Qwen-Image-Edit-2511's weights",
    'qwen-image-fast render --model Qwen/Qwen-Image-2.1 "a red fox in the snow"': "Qwen-Image-2.1's weights",
    'qwen-image-fast render --model Qwen/Qwen-Image-2.1 --image fox.png "the same fox at night"':
        "Qwen-Image-2.1's weights",
    'qwen-image-fast render "A red fox in fresh snow" --lightning --lora '
    'lightx2v/Qwen-Image-Lightning/Qwen-Image-Lightning-8steps-V1.0.safetensors': "the Lightning LoRA from the hub",
    'qwen-image-fast render "A red fox in fresh snow" "A lighthouse in a storm" --enhance': "Qwen3.5-4B's weights",
    'qwen-image-fast render --prompts prompts.jsonl --enhance=/models/Qwen3.5-9B --batch-size 4':
        "Qwen3.5-9B's weights in /models",
    'qwen-image-fast serve --model Qwen/Qwen-Image-2512 [--port 8000] [--lora NAME=PATH ...] [--lora-dir DIR] \\':
        "a usage line (tests/server runs the server)",
    'qwen-image-fast compare out/baseline out/fast --out out/report --min-psnr 30':
        "two folders of renders (tests/test_compare.py)",
    'qwen-image-fast render --model qwen_image_2512_fp8_e4m3fn_scaled.safetensors --text-encoder '
    'qwen_2.5_vl_7b_fp8_scaled.safetensors --vae qwen_image_vae.safetensors --dry-run "a fox"':
        "ComfyUI's files and Qwen-Image-2512's configs (tests/pipelines/test_single_file.py runs render on tiny ones)",
    "qwen-image-fast render --engine ray --ray-address auto --prompts prompts.parquet --out /shared/out":
        "a Ray cluster begun with `ray start` and a shared folder (tests/cli/test_render_ray.py runs it on a local "
        "cluster)",
}
# lines the tiny model (2 blocks) refuses, as the README says next to them: cache-dit's Fn=8 needs a deeper model
NEEDS_MORE = {
    'qwen-image-fast render "a fox" --cache dbcache': "Fn=8 + Bn=0 leaves no middle block",
    'qwen-image-fast render "a fox" --cache every:2,8,0 --out out/cached --compare-uncached out/uncached':
        "Fn=8 + Bn=0 leaves no middle block",
}


def readme_lines() -> list[str]:
    """The `qwen-image-fast` lines of the README's code blocks, their trailing comments cut."""
    lines, in_block = [], False
    for raw in README.read_text().splitlines():
        if raw.startswith("```"):
            in_block = not in_block
        elif in_block and raw.startswith("qwen-image-fast "):
            lines.append(re.sub(r"\s+# .*$", "", raw).rstrip())
    return lines


def test_every_listed_line_is_in_the_readme():
    lines = readme_lines()
    assert len(lines) >= 10, lines
    assert [line for line in [*NEEDS, *NEEDS_MORE] if line not in lines] == []


@pytest.mark.parametrize("line", [line for line in readme_lines() if line not in NEEDS])
def test_readme_line_runs_on_the_tiny_model(line, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "a cat"}\n{"prompt": "a dog on a rug", "seed": 3}\n')
    argv = shlex.split(line)[1:]
    if "--model" not in argv:
        argv += ["--model", "tiny-random"]
    if line in NEEDS_MORE:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2 and NEEDS_MORE[line] in capsys.readouterr().err
        return
    assert main(argv) == 0, capsys.readouterr()
    out = Path(argv[argv.index("--out") + 1]) if "--out" in argv else Path("out")
    assert list(out.glob("*.png")) or list(out.glob("*.webp")), f"{line}: no image in {out}"


# ---- the README's Python blocks

# hub ids and devices as CI has them: each hub id -> the tiny checkpoint the fixture writes under that name
CHECKPOINTS = {"Qwen/Qwen-Image-2512": "QwenImagePipeline", "Qwen/Qwen-Image-Edit-2511": "QwenImageEditPlusPipeline",
               "Qwen/Qwen-Image-2.1": "QwenImage21Pipeline"}
# a block (by its first line) -> what it needs that CI has not
PY_NEEDS = {
    "from qwen_image_fast import FastQwenImageTransformer, from_single_files": "ComfyUI's and a GGUF file "
    "(tests/pipelines/test_single_file.py loads tiny ones of each format)",
    "from qwen_image_fast import QwenImageFastPipeline, lightning_scheduler": "the Lightning LoRA from the hub",
    'pipe = QwenImageFastPipeline.from_pretrained("Qwen/Qwen-Image-Edit-2511", fast_config=FastConfig('
    'fp8_attention="auto"), ...)': "a fragment ('...': the arguments of the blocks above)",
    "from qwen_image_fast import PromptEnhancer, QwenImageFastPipeline": "Qwen3.5-4B's weights",
    "from qwen_image_fast.pipelines.qwen35 import FastQwen35ForCausalLM, generate":
        "Qwen3.5-4B's weights and token ids (tests/pipelines/test_qwen35_generate.py runs generate)",
    "from openai import OpenAI": "a running server (tests/server runs the openai client against one)",
    'pipe = QwenImageFastPipeline.from_pretrained("Qwen/Qwen-Image-2512", fast_config=FastConfig(memory="low"), '
    'dtype=torch.bfloat16, device="cuda")': "a CUDA GPU (the low-memory mode moves weights between host and GPU)",
    'pipe = QwenImageFastPipeline.from_pretrained("Qwen/Qwen-Image-2512", fast_config=FastConfig(memory="low", '
    'max_memory_gib=16), dtype=torch.bfloat16, device="cuda")': "a CUDA GPU (its cap; tests/pipelines/"
    "test_streaming.py streams on the CPU)",
    "from diffusers import QwenImageTransformer2DModel": "a fragment ('...': the transformer's inputs)",
    "from diffusers import QwenImage21Pipeline": "torchvision, which diffusers' loading of Qwen-Image-2.1's Qwen3-VL "
    "processor imports (qwen_image_fast.from_pretrained loads 2.1 without it: tests/pipelines/test_qwen21.py)",
}
# a block that runs -> (text to run before it, {README text: what CI runs instead}): the test's size and steps, and
# for the step-cache block a pipeline deep enough for cache-dit's Fn=8 (the tiny one has 2 blocks)
PY_RUNS = {
    "from qwen_image_fast import QwenImageFastPipeline  # same __call__": (
        "", {"width=1328, height=1328": "width=64, height=64, num_inference_steps=2"}),
    "from PIL import Image": ("", {"num_inference_steps=40": "num_inference_steps=2"}),
    "# diffusers' own API, as on the stock transformer": (
        "from qwen_image_fast import optimize\nfrom qwen_image_fast.pipelines.tiny import tiny_pipeline\n"
        "pipe = optimize(tiny_pipeline(transformer_config={'num_layers': 10}))\n", {}),
}


def readme_python_blocks() -> list[str]:
    blocks, block = [], None
    for raw in README.read_text().splitlines():
        if block is None and raw == "```python":
            block = []
        elif block is not None and raw.startswith("```"):
            blocks.append("\n".join(block))
            block = None
        elif block is not None:
            block.append(raw)
    return blocks


def block_key(block: str) -> str:
    """A block's key in PY_NEEDS or PY_RUNS: the one its first line after `import torch` starts with (else that
    line)."""
    first = next(line for line in block.splitlines() if line != "import torch")
    return next((key for key in [*PY_NEEDS, *PY_RUNS] if first.startswith(key)), first)


@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory) -> dict:
    """The tiny checkpoint of each hub id the README names, written once: hub id -> folder."""
    import diffusers

    from qwen_image_fast.pipelines.tiny import tiny_pipeline, tiny_qwen21_components

    root, folders = tmp_path_factory.mktemp("checkpoints"), {}
    for hub_id, class_name in CHECKPOINTS.items():
        cls = getattr(diffusers, class_name)
        stock = cls(**tiny_qwen21_components()) if class_name == "QwenImage21Pipeline" else tiny_pipeline(cls)
        folders[hub_id] = root / hub_id.replace("/", "--")
        stock.save_pretrained(folders[hub_id])
    return folders


def test_every_python_block_is_listed():
    keys = [block_key(block) for block in readme_python_blocks()]
    assert len(keys) >= 8, keys
    assert sorted(key for key in keys if key not in PY_NEEDS and key not in PY_RUNS) == []
    assert sorted(key for key in [*PY_NEEDS, *PY_RUNS] if key not in keys) == []


# What the script CI runs around a block checks afterwards: the image it made, or the rules the step-cache block set.
BLOCK_CHECK = """
from PIL import Image as _Image
if "image" in dir():
    assert isinstance(image, _Image.Image) and image.size[0] >= 16, image
else:
    assert pipe.fast_config.cache is not None and pipe.transformer.is_cache_enabled
print("block ran")
"""


@pytest.mark.parametrize("key", list(PY_RUNS))
def test_readme_python_block_runs_on_the_tiny_models(key, tiny_checkpoints, tmp_path):
    """The block as written, but for the hub ids (-> the tiny checkpoints), "cuda" (-> "cpu") and PY_RUNS' text (each
    must still be in the block: a README edit that moves it turns this red), as a script of its own in a fresh
    Python process (as a user runs it; in the test process, state other tests left made the edit block fail only in
    full runs), in a fresh folder with an in.png, the edit pipeline's input images at 1/256 of their area."""
    from PIL import Image

    block = next(block for block in readme_python_blocks() if block_key(block) == key)
    setup, changes = PY_RUNS[key]
    for old, new in changes.items():
        assert old in block, f"{old!r} is no longer in the README block {key!r}: update PY_RUNS"
        block = block.replace(old, new)
    for hub_id, folder in tiny_checkpoints.items():
        block = block.replace(f'"{hub_id}"', repr(str(folder)))
    block = block.replace('"cuda"', '"cpu"')
    Image.new("RGB", (64, 64), (200, 120, 40)).save(tmp_path / "in.png")
    script = ("from qwen_image_fast.pipelines.tiny import small_condition_images\n\n"
              "with small_condition_images():\n" + textwrap.indent(setup + block, "    ") + "\n" + BLOCK_CHECK)
    (tmp_path / "block.py").write_text(script)
    env = {**os.environ, "TRITON_INTERPRET": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "block.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and "block ran" in done.stdout, (key, done.stdout[-2000:], done.stderr[-3000:])
