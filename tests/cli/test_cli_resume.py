"""`qwen-image-fast render` resumes: what is missing is rendered, what is there is compared and kept; LoRAs and
Lightning recorded; kill -9 and Ctrl-C lose no finished image."""

import json
import signal
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from qwen_image_fast.command import main
from qwen_image_fast.cli.output import read_settings

from helpers import tiny_lora
from cli_helpers import (BASELINE, TINY, images, manifest, needs_interpreter, pixels, wait_for_manifest_lines,
                         write_lines)


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


def test_sigmas_sample_on_the_given_schedule_recorded_and_compared_on_resume(tmp_path, capsys):
    """--sigmas: the stock pipeline called with the same sigmas= gives the same image; steps are their count; the
    schedule is recorded (manifest and file) and resume compares it: the same schedule skips, another or none is
    refused. Three sigmas: Qwen-Image's scheduler stretches a schedule to end at its shift_terminal, so of two only
    the first would count."""
    import torch

    from qwen_image_fast.pipelines.tiny import tiny_pipeline

    sigmas = [1.0, 0.8, 0.3]
    common = ["render", "--model", "tiny-random", "--device", "cpu", "--width", "32", "--height", "32", "--preset",
              "baseline", "--cfg", "1", "--out", str(tmp_path), "a cat"]
    assert main([*common, "--sigmas", "1.0,0.8,0.3"]) == 0
    line = manifest(tmp_path)[0]
    assert (line["sigmas"], line["steps"]) == (sigmas, 3) and read_settings(tmp_path / line["file"])["sigmas"] == sigmas

    def stock(**schedule):
        return np.asarray(tiny_pipeline()("a cat", true_cfg_scale=1.0, width=32, height=32, num_inference_steps=3,
                                          generator=torch.Generator("cpu").manual_seed(0), **schedule).images[0])

    assert np.array_equal(pixels(tmp_path / line["file"]), stock(sigmas=sigmas).astype(np.int16))
    assert not np.array_equal(stock(sigmas=sigmas), stock())  # the schedule is not the default one
    capsys.readouterr()
    assert main([*common, "--sigmas", "1.0,0.8,0.3"]) == 0
    assert "0 written, 1 skipped" in capsys.readouterr().out
    for other in (["--sigmas", "1.0,0.6,0.3"], ["--steps", "3"]):
        with pytest.raises(SystemExit) as exit_info:
            main([*common, *other])
        assert exit_info.value.code == 2 and "made with other settings (sigmas" in capsys.readouterr().err


def test_resume_renders_only_what_is_missing(tmp_path, capsys):
    args = ["render", *BASELINE, "--out", str(tmp_path), "a cat", "a dog", "a cow"]
    assert main(args) == 0
    kept = {name: (tmp_path / name).stat().st_mtime_ns for name in ("00000-0.png", "00002-2.png")}
    # As after a kill: one image gone, its manifest line gone, a half-written line (cut inside a character of the
    # default negative prompt's UTF-8) and a stale temporary file.
    (tmp_path / "00001-1.png").unlink()
    lines = (tmp_path / "manifest.jsonl").read_bytes().splitlines()
    cut = next(i for i, byte in enumerate(lines[1]) if byte >= 0x80) + 1  # one byte of a multi-byte character
    (tmp_path / "manifest.jsonl").write_bytes(lines[0] + b"\n" + lines[2] + b"\n" + lines[1][:cut])
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
    wait_for_manifest_lines(process, manifest_path, 2, "could be killed")
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


SIGNALS = {"ctrl-c": (signal.SIGINT, 130, "interrupted"), "sigterm": (signal.SIGTERM, 143, "terminated (SIGTERM)")}


def start_render(args, **popen):
    """The command line in a child process; SIGINT as a terminal sends it (a child of a non-interactive shell may
    inherit it ignored: restored to the default)."""
    return subprocess.Popen([sys.executable, "-m", "qwen_image_fast", *args], stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL), **popen)


@pytest.mark.parametrize("sent, status, said", SIGNALS.values(), ids=SIGNALS.keys())
def test_ctrl_c_and_sigterm_exit_with_one_line_and_keep_finished_images(tmp_path, sent, status, said):
    prompts = write_lines(tmp_path / "p.txt", [f"prompt number {i}" for i in range(6)])
    out_dir = tmp_path / "out"
    # 200 steps (~1 s an image): the last image is seconds away when the signal lands after the first (at 20, the
    # six took ~0.6 s, which a loaded machine's delay could cover)
    args = ["render", "--model", "tiny-random", "--device", "cpu", "--preset", "baseline", "--width", "64",
            "--height", "64", "--steps", "200", "--prompts", str(prompts), "--out", str(out_dir)]
    process = start_render(args, stdout=subprocess.DEVNULL)
    manifest_path = out_dir / "manifest.jsonl"
    wait_for_manifest_lines(process, manifest_path, 1, "was interrupted")
    process.send_signal(sent)
    err = process.communicate(timeout=60)[1]

    assert process.returncode == status and "Traceback" not in err, (process.returncode, err[-3000:])
    last = err.splitlines()[-1]
    assert last.startswith(f"{said}; ") and last.endswith(f"kept in {out_dir} (the same command resumes)")
    listed = [line["file"] for line in manifest(out_dir)]
    assert f"; {len(listed)} image(s) finished by this run" in last and 1 <= len(listed) < 6
    on_disk = {path.name for path in images(out_dir)}
    assert set(listed) <= on_disk and len(on_disk - set(listed)) <= 1  # at most one between its save and its line
    for name in on_disk:
        Image.open(out_dir / name).load()
    assert not list(out_dir.glob(".tmp-*"))


