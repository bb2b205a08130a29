"""Transformer benchmark (GPU): the 60-block Qwen-Image transformer, stock diffusers vs torch.compile vs torchao
FP8 vs ours, one process, the same random weights (normal(0, 0.02), biases 0, norm weights 1) and inputs.

    python3 benchmarks/bench_transformer.py [--impls ...] [--shapes ...] [--out DIR]
    python3 benchmarks/bench_transformer.py --tiny  # CPU smoke run of this script's logic

Per row: median ms per forward (>= 5 runs after warm-up), achieved TF/s (linear FLOPs of every token plus
attention over the keys each sample really has), rel-RMS error of the output vs diffusers-eager, peak GiB
allocated while it ran (everything resident at the time: the notes column says what else was). Also measures
the floor of each shape: linear FLOPs at the rowwise-FP8 _scaled_mm rate of this GPU (with fast accumulation for
the rows that run their GEMMs so) plus attention alone.
Appends to results/transformer.jsonl.

--tiny: pipelines/tiny.py's transformer in fp32 on the CPU (Triton's interpreter), one small padded shape, the rows
printed, not appended; what needs a GPU (cuDNN attention, CUDA graphs, torchao's FP8, the profiler's kernel table)
and torch.compile (minutes of inductor on the CPU) are skipped with a line saying why.
"""

import argparse
import dataclasses
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import append_results, bench_ms, environment, sync  # noqa: E402

from qwen_image_fast.kernels._utils import rel_rms_error  # noqa: E402
from qwen_image_fast.pipelines.core.model.attention import TextMask, joint_attention, resolve_backend  # noqa: E402
from qwen_image_fast.pipelines.core.optimizations import CallRecord  # noqa: E402
from qwen_image_fast.pipelines.core.runtime.runner import Runner  # noqa: E402
from qwen_image_fast.pipelines.core.config import FastTransformerConfig  # noqa: E402
from qwen_image_fast.pipelines.core.model.fp8_attention import installed  # noqa: E402
from qwen_image_fast.pipelines.qwen_image.model.transformer import FastQwenImageTransformer  # noqa: E402
from qwen_image_fast.pipelines.tiny import TINY_TRANSFORMER  # noqa: E402

BF16 = torch.bfloat16
# (resolution, batch, padded): padded = the last sample's prompt has 150 of 218 tokens (batched CFG)
SHAPES = {
    "1024x1024-b1": ("1024x1024", 1, False),
    "1024x1024-b2": ("1024x1024", 2, False),
    "1024x1024-b2-padded": ("1024x1024", 2, True),
    "1328x1328-b2": ("1328x1328", 2, False),
    "1664x928-b2": ("1664x928", 2, False),
}
IMPLS = ("diffusers-eager", "ours-bf16", "ours-fp8", "ours-fp8-cudnn", "ours-fp8-graph", "ours-fp8-fastacc",
         "ours-fp8attn-graph", "diffusers-compile", "torchao-fp8-compile")
# --tiny on the CPU: the impls it skips, and why
CPU_SKIPS = {"ours-fp8-cudnn": "cuDNN attention needs a CUDA GPU", "ours-fp8-graph": "CUDA graphs need a GPU",
             "ours-fp8attn-graph": "CUDA graphs need a GPU, FP8 attention a Hopper one",
             "diffusers-compile": "inductor compiles even the tiny blocks for ~35 s on the CPU",
             "torchao-fp8-compile": "torchao's rowwise FP8 needs a CUDA GPU with FP8 tensor cores"}


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What the model, inputs, FLOP counts and floors are built from: the real transformer and prompt on the GPU in
    BF16 (the defaults), or --tiny's."""

    layers: int = 60
    heads: int = 24
    head_dim: int = 128
    in_channels: int = 64  # the packed latents: 2x2 patches of the VAE's 16 channels
    joint_dim: int = 3584  # the text encoder's hidden size
    txt_len: int = 218
    padded_txt_len: int = 150  # the last sample's valid text tokens in a padded shape
    gemm_tokens: int = 8192  # fp8_gemm_tflops's rows
    shapes: dict = dataclasses.field(default_factory=lambda: SHAPES)
    config: dict = dataclasses.field(default_factory=dict)  # QwenImageTransformer2DModel's constructor overrides
    device: str = "cuda"
    dtype: torch.dtype = BF16

    @property
    def d(self) -> int:
        return self.heads * self.head_dim

    @property
    def linear_flops_per_token(self) -> int:
        return 2 * 12 * self.d * self.d * self.layers  # QKV 3D^2 + out D^2 + MLP 8D^2 per block and token


