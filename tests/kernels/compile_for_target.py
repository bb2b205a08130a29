"""Run in a process of its own (TRITON_INTERPRET unset): the kernels our wrappers launch, as they launch them at the
models' real widths, compiled for another GPU and not launched. A stand-in driver answers the target (no GPU is
needed to compile); JITFunction.__getitem__ compiles (Triton's warmup) instead of launching. Prints one JSON line a
case: {"case", "kernels": [[name, shared bytes, warps], ...]} or {"case", "error"}.

    python tests/kernels/compile_for_target.py CAPABILITY      (89 for sm_89, ...)
"""

import json
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction


class StandInDriver:
    def __init__(self, capability: int):
        self.target = GPUTarget("cuda", capability, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        return torch.device("cpu")

    def is_active(self):
        return True


def cases() -> dict:
    """name -> a call of a wrapper at a model's shape (bf16; FP8 where the pipelines run it)."""
    from qwen_image_fast.kernels.attn_split_fp8 import attn_split_fp8
    from qwen_image_fast.kernels.decode_attention import decode_attention
    from qwen_image_fast.kernels.gelu_fp8 import gelu_fp8
    from qwen_image_fast.kernels.gemv import gemv
    from qwen_image_fast.kernels.layer_norm_modulate import layer_norm_modulate, layer_norm_modulate_fp8
    from qwen_image_fast.kernels.qkv_pack import qkv_pack
    from qwen_image_fast.kernels.quantize_heads import quantize_fp8_heads
    from qwen_image_fast.kernels.residual_gate import (residual_gate, residual_gate_layer_norm_modulate,
                                                       residual_gate_layer_norm_modulate_fp8)
    from qwen_image_fast.kernels.rms_norm import rms_norm
    from qwen_image_fast.kernels.swiglu import silu_mul, silu_mul_fp8

    bf, rows = torch.bfloat16, 4096

    def joint(width):  # a row kernel's operands: x [1, rows, width], a modulation row [1, width]
        return torch.randn(1, rows, width, dtype=bf), torch.randn(1, width, dtype=bf)

    def qkv_case(heads, fp8):
        qkv = torch.randn(1, rows, 3 * heads * 128, dtype=bf)
        out = [torch.empty(1, rows, heads, 128, dtype=torch.float8_e4m3fn if fp8 and i < 2 else bf)
               for i in range(3)]
        scales = (torch.ones(1), torch.ones(1)) if fp8 else None
        w = torch.ones(128, dtype=bf)
        return lambda: qkv_pack(qkv, w, w, torch.randn(rows, 64, 2), *out, 0, qk_scales=scales)

    result = {}
    for width in (3072, 4096):  # the 2512 DiT's, Qwen-Image-2.1's
        x, mod = joint(width)
        result[f"layer_norm_modulate {width}"] = lambda x=x, mod=mod: layer_norm_modulate(x, mod, mod)
        result[f"layer_norm_modulate_fp8 {width}"] = lambda x=x, mod=mod: layer_norm_modulate_fp8(x, mod, mod)
        result[f"residual_gate {width}"] = lambda x=x, mod=mod: residual_gate(x, x, mod)
        result[f"residual_gate_layer_norm_modulate {width}"] = \
            lambda x=x, mod=mod: residual_gate_layer_norm_modulate(x, x, mod, mod, mod)
        result[f"residual_gate_layer_norm_modulate_fp8 {width}"] = \
            lambda x=x, mod=mod: residual_gate_layer_norm_modulate_fp8(x, x, mod, mod, mod)
    hidden = torch.randn(rows, 12288, dtype=bf)  # the 2512 MLP's hidden (GELU), 2.1's SwiGLU hidden
    result["gelu_fp8 12288"] = lambda: gelu_fp8(hidden)
    gate_up = torch.randn(rows, 2 * 12288, dtype=bf)
    result["silu_mul 12288"] = lambda: silu_mul(gate_up)
    result["silu_mul_fp8 12288"] = lambda: silu_mul_fp8(gate_up)
    result["qkv_pack 24 heads"] = qkv_case(24, False)
    result["qkv_pack_fp8 24 heads"] = qkv_case(24, True)
    result["qkv_pack 32 heads"] = qkv_case(32, False)
    o = torch.randn(2, rows, 24, 128, dtype=bf)
    valid = torch.tensor([rows, rows - 100], dtype=torch.int32)
    result["quantize_fp8_heads"] = lambda: quantize_fp8_heads(o, valid, False)
    result["attn_split_fp8"] = lambda: attn_split_fp8(o, 256)
    # the Qwen3.5 text path (prompt enhancer): a decode step's norms, GEMV and attention
    result["rms_norm 4096"] = lambda: rms_norm(torch.randn(1, 4096, dtype=bf), torch.ones(4096, dtype=bf))
    result["gemv 4096x12288"] = lambda: gemv(torch.randn(1, 4096, dtype=bf), torch.randn(12288, 4096, dtype=bf))
    q, kv = torch.randn(1, 16, 256, dtype=bf), torch.randn(1, 4, 256, dtype=bf)
    cache = torch.randn(1, 4096, 4, 256, dtype=bf)
    result["decode_attention"] = lambda: decode_attention(q, kv, kv, cache, cache.clone(),
                                                          torch.tensor([100]), torch.randn(1, 16, 256, dtype=bf))
    return result


def main():
    driver.set_active(StandInDriver(int(sys.argv[1])))
    compiled = []

    def compile_only(self, grid):
        def run(*args, **kwargs):
            kernel = self.run(*args, grid=grid, warmup=True, **kwargs)
            compiled.append([self.fn.__name__, kernel.metadata.shared, kernel.metadata.num_warps])
        return run

    JITFunction.__getitem__ = compile_only
    for name, call in cases().items():
        compiled.clear()
        try:
            call()
            print(json.dumps({"case": name, "kernels": list(compiled)}), flush=True)
        except Exception as e:  # noqa: BLE001 - reported per case
            lines = [line for line in str(e).splitlines() if line.strip()]
            print(json.dumps({"case": name, "error": f"{type(e).__name__}: {lines[-1] if lines else ''}"}),
                  flush=True)


if __name__ == "__main__":
    main()