def test_ctrl_c_before_the_first_image_removes_the_new_folder_and_says_so(tmp_path):
    """Sent once the command has said what it renders (the model loading, or its first steps): the folder it
    created is removed, and the message does not say images are kept in it (SIGTERM takes the same path)."""
    sent, status, said = SIGNALS["ctrl-c"]
    out_dir = tmp_path / "new" / "out"
    # 5000 steps (~20 s): the image cannot be finished when the signal lands, however late it is delivered (with
    # 50, ~0.3 s, a loaded machine let the whole command finish first)
    args = ["render", "--model", "tiny-random", "--device", "cpu", "--preset", "baseline", "--width", "64",
            "--height", "64", "--steps", "5000", "--out", str(out_dir), "a cat"]
    process = start_render(args, stdout=subprocess.PIPE)
    assert "-> " in process.stdout.readline()  # the start line, printed before the model loads
    process.send_signal(sent)
    err = process.communicate(timeout=60)[1]
    assert process.returncode == status and "Traceback" not in err, (process.returncode, err[-3000:])
    assert err.splitlines()[-1] == f"{said}; nothing was written (the empty folder {out_dir} is removed)"
    assert not (tmp_path / "new").exists()


def test_a_ctrl_c_caught_inside_exec_of_a_string_ends_with_the_commands_status(tmp_path):
    """A Ctrl-C landing in code run by exec() of a string (dataclasses build their methods so: it happened while
    the command imported the pipeline) and answered by the command: `python -m` exits with the command's 130, not
    by killing itself with SIGINT (CPython marks such an interrupt unhandled; the entry point clears the mark)."""
    (tmp_path / "interrupted_in_exec.py").write_text(
        "import sys\n"
        "from qwen_image_fast import command\n"
        "def main():\n"
        "    try:\n"
        "        exec('raise KeyboardInterrupt')\n"
        "    except KeyboardInterrupt:\n"
        "        return 130\n"
        "command.main = main\n"
        "sys.exit(command.exit_main())\n")
    done = subprocess.run([sys.executable, "-m", "interrupted_in_exec"], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 130 and done.stderr == "", (done.returncode, done.stderr[-2000:])


def test_a_ctrl_c_after_the_summary_ends_with_a_status_and_at_most_one_line(tmp_path):
    """Ctrl-C once the command has printed its summary: the command's status (0: it landed in the interpreter's
    teardown, or after the exit) or 130 with one line (it landed as the command returned), never death by the
    signal (-2) or a traceback. A race by nature: three tries."""
    for attempt in range(3):
        process = start_render(["render", "--model", "tiny-random", "--device", "cpu", "--preset", "baseline",
                                "--width", "32", "--height", "32", "--steps", "2", "--out", str(tmp_path / str(attempt)),
                                "a cat"], stdout=subprocess.PIPE)
        while "written," not in process.stdout.readline():  # the summary line
            assert process.poll() is None, process.stderr.read()[-2000:]
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
        err = process.communicate(timeout=60)[1]
        assert process.returncode in (0, 130) and "Traceback" not in err, (attempt, process.returncode, err[-2000:])
        if process.returncode == 130:  # the command's own line, or the entry point's once the command returned
            assert err.splitlines()[-1] in ("qwen-image-fast render: interrupted", "qwen-image-fast: interrupted"), \
                err[-2000:]


def test_an_image_made_from_an_input_image_is_not_a_text_only_jobs(tmp_path):
    """Resume compares input images whichever side has them: an image conditioned on one is not what a text-only
    job of the same prompt and seed makes (Qwen-Image-2.1 runs both), nor the other way round."""
    from dataclasses import replace

    from PIL import Image

    from qwen_image_fast.cli.inputs import read_input_image
    from qwen_image_fast.cli.jobs import Defaults, make_jobs
    from qwen_image_fast.cli.manifest import differing_settings
    from qwen_image_fast.cli.models import labels_for
    from qwen_image_fast.cli.output import settings_of
    from qwen_image_fast.pipelines.core.config import FastConfig

    Image.new("RGBA", (8, 8)).save(tmp_path / "a.png")
    defaults = Defaults(negative_prompt="", seed=0, width=16, height=16, steps=2, cfg=4.0)
    text = make_jobs([{"prompt": "a"}], defaults)[0]
    edit = make_jobs([{"prompt": "a"}], replace(defaults, images=(read_input_image(str(tmp_path / "a.png"), "x"),)))[0]
    labels = labels_for("tiny-random", "baseline", FastConfig())
    assert "images" in differing_settings(text, settings_of(edit, labels), labels)
    assert "images" in differing_settings(edit, settings_of(text, labels), labels)
    assert differing_settings(text, settings_of(text, labels), labels) == []
