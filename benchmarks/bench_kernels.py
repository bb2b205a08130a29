"""Kernel benchmark (GPU): every op of the kernel core at the real shapes, against its eager reference and
torch.compile(reference), with the error vs the reference beside each timing.

    python3 benchmarks/bench_kernels.py [--ops OP,...] [--out DIR]
    python3 benchmarks/bench_kernels.py --tiny     # CPU smoke run of this script's logic (TRITON_INTERPRET=1)

Shapes: DiT rows B=2 x (4096 image + 218 text) = 8628 by 3072, the 12288-wide MLP hidden, 24 heads x 128;
Qwen3.5 hidden 4096, 16 query heads x 256 with 64 rotary dims, gated norm over 32 value heads x 128, SwiGLU over
an 8192 x 2 x 12288 gate|up (bf16 out, and FP8 as Qwen-Image-2.1's MLP), the Gated-DeltaNet decode step at B=1
and B=64 (16 key / 32 value heads x 128), the
attention decode step at B=1 and 8 (16 / 4 heads x 256; in-place states and caches: checked on fresh copies, timed in
place).
Bytes are the fewest an op must move (each input read once, each output written once); GB/s is also given as
a fraction of the device-to-device copy bandwidth measured in the same run. Appends to results/kernels.jsonl.
--tiny: the same cases and GEMMs at TINY's shapes (few rows and heads) on the CPU through Triton's interpreter, the
FP8 kernels storing their pre-cast values, no torch.compile baseline; prints the rows, appends nothing, and exits 1
if a row fails its check.
"""

import argparse
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import append_results, bench_ms, copy_bandwidth_gbps, environment, matmul_tflops  # noqa: E402

from qwen_image_fast.kernels._utils import rel_rms_error  # noqa: E402
from qwen_image_fast.kernels.attn_split_fp8 import attn_split_fp8, attn_split_fp8_ref  # noqa: E402
from qwen_image_fast.kernels.fp8 import (  # noqa: E402
    fp8_linear,
    quantize_fp8_rowwise,
    quantize_fp8_rowwise_ref,
)
from qwen_image_fast.kernels.decode_attention import decode_attention, decode_attention_ref  # noqa: E402
from qwen_image_fast.kernels.gdn import gated_delta_rule_decode, gated_delta_rule_decode_ref  # noqa: E402
from qwen_image_fast.kernels.gelu_fp8 import gelu_fp8, gelu_fp8_ref  # noqa: E402
from qwen_image_fast.kernels.qk_norm_rope import rms_norm_rope, rms_norm_rope_ref  # noqa: E402
from qwen_image_fast.kernels.layer_norm_modulate import (  # noqa: E402
    layer_norm_modulate,
    layer_norm_modulate_fp8,
    layer_norm_modulate_fp8_ref,
    layer_norm_modulate_ref,
)
from qwen_image_fast.kernels.qkv_pack import qkv_pack, qkv_pack_ref  # noqa: E402
from qwen_image_fast.kernels.residual_gate import (  # noqa: E402
    residual_gate,
    residual_gate_layer_norm_modulate_fp8,
    residual_gate_layer_norm_modulate_fp8_ref,
    residual_gate_ref,
)
from qwen_image_fast.kernels.rms_norm import (  # noqa: E402
    add_rms_norm,
    add_rms_norm_ref,
    gated_rms_norm,
    gated_rms_norm_ref,
    rms_norm,
    rms_norm_ref,
)
from qwen_image_fast.kernels.swiglu import silu_mul, silu_mul_fp8, silu_mul_fp8_ref, silu_mul_ref  # noqa: E402

BF16 = torch.bfloat16
B = 2  # DiT batch
TOL_BF16, TOL_FP8 = 1.5e-2, 4e-2


