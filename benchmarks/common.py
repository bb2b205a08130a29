"""Shared by the GPU benchmarks: timing, hardware ceilings measured in the same run, and the results log."""

import datetime
import hashlib
import json
import os
import subprocess
import time
from pathlib import Path

import torch
import triton

RESULTS = Path(__file__).resolve().parent / "results"


def sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench_ms(fn, warmup_ms: int = 50, rep_ms: int = 300) -> float:
    """Median milliseconds of fn() with CUDA events (triton.testing.do_bench), after warm-up. Without a GPU (a
    script's --tiny run on the CPU, a check of its logic): the median of three calls after one, by the wall clock."""
    if not torch.cuda.is_available():
        fn()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return sorted(times)[1] * 1e3
    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def default_device() -> torch.device:
    """cuda where there is a GPU, else the CPU (--tiny runs)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def copy_bandwidth_gbps(n_bytes: int = 2 << 30) -> float:
    """Device-to-device copy of a 2 GiB buffer: (bytes read + bytes written) / time."""
    src = torch.empty(n_bytes, dtype=torch.uint8, device=default_device()).random_()
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * n_bytes / ms / 1e6


def matmul_tflops(m: int, n: int, k: int, fp8: bool, fast_accum: bool = False) -> float:
    """TF/s of one large GEMM on random data: bf16 torch.mm, or rowwise-FP8 torch._scaled_mm (fast_accum: Hopper's
    faster FP8 accumulation, as the models run their GEMMs by default)."""
    device = default_device()
    a = torch.randn(m, k, device=device)
    b = torch.randn(n, k, device=device)
    if fp8:
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
        sa, sb = torch.ones(m, 1, device=device), torch.ones(1, n, device=device)
        ms = bench_ms(lambda: torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                               use_fast_accum=fast_accum))
    else:
        a16, b16 = a.bfloat16(), b.bfloat16()
        ms = bench_ms(lambda: a16 @ b16.t())
    return 2 * m * n * k / ms / 1e9


def environment() -> dict:
    import importlib.metadata as md

    def version(name):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    def git(*args):
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, cwd=RESULTS.parent).stdout.strip()
        except OSError:
            return ""

    diff = git("diff", "--", ".", ":!benchmarks/results")
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        # the device machine gets the work tree without .git: the command passes the commit in BENCH_COMMIT
        "commit": os.environ.get("BENCH_COMMIT") or git("rev-parse", "--short", "HEAD") or None,
        # results/*.jsonl are appended by the runs themselves: not a code change
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks/results")),
        "diff_sha1": hashlib.sha1(diff.encode()).hexdigest()[:12] if diff else None,  # ties a dirty run to its code
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "diffusers": version("diffusers"),
        "torchao": version("torchao"),
        "flash_attn_4": version("flash-attn-4"),
        "transformers": version("transformers"),
        "fla_core": version("fla-core"),
    }


def append_results(name: str, rows: list[dict], out_dir: Path | None = None):
    """Append one JSON object per row to results/<name>.jsonl (and to out_dir, when the run's files travel back)."""
    for folder in filter(None, (RESULTS, out_dir)):
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / f"{name}.jsonl", "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


# ---- random full-size text encoders (bench_edit.py, bench_qwen21.py)

def vision_tokenizer(tokenizer_dir: Path):
    """A Qwen BPE tokenizer folder (qwen_bpe_tokenizer.py) with Qwen's vision tokens added."""
    from transformers import Qwen2Tokenizer

    from qwen_image_fast.pipelines.tiny import VISION_TOKENS

    tokenizer = Qwen2Tokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    return tokenizer


def vision_token_ids(tokenizer) -> dict:
    """The VL configs' vision token id fields."""
    from qwen_image_fast.pipelines.tiny import VISION_TOKENS

    names = ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id")
    return dict(zip(names, tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))))


def random_on_gpu(model_class, config):
    """model_class(config) with random bf16 weights, built in place on the GPU (8B parameters in seconds)."""
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            return model_class(config).eval()
    finally:
        torch.set_default_dtype(default_dtype)
