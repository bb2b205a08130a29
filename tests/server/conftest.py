"""The server tests' LoRA files: one loaded at start (style), and a --lora-dir holding other, sub/deep and broken
(not a safetensors file: the engine fails to load it, a request naming it fails inside the pipeline)."""

import pytest
from helpers import tiny_lora


@pytest.fixture(scope="module")
def lora_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    (root / "dir" / "sub").mkdir(parents=True)
    style = tiny_lora(root / "style.safetensors", seed=1)
    tiny_lora(root / "dir" / "other.safetensors", seed=2)
    tiny_lora(root / "dir" / "sub" / "deep.safetensors", seed=3)
    (root / "dir" / "broken.safetensors").write_bytes(b"not a safetensors file")  # fails in the engine
    return style, root / "dir"