@dataclass(frozen=True)
class Sizes:
    """The cases' shapes; the defaults are the real ones. One head weight of head_dim serves the DiT heads, Qwen3.5's
    Gated-DeltaNet heads (Dk = Dv = head_dim) and, repeated, its attention heads (2 x head_dim)."""
    l_img: int = 4096  # DiT: B x (l_img + l_txt) tokens of dim = heads x head_dim, MLP hidden mlp
    l_txt: int = 218
    dim: int = 3072
    heads: int = 24
    head_dim: int = 128
    mlp: int = 12288
    tokens: int = 8192  # Qwen3.5-9B prefill: tokens of hidden, SwiGLU over 2 x intermediate
    hidden: int = 4096
    intermediate: int = 12288
    k_heads: int = 16  # Gated-DeltaNet key / value heads
    v_heads: int = 32
    q_heads: int = 16  # attention query / KV heads, rotary dims of a head
    kv_heads: int = 4
    rot_dim: int = 64
    gdn_batches: tuple = (1, 64)  # decode steps: Gated-DeltaNet batch sizes, attention (batch, context)
    decode_attention: tuple = ((1, 256), (1, 4096), (8, 4096))

    @property
    def rows(self) -> int:
        return B * (self.l_img + self.l_txt)  # 8628


# --tiny: Triton's interpreter runs a program op by op (~30 ms a program of these kernels on a CPU core), so few
# programs: few rows and heads. Kept: the hidden width and the 12288 SwiGLU (3 chunks of 4096, chunked_rows_launch).
TINY = Sizes(l_img=24, l_txt=8, dim=128, heads=4, head_dim=32, mlp=512, tokens=2, k_heads=1, v_heads=2, q_heads=4,
             kv_heads=1, rot_dim=16, gdn_batches=(1, 2), decode_attention=((1, 16), (2, 32)))


@dataclass
class Case:
    op: str
    shape: str
    args: tuple
    ours: Callable
    ref: Callable
    fp8_outputs: bool = False  # outputs are (q, scale) pairs: compared dequantized
    moved: int | None = None  # bytes, when not simply all args read + all outputs written
    fresh: Callable | None = None  # args -> copies, for ops that update some args in place (checked on copies)


def nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(nbytes(o) for o in obj)
    return 0


def comparable(out, fp8_outputs: bool) -> list[torch.Tensor]:
    """Flatten an op's outputs into tensors to compare; FP8 (q, scale) pairs become q * scale (fp32 q, --tiny's
    pre-cast values, and their scales are compared as they are)."""
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    if not fp8_outputs:
        return [o.float() for o in outs]
    result, i = [], 0
    while i < len(outs):
        if outs[i].dtype == torch.float8_e4m3fn:
            result.append(outs[i].float() * outs[i + 1])
            i += 2
        else:
            result.append(outs[i].float())
            i += 1
    return result


def gdn_decode_args(rnd, batch: int, sz: Sizes, device):
    """Qwen3.5-9B Gated-DeltaNet decode inputs: H=16 key heads, HV=32 value heads, Dk=Dv=128, conv K=4 (a ring of
    4 inputs), sequences at positions 0 .. B-1."""
    h, hv, dk, dv, k = sz.k_heads, sz.v_heads, sz.head_dim, sz.head_dim, 4
    c = 2 * h * dk + hv * dv
    state = torch.randn(batch, hv, dk, dv, device=device) * 0.1
    positions = torch.arange(batch, device=device)
    return (rnd(batch, c), rnd(batch, hv), rnd(batch, hv), rnd(batch, c, k), positions, rnd(c, k, scale=0.5),
            torch.rand(hv, device=device).log(), torch.rand(hv, device=device), state, h, dk, dv)


def gdn_decode_case(args) -> Case:
    """Bytes: the inputs read (the whole conv ring, of which K-1 slots are), one ring slot written per channel, the
    recurrent state read and written, o written."""
    batch, hv, h, dv = args[0].shape[0], args[1].shape[1], args[9], args[11]
    moved = nbytes(args[:8]) + nbytes(args[0]) + 2 * nbytes(args[8]) + batch * hv * dv * args[0].element_size()
    return Case("gated_delta_rule_decode", f"B={batch}, {h}/{hv} heads x {dv}", args, gated_delta_rule_decode,
                gated_delta_rule_decode_ref, fresh=fresh_states, moved=moved)


def fresh_states(args):
    """Copies of the decode step's in-place arguments (conv ring, recurrent state)."""
    args = list(args)
    args[3], args[8] = args[3].clone(), args[8].clone()
    return tuple(args)


