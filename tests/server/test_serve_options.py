"""`qwen-image-fast serve` refuses bad options before anything loads: exit 2 and one line naming the option."""

import pytest
from helpers import tiny_lora

from qwen_image_fast.command import main


def refused(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exit:
        main(["serve", "--model", "tiny-random", "--device", "cpu", *argv])
    assert exit.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("qwen-image-fast serve: error: "), last
    return last


def test_bad_options_exit_2_with_one_line(capsys, tmp_path):
    lora = tiny_lora(tmp_path / "style.safetensors")
    (tmp_path / "notes.txt").write_text("not a LoRA")
    cases = [
        (["--lora", "style"], "must be NAME=PATH"),
        (["--lora", "a b=x.safetensors"], "letters, digits"),
        (["--lora", f"style={tmp_path / 'missing.safetensors'}"], "missing.safetensors"),
        (["--lora", f"style={lora}", "--lora", f"style={lora}"], "given twice"),
        (["--lora-dir", str(tmp_path / "nowhere")], "not a folder"),
        (["--port", "70000"], "1..65535"),
        (["--max-batch", "0"], ">= 1"),
        (["--max-queue", "0"], ">= 1"),
        (["--max-wait-ms", "-1"], ">= 0"),
        (["--max-side", "1000"], "multiple of 16"),
        (["--request-timeout", "0"], "> 0"),
        (["--attention", "fa4"], "fa4"),
        (["--model", str(tmp_path / "nowhere")], "nowhere"),
        (["--max-memory", "8"], "--max-memory 8: the pipeline needs at least 10 GiB"),  # as render's rules
        (["--max-memory", "16", "--max-batch", "4"], "--max-batch 4 with --max-memory 16: below 22 GiB"),
    ]
    for argv, says in cases:
        line = refused(capsys, *argv)
        assert says in line, (argv, line)
