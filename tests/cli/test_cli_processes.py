"""`qwen-image-fast render` in several processes: ranks share the prompts, --parallel splits an image."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from qwen_image_fast.command import main

from cli_helpers import BASELINE, TINY, manifest, needs_interpreter, pixels, write_lines


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