def decode_attention_case(rnd, batch: int, context: int, sz: Sizes, device) -> Case:
    """Qwen3.5-9B attention decode: 16 query / 4 KV heads x 256, caches of `context` positions, every sequence at
    the last one (q and gate views of one [query | gate] projection, as the model passes them).
    Bytes: the caches read up to the position, q, k, v, gate read, o written."""
    h, kvh, d = sz.q_heads, sz.kv_heads, 2 * sz.head_dim
    qg = rnd(batch, h, 2 * d)
    args = (qg[..., :d], rnd(batch, kvh, d), rnd(batch, kvh, d), rnd(batch, context, kvh, d),
            rnd(batch, context, kvh, d), torch.full((batch,), context - 1, device=device), qg[..., d:])
    moved = 2 * nbytes(args[3]) + nbytes(qg) + 2 * nbytes(args[1]) + batch * h * d * 2

    def fresh(a):
        a = list(a)
        a[3], a[4] = a[3].clone(), a[4].clone()
        return tuple(a)
    return Case("decode_attention", f"B={batch}, L={context}, {h}/{kvh} heads x {d}, gated", args, decode_attention,
                decode_attention_ref, fresh=fresh, moved=moved)


def make_cases(sz: Sizes, dev: torch.device) -> list[Case]:
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, dtype=BF16, scale=1.0):
        return (torch.randn(*shape, generator=g, device=dev) * scale).to(dtype)

    l_img, l_txt, d, h, hd, t = sz.l_img, sz.l_txt, sz.dim, sz.heads, sz.head_dim, sz.tokens
    x_dit = rnd(B, l_img + l_txt, d)
    mod = rnd(B, 6 * d, scale=0.5)
    shift, scale, gate = mod[:, :d], mod[:, d : 2 * d], mod[:, 2 * d : 3 * d]
    residual = rnd(B, l_img + l_txt, d, scale=4.0)
    freqs = torch.view_as_real(torch.polar(torch.ones(l_img, hd // 2, device=dev),
                                           torch.rand(l_img, hd // 2, generator=g, device=dev) * 6.28))
    qkv = rnd(B, l_img, 3 * h * hd)
    joint = [torch.zeros(B, l_img + l_txt, h, hd, device=dev, dtype=BF16) for _ in range(3)]
    w_head = rnd(hd, scale=0.1) + 1
    q35_x, q35_res = rnd(t, sz.hidden), rnd(t, sz.hidden)
    q35_w = rnd(sz.hidden, scale=0.1)
    cos_sin = torch.rand(2, 1, t, sz.rot_dim, generator=g, device=dev).to(BF16)
    gdn_o, gdn_z = rnd(t * sz.v_heads, hd), rnd(t * sz.v_heads, hd)
    dit, q35 = f"{B}x{l_img + l_txt}x{d}", f"{t}x{sz.hidden}"
    swiglu, ad = f"{t}x(2x{sz.intermediate})", 2 * hd  # ad: the attention head dim
    return [
        Case("rms_norm_diffusers", f"{sz.rows * h}x{hd}", (x_dit.view(-1, hd), w_head), rms_norm, rms_norm_ref),
        Case("rms_norm_zero_centered", q35, (q35_x, q35_w, 1e-6, True), rms_norm, rms_norm_ref),
        Case("add_rms_norm_zero_centered", q35, (q35_x, q35_res, q35_w, 1e-6, True),
             add_rms_norm, add_rms_norm_ref),
        Case("gated_rms_norm", f"{t * sz.v_heads}x{hd}", (gdn_o, gdn_z, w_head), gated_rms_norm, gated_rms_norm_ref),
        Case("layer_norm_modulate", dit, (x_dit, shift, scale), layer_norm_modulate, layer_norm_modulate_ref),
        Case("layer_norm_modulate_fp8", dit, (x_dit, shift, scale), layer_norm_modulate_fp8,
             layer_norm_modulate_fp8_ref, fp8_outputs=True),
        Case("residual_gate", dit, (residual, x_dit, gate), residual_gate, residual_gate_ref),
        Case("residual_gate_layer_norm_modulate_fp8", dit, (residual, x_dit, gate, shift, scale),
             residual_gate_layer_norm_modulate_fp8, residual_gate_layer_norm_modulate_fp8_ref, fp8_outputs=True),
        Case("qkv_pack", f"{B}x{l_img}x{3 * h * hd} -> {B}x{l_img + l_txt}x{h}x{hd}",
             (qkv, w_head, w_head, freqs, *joint, 0), qkv_pack_written(qkv_pack, joint, l_img),
             qkv_pack_written(qkv_pack_ref, joint, l_img), moved=2 * nbytes(qkv) + nbytes(freqs)),
        Case("attn_split_fp8", dit, (x_dit, l_img), attn_split_fp8, attn_split_fp8_ref, fp8_outputs=True),
        Case("gelu_fp8", f"{sz.rows}x{sz.mlp}", (rnd(sz.rows, sz.mlp, scale=2.0),), gelu_fp8, gelu_fp8_ref,
             fp8_outputs=True),
        Case("quantize_fp8_rowwise", f"{sz.rows}x{d}", (x_dit.view(-1, d),), quantize_fp8_rowwise,
             quantize_fp8_rowwise_ref, fp8_outputs=True),
        Case("silu_mul", swiglu, (rnd(t, 2 * sz.intermediate, scale=2.0),), silu_mul, silu_mul_ref),
        Case("silu_mul_fp8", swiglu, (rnd(t, 2 * sz.intermediate, scale=2.0),), silu_mul_fp8, silu_mul_fp8_ref,
             fp8_outputs=True),
        Case("rms_norm_rope (q view of [query|gate])", f"1x{t}x{sz.q_heads}x{ad} of {2 * ad} (R={sz.rot_dim})",
             (rnd(1, t, sz.q_heads, 2 * ad)[..., :ad], w_head.repeat(2) - 1, cos_sin[0], cos_sin[1]),
             rms_norm_rope, rms_norm_rope_ref, moved=2 * t * sz.q_heads * ad * 2 + 2 * nbytes(cos_sin[0])),
        *[gdn_decode_case(gdn_decode_args(rnd, b, sz, dev)) for b in sz.gdn_batches],
        *[decode_attention_case(rnd, b, context, sz, dev) for b, context in sz.decode_attention],
    ]


def qkv_pack_written(fn, joint, n_rows):
    """qkv_pack writes into buffers; as a benchmarked function return the rows it wrote."""
    def run(*args):
        fn(*args)
        return tuple(t[:, :n_rows] for t in joint)
    return run


def gemm_rows(env, sz: Sizes, device: torch.device) -> list[dict]:
    """fp8_linear at the four DiT GEMM shapes (M = 8628 tokens) vs bf16 F.linear: TF/s and error."""
    rows, m, d = [], sz.rows, sz.dim
    # the operands' codes: by torch's cast on the CPU (the interpreter's fp8 casts mis-round)
    quantize = quantize_fp8_rowwise if device.type == "cuda" else quantize_fp8_rowwise_ref
    for name, n, k in (("qkv", 3 * d, d), ("out", d, d), ("fc1", sz.mlp, d), ("fc2", d, sz.mlp)):
        x = torch.randn(m, k, device=device, dtype=BF16)
        w = torch.randn(n, k, device=device, dtype=BF16) * k**-0.5
        bias = torch.randn(n, device=device, dtype=BF16) * 0.1
        ref = torch.nn.functional.linear(x.float(), w.float(), bias.float())
        x_q, x_s = quantize(x)
        w_q, w_s = quantize(w)
        for impl, fn in (("bf16_linear", lambda: torch.nn.functional.linear(x, w, bias)),
                         ("fp8_linear", lambda: fp8_linear(x_q, x_s, w_q, w_s.view(-1), bias))):
            err = rel_rms_error(fn(), ref)
            ok = err <= (TOL_FP8 if impl == "fp8_linear" else TOL_BF16)
            ms = bench_ms(fn) if ok else None
            tflops = 2 * m * n * k / ms / 1e9 if ok else None
            rows.append(dict(env, bench="kernels", op=f"gemm_{name}", shape=f"{m}x{k}->{n}", impl=impl,
                             ms=ms, tflops=tflops, rel_err=err, ok=ok))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ops", default=None, help="comma-separated op names (default: all)")
    parser.add_argument("--out", type=Path, default=None, help="also append the results here")
    parser.add_argument("--tiny", action="store_true", help="few rows on the CPU (logic check; TRITON_INTERPRET=1)")
    args = parser.parse_args()
    wanted = None if args.ops is None else set(args.ops.split(","))
    device = torch.device("cpu" if args.tiny else "cuda")
    sizes = TINY if args.tiny else Sizes()
    if args.tiny:
        torch.manual_seed(0)  # CI: the same inputs each run (fp8_linear's error, ~3.7e-2, sits close to TOL_FP8)
    env = environment()
    copy_bw = copy_bandwidth_gbps(16 << 20 if args.tiny else 2 << 30)
    mm = 256 if args.tiny else 8192  # the ceilings' GEMM: M = N = K
    env.update(copy_gbps=copy_bw, bf16_tflops=matmul_tflops(mm, mm, mm, fp8=False),
               fp8_tflops=matmul_tflops(mm, mm, mm, fp8=True))
    print(f"{env['gpu']}: copy {copy_bw:.0f} GB/s, bf16 {env['bf16_tflops']:.0f} TF/s, "
          f"fp8 rowwise {env['fp8_tflops']:.0f} TF/s")
    if args.tiny:
        print("--tiny: no torch.compile baseline (inductor builds C++ for the CPU: ~1.5 s an op, ~9 s the first)")
    rows = []
    for case in make_cases(sizes, device):
        if wanted is not None and case.op.split(" ")[0] not in wanted:
            continue
        fresh = case.fresh or (lambda a: a)
        expected = None
        tol = TOL_FP8 if case.fp8_outputs else TOL_BF16
        ours, ref = case.ours, case.ref
        if args.tiny and case.fp8_outputs:  # the interpreter's fp8 casts mis-round: the pre-cast values, as CPU tests
            ours, ref = partial(ours, q_dtype=torch.float32), partial(ref, q_dtype=torch.float32)
        timed = [("eager", ref), ("triton", ours)]
        if not args.tiny:
            timed.insert(1, ("compile", torch.compile(ref, dynamic=False)))
        for impl, fn in timed:
            row = dict(env, bench="kernels", op=case.op, shape=case.shape, impl=impl, ms=None, gbps=None,
                       frac_of_copy_bw=None, rel_err=None, ok=False)
            rows.append(row)
            if expected is None or case.fresh:  # in-place ops: the previous impl's timing advanced the state
                expected = comparable(ref(*fresh(case.args)), case.fp8_outputs)
            try:
                out = fn(*fresh(case.args))
            except Exception as e:  # recorded and shown; the other ops still run
                row["error"] = f"{type(e).__name__}: {e}"[:500]
                continue
            got = comparable(out, case.fp8_outputs)
            row["rel_err"] = max(rel_rms_error(a, b) for a, b in zip(got, expected))
            row["ok"] = row["rel_err"] <= tol
            if row["ok"]:  # no speed on a failed check
                moved = case.moved or nbytes(case.args) + nbytes(out)
                row["ms"] = bench_ms(lambda: fn(*case.args))
                row["gbps"] = moved / row["ms"] / 1e6
                row["frac_of_copy_bw"] = row["gbps"] / copy_bw
    rows += gemm_rows(env, sizes, device) if wanted is None else []
    if not args.tiny:
        append_results("kernels", rows, args.out)
    by_op = {}
    for r in rows:
        by_op.setdefault((r["op"], r["shape"]), {})[r["impl"]] = r
    print(f"{'op':40} {'impl':12} {'ms':>8} {'GB/s':>7} {'copy%':>6} {'TF/s':>6} {'rel_err':>9}  vs compile")
    for (op, shape), impls in by_op.items():
        for impl, r in impls.items():
            if not r["ok"]:
                print(f"{op:40} {impl:12} CHECK FAILED rel_err {r['rel_err']} {r.get('error', '')}")
                continue
            speedup = ""
            if impl == "triton" and impls.get("compile", {}).get("ms"):
                speedup = f"{impls['compile']['ms'] / r['ms']:.2f}x"
            gb = f"{r['gbps']:7.0f} {100 * r['frac_of_copy_bw']:5.0f}%" if r.get("gbps") else " " * 14
            tf = f"{r['tflops']:6.0f}" if r.get("tflops") else " " * 6
            print(f"{op:40} {impl:12} {r['ms']:8.4f} {gb} {tf} {r['rel_err']:9.2e}  {speedup}")
    if args.tiny and not all(r["ok"] for r in rows):
        sys.exit("--tiny: a row failed its check (CHECK FAILED above)")


if __name__ == "__main__":
    main()