FULL = Sizes()
# --tiny: pipelines/tiny.py's transformer (its real sizes in its comments) in fp32 on the CPU, one padded B=2 shape
TINY = Sizes(layers=TINY_TRANSFORMER["num_layers"], heads=TINY_TRANSFORMER["num_attention_heads"],
             head_dim=TINY_TRANSFORMER["attention_head_dim"], in_channels=TINY_TRANSFORMER["in_channels"],
             joint_dim=TINY_TRANSFORMER["joint_attention_dim"], config=TINY_TRANSFORMER,
             txt_len=12, padded_txt_len=8, gemm_tokens=64,  # 218, 150, 8192
             shapes={"64x96-b2-padded": ("64x96", 2, True)}, device="cpu", dtype=torch.float32)


def make_stock(seed: int = 0, sizes: Sizes = FULL, **config):
    """QwenImageTransformer2DModel at `sizes` (full size unless --tiny; config: constructor overrides, e.g.
    zero_cond_t=True), random weights, built straight on the sizes' device and dtype (the GPU, bf16)."""
    from diffusers import QwenImageTransformer2DModel
    from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope

    with torch.device("meta"):
        model = QwenImageTransformer2DModel(**{**sizes.config, **config})
    model = model.to(sizes.dtype).to_empty(device=sizes.device)
    model.pos_embed = QwenEmbedRope(theta=10000, axes_dim=list(model.config.axes_dims_rope), scale_rope=True)
    g = torch.Generator(device=sizes.device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    return model.eval()


def make_inputs(shape_key: str, seed: int = 1, sizes: Sizes = FULL) -> dict:
    resolution, batch, padded = sizes.shapes[shape_key]
    w, h = map(int, resolution.split("x"))
    lh, lw = h // 16, w // 16  # VAE /8, then 2x2 patches
    device, dtype = sizes.device, sizes.dtype
    g = torch.Generator(device=device).manual_seed(seed)
    inputs = dict(
        hidden_states=torch.randn(batch, lh * lw, sizes.in_channels, generator=g, device=device).to(dtype),
        encoder_hidden_states=torch.randn(batch, sizes.txt_len, sizes.joint_dim, generator=g, device=device).to(dtype),
        encoder_hidden_states_mask=None,
        timestep=torch.full((batch,), 0.6, device=device, dtype=dtype),
        img_shapes=[[(1, lh, lw)]] * batch,
    )
    if padded:
        mask = torch.ones(batch, sizes.txt_len, dtype=torch.long, device=device)
        mask[-1, sizes.padded_txt_len:] = 0
        inputs["encoder_hidden_states_mask"] = mask
    return inputs


def flops(inputs: dict, sizes: Sizes) -> float:
    batch, img_len = inputs["hidden_states"].shape[:2]
    mask = inputs["encoder_hidden_states_mask"]
    txt = [sizes.txt_len] * batch if mask is None else mask.sum(1).tolist()
    seq = img_len + sizes.txt_len
    linear = sizes.linear_flops_per_token * batch * seq
    attention = sum(4 * seq * (img_len + t) * sizes.d * sizes.layers for t in txt)
    return linear + attention


def attention_floor_ms(inputs: dict, backend: str, sizes: Sizes) -> float:
    """`layers` x one joint attention at this shape, alone."""
    batch, img_len = inputs["hidden_states"].shape[:2]
    seq = img_len + sizes.txt_len
    q, k, v = (torch.randn(batch, seq, sizes.heads, sizes.head_dim, device=sizes.device, dtype=sizes.dtype)
               for _ in range(3))
    mask = inputs["encoder_hidden_states_mask"]
    text_mask = None if mask is None else TextMask(mask, img_len)
    return sizes.layers * bench_ms(lambda: joint_attention(q, k, v, text_mask, backend))


def fp8_gemm_tflops(sizes: Sizes, fast_accum: bool = False) -> float:
    """Rowwise-FP8 _scaled_mm at the DiT's fc1 shape (gemm_tokens x D -> 4D: 8192 x 3072 -> 12288)."""
    m, d, device = sizes.gemm_tokens, sizes.d, sizes.device
    a = torch.randn(m, d, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(4 * d, d, device=device).to(torch.float8_e4m3fn)
    sa, sb = torch.rand(m, 1, device=device) + 0.5, torch.rand(1, 4 * d, device=device) + 0.5
    ms = bench_ms(lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=BF16,
                                           use_fast_accum=fast_accum))
    return 2 * m * d * 4 * d / ms / 1e9


FAST_ACCUM_IMPLS = ("ours-fp8-fastacc", "ours-fp8attn-graph")  # their floor: the fast-accumulation GEMM rate


def time_forward(model, inputs, runs: int = 7) -> tuple[float, torch.Tensor, float]:
    """(median ms over `runs` after 2 warm-ups, output, peak GiB allocated). On the CPU (--tiny): bench_ms's wall
    clock, no peak (0)."""
    if inputs["hidden_states"].device.type == "cpu":
        last = {}  # the output of bench_ms's last call: no extra forward in the interpreter

        def forward():
            last["out"] = model(**inputs).sample

        with torch.no_grad():
            return bench_ms(forward), last["out"], 0.0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        for _ in range(2):
            out = model(**inputs).sample
        times = []
        for _ in range(runs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = model(**inputs).sample
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2], out, torch.cuda.max_memory_allocated() / 2**30


class Replayed:
    """`model`'s forwards through the pipelines' runner with CUDA graphs (its policy: a signature's first forward
    eager, the second captured, later ones replayed), callable like the model; one call of the runner for all."""

    def __init__(self, model):
        self.model = model
        self.call = Runner().call(model, CallRecord(), graphs=True, pair_cfg=False, bucket=1)
        self.run = self.call.__enter__()

    def __call__(self, **inputs):
        from diffusers.models.modeling_outputs import Transformer2DModelOutput

        inputs = dict(guidance=None, controlnet_block_samples=None, additional_t_cond=None, modulation=None) | inputs
        return Transformer2DModelOutput(sample=self.run.forward("cond", **inputs))

    def close(self):
        self.call.__exit__(None, None, None)


def each_attention_kernel(ours):
    """Yields "off" then each FP8 attention kernel installed, `ours` set as the pipelines run it for each (fast
    accumulation); its own settings back after."""
    run_config = ours.fast_config
    linears = [module for module in ours.transformer_blocks.modules() if hasattr(module, "fast_accum")]
    try:
        for kernel in ("off", "cudnn", "fa3"):
            if kernel != "off" and not installed(kernel):
                continue
            ours.fast_config = dataclasses.replace(run_config, fp8_fast_accum=True, fp8_attention=kernel)
            for module in linears:
                module.fast_accum = True
            yield kernel
    finally:
        ours.fast_config = run_config
        for module in linears:
            module.fast_accum = run_config.fp8_fast_accum


def free():
    gc.collect()
    torch.cuda.empty_cache()


def quantize_torchao(stock):
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    # the same linears ours runs in FP8: the blocks' attention and MLP, not img_mod/txt_mod
    def is_block_linear(module, fqn):
        return isinstance(module, torch.nn.Linear) and fqn.startswith("transformer_blocks.") and "_mod" not in fqn

    quantize_(stock, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()), filter_fn=is_block_linear)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny random transformer on the CPU (logic check)")
    parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--profile", action="store_true",
                        help="ours-fp8's top kernels and attention TF/s (1024x1024 B=2 padded if among --shapes), "
                             "with each FP8 attention kernel installed and without")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    sizes, impls, shapes = FULL, args.impls, args.shapes
    if args.tiny:
        sizes, impls, shapes = TINY, [i for i in args.impls if i not in CPU_SKIPS], list(TINY.shapes)
        for impl in [i for i in args.impls if i in CPU_SKIPS]:
            print(f"{impl}: skipped on the CPU ({CPU_SKIPS[impl]})")
    device = torch.device(sizes.device)
    torch._dynamo.config.cache_size_limit = 64
    env = environment()
    env["fp8_gemm_tflops"] = fp8_gemm_tflops(sizes)
    env["fp8_gemm_tflops_fast_accum"] = fp8_gemm_tflops(sizes, fast_accum=True)
    print(f"{env['gpu']}: rowwise-FP8 _scaled_mm {env['fp8_gemm_tflops']:.0f} TF/s at {sizes.gemm_tokens}x{sizes.d}x"
          f"{4 * sizes.d}, {env['fp8_gemm_tflops_fast_accum']:.0f} with fast accumulation")

    inputs = {key: make_inputs(key, sizes=sizes) for key in shapes}
    rows, refs, floors = [], {}, {}
    fa4_or_cudnn = resolve_backend("auto", device, sizes.dtype)
    for key in shapes:  # linear FLOPs at this GPU's FP8 GEMM rate (each accumulation) + attention alone
        batch, img_len = inputs[key]["hidden_states"].shape[:2]
        attention_ms = attention_floor_ms(inputs[key], fa4_or_cudnn, sizes)
        linear_flops = sizes.linear_flops_per_token * batch * (img_len + sizes.txt_len)
        floors[key] = {fast: linear_flops / env[rate] / 1e9 + attention_ms
                       for fast, rate in ((False, "fp8_gemm_tflops"), (True, "fp8_gemm_tflops_fast_accum"))}

    def record(impl, attention, key, model, notes=""):
        resolution, batch, padded = sizes.shapes[key]
        floor = floors[key][impl in FAST_ACCUM_IMPLS]
        t0 = time.time()
        ms, out, peak = time_forward(model, inputs[key])
        if impl == "diffusers-eager":
            refs[key] = out
        err = rel_rms_error(out, refs[key])
        row = dict(env, bench="transformer", impl=impl, attention=attention, resolution=resolution, batch=batch,
                   padded_text=padded, ms=ms, tflops=flops(inputs[key], sizes) / ms / 1e9, rel_err=err,
                   peak_gib=peak, floor_ms=floor, ms_over_floor=ms / floor, notes=notes)
        rows.append(row)
        if args.tiny:
            print(json.dumps(row))  # the line a GPU run appends
        else:
            append_results("transformer", [row], args.out)
        print(f"{impl:22} {attention:8} {key:20} {ms:8.1f} ms {row['tflops']:6.0f} TF/s  rel_err {err:.2e}  "
              f"peak {peak:5.1f} GiB  floor {floor:6.1f} ms  ({time.time() - t0:.0f} s) {notes}", flush=True)
        del out

    stock = make_stock(sizes=sizes)
    for key in shapes:  # the reference every row is compared with
        record("diffusers-eager", "sdpa-default", key, stock, "stock model only")
    if "ours-bf16" in impls:
        ours = FastQwenImageTransformer.from_diffusers(stock, FastTransformerConfig(fp8=False))
        for key in shapes:
            record("ours-bf16", ours.attention_backend, key, ours, "shares the stock's weights but fused QKV")
        del ours
        free()
    if any(impl.startswith("ours-fp8") for impl in impls):
        stock.to("cpu")  # build from a CPU model: never two BF16 copies on the GPU
        free()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = time.time()
        ours = FastQwenImageTransformer.from_diffusers(stock, FastTransformerConfig(fp8=True, fp8_fast_accum=False),
                                                       device=device)
        sync(device)
        build = dict(build_s=time.time() - t0, build_peak_gib=torch.cuda.max_memory_allocated() / 2**30,
                     resident_gib=torch.cuda.memory_allocated() / 2**30)
        print(f"ours-fp8 built from a CPU model in {build['build_s']:.0f} s: peak {build['build_peak_gib']:.1f} GiB,"
              f" resident {build['resident_gib']:.1f} GiB (FP8 block linears + BF16 img_mod/txt_mod/embedders)")
        env.update(build)
        if "ours-fp8" in impls:
            for key in shapes:
                record("ours-fp8", ours.attention_backend, key, ours, "ours alone on the GPU")
        if "ours-fp8-cudnn" in impls:
            run_config = ours.fast_config
            ours.fast_config = dataclasses.replace(run_config, attention="cudnn")
            for key in shapes:
                record("ours-fp8", "cudnn", key, ours, "ours alone on the GPU")
            ours.fast_config = run_config
        if "ours-fp8-graph" in impls:
            graphed = Replayed(ours)
            for key in shapes:
                record("ours-fp8-graph", ours.attention_backend, key, graphed, "CUDA-graph replay; ours alone")
            graphed.close()
            del graphed
        if "ours-fp8-fastacc" in impls:
            linears = [m for m in ours.transformer_blocks.modules() if hasattr(m, "fast_accum")]
            for module in linears:
                module.fast_accum = True
            for key in shapes:
                record("ours-fp8-fastacc", ours.attention_backend, key, ours, "use_fast_accum=True; ours alone")
            for module in linears:
                module.fast_accum = False
        if "ours-fp8attn-graph" in impls:  # the pipelines' setting (fast accumulation, graphs) with and without
            for kernel in each_attention_kernel(ours):  # FP8 attention
                graphed = Replayed(ours)
                for key in shapes:
                    record("ours-fp8attn-graph", ours.attention_backend if kernel == "off" else f"{kernel}-fp8", key,
                           graphed, "fast accumulation, CUDA-graph replay; ours alone")
                graphed.close()
        if args.profile and args.tiny:
            print("--profile: skipped on the CPU (the CUDA profiler's kernel table needs a GPU)")
        elif args.profile:  # the pipelines' settings (fast accumulation), each attention kernel
            key = "1024x1024-b2-padded" if "1024x1024-b2-padded" in inputs else next(iter(inputs))
            for kernel in each_attention_kernel(ours):
                row = profile(ours, inputs[key], args.out, kernel, sizes)
                append_results("transformer", [dict(env, bench="transformer-profile", resolution=SHAPES[key][0],
                                                     batch=SHAPES[key][1], padded_text=SHAPES[key][2], **row)],
                               args.out)
        del ours
        free()
        stock.to(device)
        free()
    if "diffusers-compile" in impls:
        stock.compile_repeated_blocks(fullgraph=True)
        for key in shapes:
            record("diffusers-compile", "sdpa-default", key, stock, "compile_repeated_blocks(fullgraph=True)")
        del stock
        free()
        torch._dynamo.reset()
        stock = make_stock(sizes=sizes)
    if "torchao-fp8-compile" in impls:
        quantize_torchao(stock)
        stock.compile_repeated_blocks(fullgraph=True)
        for key in shapes:
            record("torchao-fp8-compile", "sdpa-default", key, stock, "PerRow on block attn+MLP linears")
    print_table(rows)


