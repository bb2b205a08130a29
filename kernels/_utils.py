"""Shared helpers for the launchers: output allocation, argument checks, launch settings, FP8 constants."""

import os

import torch
import triton
import triton.language as tl

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value; kernels clamp to it before the cast (the interpreter does not saturate)
FP8_AMAX_EPS = 1e-12  # an all-zero row gets scale eps / 448 instead of 0


def poison_outputs() -> bool:
    """Tests set QWEN_IMAGE_FAST_POISON=1: every launcher output then starts as NaN, so an unwritten element fails."""
    return os.environ.get("QWEN_IMAGE_FAST_POISON") == "1"


def new_output(shape, dtype: torch.dtype, device) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype, device=device)
    if poison_outputs():
        out.fill_(float("nan"))  # float8_e4m3fn has a NaN code too
    return out


def check_tensor(name: str, t: torch.Tensor, *, dtypes=None, ndim=None, shape=None, device=None):
    """Raise ValueError naming the argument, its value and what is allowed."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() not in ((ndim,) if isinstance(ndim, int) else ndim):
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {t.dtype}; allowed: {', '.join(str(d) for d in dtypes)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (same device as the other inputs)")
    if t.dim() and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# Elements of a program's tile in the row kernels: ~2048 keeps a Hopper program in registers. Triton's interpreter runs
# each program as NumPy operations over its whole tile at a fixed cost per operation, so there a program takes 32x
# more rows (the same kernel code and masks, fewer and larger programs: the CPU tests' time).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
if INTERPRETED:
    from ._interpreter import skip_nested_patches

    skip_nested_patches()
TILE_ELEMENTS = 2048 * (32 if INTERPRETED else 1)


def interpreted_fit(block: int, extent: int) -> int:
    """Under the interpreter, a tile no longer than the power of two covering what it tiles (`extent` rows or
    elements): its NumPy operations run over every element of the tile, masked or not, and a test tensor's few rows
    in a 65536-element tile cost most of a launch. On a GPU, `block` as given (the tuned launch is unchanged)."""
    return min(block, triton.next_power_of_2(max(1, extent))) if INTERPRETED else block


def row_launch(n_cols: int) -> dict:
    """Block width and warps for kernels that keep one row of `n_cols` in registers."""
    block = triton.next_power_of_2(n_cols)
    num_warps = 4 if block <= 2048 else 8 if block <= 8192 else 16
    return dict(BLOCK_N=block, num_warps=num_warps)


def rows_launch(n_rows: int, n_cols: int) -> tuple[tuple[int], dict]:
    """Grid and settings for kernels that hold a [BLOCK_M, BLOCK_N] tile of whole rows in registers: one row per
    program at the real widths (>= 2048), several narrow rows per program (~TILE_ELEMENTS a tile)."""
    settings = row_launch(n_cols)
    block_m = interpreted_fit(max(1, TILE_ELEMENTS // settings["BLOCK_N"]), n_rows)
    return (triton.cdiv(n_rows, block_m),), dict(settings, BLOCK_M=block_m)


MAX_CHUNKS = 4  # the chunked row kernels unroll this many [BLOCK_M, CHUNK] tiles at most
CHUNKED_MIN_COLS = 8192  # rows wider than this are held as chunks; narrower ones as one power-of-two tile


def chunked_rows_launch(n_rows: int, n_cols: int) -> tuple[tuple[int], dict]:
    """Grid and settings for kernels that hold whole rows in registers as NUM_CHUNKS [BLOCK_M, CHUNK] tiles (columns
    c * CHUNK + arange(CHUNK), see chunk_cols). Up to CHUNKED_MIN_COLS: one tile, as rows_launch. Wider: one row a
    program in the power-of-two chunks that cover it with the least padding (then the smallest chunk), 8 warps a
    4096 chunk. 12288, the MLP hidden of the 2512 DiT, Qwen-Image-2.1 and Qwen3.5-9B, is 3 x 4096 instead of a
    16384 tile whose masked quarter still runs every instruction: the activation + FP8 kernels at that width are
    bound by their arithmetic nearly as much as by their bytes."""
    if n_cols <= CHUNKED_MIN_COLS:
        grid, settings = rows_launch(n_rows, n_cols)
        return grid, dict(BLOCK_M=settings["BLOCK_M"], CHUNK=settings["BLOCK_N"], NUM_CHUNKS=1,
                          num_warps=settings["num_warps"])
    chunk, num_chunks = min(((triton.next_power_of_2(triton.cdiv(n_cols, c)), c) for c in range(1, MAX_CHUNKS + 1)),
                            key=lambda split: (split[0] * split[1], split[0]))  # least padding, then smallest chunk
    block_m = interpreted_fit(1 << max(0, (TILE_ELEMENTS // (chunk * num_chunks)).bit_length() - 1), n_rows)  # GPU: 1
    return (triton.cdiv(n_rows, block_m),), dict(BLOCK_M=block_m, CHUNK=chunk, NUM_CHUNKS=num_chunks,
                                                 num_warps=min(16, max(4, chunk // 512)))


def head_block(n_heads: int) -> int:
    """Heads per program for kernels over [BLOCK_H, D] head tiles: 8 heads of 128 dims keep a program's loads wide
    on Hopper."""
    return min(8, triton.next_power_of_2(n_heads))


def rel_rms_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """RMS(out - ref) / RMS(ref) in fp64; NaN anywhere gives inf."""
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30)).item()


@triton.jit
def tile_rows(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's rows [BLOCK_M] (int64), columns [BLOCK_N] and [BLOCK_M, BLOCK_N] in-bounds mask."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    return rows, cols, (rows[:, None] < M) & (cols[None, :] < N)


@triton.jit
def chunk_cols(rows, M, N, c: tl.constexpr, CHUNK: tl.constexpr):
    """Columns [CHUNK] of chunk c of the rows [BLOCK_M] (chunked_rows_launch) and its [BLOCK_M, CHUNK] mask."""
    cols = c * CHUNK + tl.arange(0, CHUNK)
    return cols, (rows[:, None] < M) & (cols[None, :] < N)


# The interpreter runs no PTX: round_to's integer form there.
_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """fp32 x -> the fp32 value of x rounded to DTYPE (round to nearest even), as a cast to DTYPE and back would
    give. Not as that cast pair: Triton on CUDA drops it (an H200 left a quarter of fp16 products unrounded) and
    the interpreter's bf16 cast truncates. bf16 on CUDA: one packed convert for two values, then a shift or a mask
    (the integer form costs ~7 integer ops a value, and integer ops run at half the fp32 rate on Hopper)."""
    if DTYPE == tl.bfloat16:
        if _INTERPRETED:
            return round_to_bf16_bits(x)
        else:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 t; cvt.rn.bf16x2.f32 t, $3, $2; shl.b32 $0, t, 16; and.b32 $1, t, 0xFFFF0000; }",
                "=r,=r,r,r", [x], dtype=tl.float32, is_pure=True, pack=2)
    elif DTYPE == tl.float16:
        return round_to_fp16(x)
    else:
        return x


@triton.jit
def round_to_bf16_bits(x):
    """fp32 -> bf16 round to nearest even through the bit pattern, kept in fp32; NaN stays NaN."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))  # a NaN's payload could carry to inf or 0


