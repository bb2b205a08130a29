"""What the CLI tests share: the tiny model's arguments, reading what a render wrote (a tiny LoRA file: helpers.py).

Most runs use --preset baseline (the stock pipeline: ~0.03 s an image); the fast preset's Triton kernels run under
the interpreter. Subprocesses (kill -9, several ranks) inherit the environment (TRITON_INTERPRET, HF_HUB_OFFLINE).
"""

import json
import os
import time

import numpy as np
import pytest
from PIL import Image

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


def wait_for_manifest_lines(process, manifest_path, n: int, then: str):
    """Until the render running in `process` has listed n images in its manifest (60 s at most); it must not have
    exited before it `then` (what the test does to it next)."""
    deadline = time.monotonic() + 60
    while not (manifest_path.exists() and manifest_path.read_text().count("\n") >= n) and time.monotonic() < deadline:
        assert process.poll() is None, f"the render exited (status {process.returncode}) before it {then}"
        time.sleep(0.01)