ATTENTION_KERNEL_NAMES = ("flash", "fmha", "sdpa", "attention")  # FA4's, FA3's and cuDNN's kernels say one of these


def profile(model, inputs, out_dir, fp8_attention: str, sizes: Sizes) -> dict:
    """One eager forward under the profiler: its top kernels, and the attention kernel's mean time and TF/s (the
    FLOPs flops() counts for attention over the keys each sample has, per call)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    with torch.no_grad():
        model(**inputs)
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            model(**inputs)
            torch.cuda.synchronize()
    events = prof.key_averages()
    table = events.table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=70)
    attention = sorted((e for e in events if e.device_type.name == "CUDA" and e.count == sizes.layers
                        and any(word in e.key.lower() for word in ATTENTION_KERNEL_NAMES)),
                       key=lambda e: e.device_time_total)  # FA3 runs a small scheduling kernel before its own
    if not attention:
        raise RuntimeError(f"no attention kernel run {sizes.layers} times in the profile")
    attention = attention[-1:]
    batch, img_len = inputs["hidden_states"].shape[:2]
    mask = inputs["encoder_hidden_states_mask"]
    txt = [sizes.txt_len] * batch if mask is None else mask.sum(1).tolist()
    attention_flops = sum(4 * (img_len + sizes.txt_len) * (img_len + t) * sizes.d for t in txt)  # one call, every head
    ms = attention[0].device_time_total / attention[0].count / 1e3
    row = dict(fp8_attention=fp8_attention, attention_kernel=attention[0].key, attention_ms=ms,
               attention_tflops=attention_flops / ms / 1e9,
               forward_gpu_ms=sum(e.device_time_total for e in events if e.device_type.name == "CUDA") / 1e3)
    block = block_kernels(prof, attention[0].key, sizes.layers)
    row["block_kernels"], row["block_gpu_us"] = len(block), sum(us for _, us in block)
    print(table)
    print(f"fp8_attention={fp8_attention}: attention {ms * 1e3:.1f} us a call, {row['attention_tflops']:.0f} TF/s "
          f"({attention[0].key[:80]}); GPU time of the forward {row['forward_gpu_ms']:.1f} ms; one block: "
          f"{len(block)} kernels and memsets, {row['block_gpu_us']:.0f} us", flush=True)
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"profile_ours_fp8_attention_{fp8_attention}.txt").write_text(
            table + "\nOne block, from its attention kernel to the next block's, in launch order (us, name):\n"
            + "\n".join(f"{us:9.1f}  {name[:150]}" for name, us in block) + "\n")
    return row


def block_kernels(prof, attention_key: str, layers: int) -> list[tuple[str, float]]:
    """The GPU kernels and memsets of the profiled forward from the middle block's attention kernel up to the next
    block's, in start order: (name, microseconds)."""
    gpu = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    starts = [i for i, e in enumerate(gpu) if e.name == attention_key]
    first, last = starts[layers // 2], starts[layers // 2 + 1]
    return [(e.name, e.time_range.elapsed_us()) for e in gpu[first:last]]


def print_table(rows):
    print(f"\n{'impl':22} {'attn':8} {'res':10} {'B':>2} {'pad':>4} {'ms':>8} {'TF/s':>6} {'rel_err':>9} "
          f"{'GiB':>6} {'x floor':>7}")
    for r in rows:
        print(f"{r['impl']:22} {r['attention']:8} {r['resolution']:10} {r['batch']:2d} {str(r['padded_text']):>4} "
              f"{r['ms']:8.1f} {r['tflops']:6.0f} {r['rel_err']:9.2e} {r['peak_gib']:6.1f} {r['ms_over_floor']:7.2f}")


if __name__ == "__main__":
    main()
