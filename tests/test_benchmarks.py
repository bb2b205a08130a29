"""Every script in benchmarks/ runs in its tiny CPU mode (tiny components or shapes, Triton's interpreter, seconds),
so that a refused argument or a changed API fails here instead of in a GPU run days later. A tiny run records
nothing: benchmarks/results/ is the same after it. The GPU runs themselves are not checked here (the device tool)."""

import hashlib
import importlib.util
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
MODULES = {"common.py"}  # imported by the scripts, never run
# script -> its tiny command's arguments ({tmp}: a fresh folder). Tools that only ever run on the CPU take their
# usual arguments: summarize.py (tables of the recorded rows), qwen_bpe_tokenizer.py (a tokenizer folder).
TINY = {
    "bench_cache.py": ["--tiny"],
    "bench_checkpoint.py": ["--tiny"],
    "bench_edit.py": ["--tiny"],
    "bench_fp8_attention.py": ["--tiny"],
    "bench_gemv.py": ["--tiny"],
    "bench_kernels.py": ["--tiny"],
    "bench_lightning.py": ["--tiny"],
    "bench_lora.py": ["--tiny"],
    "bench_memory.py": ["--tiny"],
    "bench_memory.py --budgets": ["--tiny", "--budgets", "0.4", "--prompts", "1"],  # the 16 GiB rows' path
    "bench_parallel.py": ["--tiny"],  # under torchrun, 2 processes on gloo
    "bench_pipeline.py": ["--tiny"],
    "bench_qwen21.py": ["--pipeline", "--tiny", "--cache", "every:2,1,0", "--steps6", "--fp8-attention",
                        "--memory-low", "--memory-batches", "1,2"],
    "bench_ray.py": ["--tiny"],  # a local Ray cluster per run, started by the command
    "bench_serve.py": ["--tiny", "--port", "0", "--out", "{tmp}/out"],  # a folder not made yet
    "bench_text.py": ["--tiny"],
    "bench_transformer.py": ["--tiny"],
    "bench_vae.py": ["--tiny"],
    "compare_stock_vs_fast.py": ["--model", "tiny-random", "--prompts", "tests/fixtures/two_prompts.txt", "--out",
                                 "{tmp}"],
    "gpu_tests.py": ["run", "--tiny", "--of", "2", "--out", "{tmp}"],
    "qwen_bpe_tokenizer.py": ["{tmp}/tokenizer"],
    "summarize.py": [],
    "sweep_fa4_tiles.py": ["--tiny"],
    "sweep_gemm_epilogue.py": ["--tiny"],
    "sweep_row_warps.py": ["--tiny"],
}


def results_digest() -> dict[str, str]:
    return {p.name: hashlib.sha1(p.read_bytes()).hexdigest() for p in sorted((BENCHMARKS / "results").iterdir())}


def test_every_script_has_a_tiny_command():
    scripts = {p.name for p in BENCHMARKS.glob("*.py")} - MODULES
    commands = {name.split()[0] for name in TINY}  # "SCRIPT --option": a second tiny command of SCRIPT
    assert scripts == commands, f"without a tiny command: {sorted(scripts - commands)}; gone: {sorted(commands - scripts)}"


@pytest.mark.parametrize("script", sorted(TINY))
def test_tiny_mode_runs_and_records_nothing(script, tmp_path, monkeypatch):
    """Each script as `python3 SCRIPT ARGS` would run it, in this process (runpy, as __main__: the ~5 s of importing
    torch and diffusers again per script was a quarter of this module's time), bench_parallel.py under torchrun."""
    args = [a.replace("{tmp}", str(tmp_path)) for a in TINY[script]]
    script = script.split()[0]
    before = results_digest()
    if script == "bench_parallel.py":
        env = {**os.environ, "TRITON_INTERPRET": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                               str(BENCHMARKS / script), *args], cwd=BENCHMARKS.parent, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    else:
        monkeypatch.chdir(BENCHMARKS.parent)
        monkeypatch.setattr(sys, "argv", [str(BENCHMARKS / script), *args])
        monkeypatch.setattr(sys, "path", [str(BENCHMARKS), *sys.path])  # as for a script: its folder first
        default_dtype = torch.get_default_dtype()
        try:
            runpy.run_path(str(BENCHMARKS / script), run_name="__main__")
        except SystemExit as e:
            assert e.code in (None, 0), f"{script} exited with {e.code}"
        finally:
            torch.set_default_dtype(default_dtype)
    assert results_digest() == before, f"{script} --tiny wrote to benchmarks/results/"


def test_the_gpu_suite_refuses_to_start_without_a_package_its_tests_import(tmp_path, monkeypatch, capsys):
    """gpu_tests.py run names what is missing and starts nothing (a GPU run without gguf errored in its single-file
    tests minutes in)."""
    import argparse

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import gpu_tests

    monkeypatch.setitem(gpu_tests.GPU_TEST_PACKAGES, "no_such_package_here", "a test")
    args = argparse.Namespace(tiny=False, out=tmp_path / "out", of=2, shards=[1, 2], pytest_args=[])
    assert gpu_tests.run(args) == 2 and not (tmp_path / "out").exists()
    err = capsys.readouterr().err
    assert "not installed here: " in err and "no_such_package_here (a test)" in err
    for name in ("cudnn", "flash_attn_interface"):  # the FP8-attention kernels' packages are required too
        assert name in gpu_tests.GPU_TEST_PACKAGES
        assert (f"{name} (" in err) == (importlib.util.find_spec(name) is None), name
