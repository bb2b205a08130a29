"""The README's command lines: every `qwen-image-fast ...` line of its code blocks runs here, in this process, on the
tiny CPU model (`--model tiny-random` added where the line names no model: the default, Qwen-Image-2512, is not in
CI's cache), at that model's test size and steps, in a fresh folder; or exits 2 with the message NEEDS_MORE gives
(a rule the tiny model cannot take); or is listed in NEEDS with what it needs that CI does not have. A README line
that stops working turns this red, and so does an entry of NEEDS or NEEDS_MORE that is no longer in the README."""

import re
import shlex
from pathlib import Path

import pytest

from qwen_image_fast.cli import main

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
