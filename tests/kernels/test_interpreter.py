"""kernels/_interpreter.py: under Triton's interpreter, the language is patched once per launch, not again at each
nested @triton.jit call, and the kernels compute what they did."""

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter's own behaviour")


def test_a_launch_with_nested_calls_scans_the_language_once():
    from triton.runtime import interpreter

    from qwen_image_fast.kernels.residual_gate import residual_gate, residual_gate_ref

    scans = []
    original = interpreter._patch_builtin
    interpreter._patch_builtin = lambda pkg, *args: (scans.append(pkg), original(pkg, *args))[1]
    try:
        residual, x = torch.randn(2, 5, 48), torch.randn(2, 5, 48)
        gate = torch.randn(2, 48)
        out = residual_gate(residual, x, gate)  # its kernel calls nested @triton.jit helpers (tile_rows, load_mod)
    finally:
        interpreter._patch_builtin = original
    torch.testing.assert_close(out, residual_gate_ref(residual, x, gate), rtol=0, atol=0)
    # the launch's one patch: tl (its module, tensor class and math), tl.core (module, tensor class) and the tensor
    # descriptor class; without the skip, each nested call scans them again
    assert len(scans) == 6, len(scans)