@triton.jit
def round_to_fp16(x):
    """fp32 -> fp16 round to nearest even, kept in fp32: subnormals, overflow to inf and NaN as the cast."""
    bits = x.to(tl.uint32, bitcast=True)
    exp = ((bits >> 23) & 0xFF).to(tl.int32)  # fp32 biased exponent: x = sig * 2^(exp - 150)
    sig = (bits & 0x7FFFFF) | 0x800000
    # fp16 keeps 11 significant bits down to 2^-14 (exp 113), below that a fixed quantum of 2^-24
    shift = tl.minimum(tl.maximum(126 - exp, 13), 31).to(tl.uint32)
    q = (sig + (1 << (shift - 1)) - 1 + ((sig >> shift) & 1)) >> shift  # <= 2^11
    pow2 = ((exp - 150 + shift + 127) << 23).to(tl.float32, bitcast=True)  # 2^(exp - 150 + shift), >= 2^-24
    y = tl.where(exp == 0, 0.0, q.to(tl.float32) * pow2)  # fp32 zeros/subnormals are far below fp16's 2^-25
    y = tl.where(y > 65504.0, float("inf"), y)
    y = (y.to(tl.uint32, bitcast=True) | (bits & 0x80000000)).to(tl.float32, bitcast=True)  # Triton's -y is 0 - y
    return tl.where(x != x, x, y)
