"""One image on several processes (gloo on the CPU): CFG-parallel, Ulysses and both give the single-process fast
pipeline's latents; bad setups fail before anything is converted."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from diffusers import QwenImagePipeline

from helpers import assert_close
from qwen_image_fast.pipelines.core.optimizations import EXACT_TOL
from qwen_image_fast import FastConfig, optimize
from qwen_image_fast.pipelines.qwen_image.text_to_image import check_parallel_setup
from qwen_image_fast.pipelines.core.runtime.parallel import MeshShape, UlyssesPlan, even_sizes
from qwen_image_fast.pipelines.tiny import tiny_pipeline

sys.path.insert(0, str(Path(__file__).parents[1]))
from parallel_worker import CASES, TRANSFORMER, render  # noqa: E402

WORKER = Path(__file__).parents[1] / "parallel_worker.py"


@pytest.fixture(scope="module")
def stock_latents():
    """Stock diffusers' latents for the worker's cases (a list prompt with one negative string: one per prompt)."""
    pipe = tiny_pipeline(QwenImagePipeline, 0, TRANSFORMER)
    pipe.set_progress_bar_config(disable=True)
    results = []
    for seed, case in enumerate(CASES):
        prompts = case["prompt"]
        negative = ([case["negative_prompt"]] * len(prompts) if isinstance(prompts, list) else case["negative_prompt"])
        results.append(render(pipe, case | {"negative_prompt": negative}, seed))
    return results


@pytest.fixture(scope="module")
def single_process_applied():
    pipe = optimize(tiny_pipeline(QwenImagePipeline, 0, TRANSFORMER), FastConfig(fp8=False, cuda_graphs=False))
    pipe.set_progress_bar_config(disable=True)
    render(pipe, CASES[0], 0)
    return pipe.applied


def image_tokens(height: int, width: int) -> int:
    scale = 2 * tiny_pipeline(QwenImagePipeline, 0, TRANSFORMER).vae_scale_factor  # VAE, then 2x2 patches
    return (height // scale) * (width // scale)


def launch(tmp_path, nproc: int, runs: list[str], graphs: bool = False) -> dict[tuple[int, int], dict]:
    """torchrun the worker over `runs` (PARALLEL[/ULYSSES[/CACHE]] each, one after the other in the same
    processes: one launch's startup for them all); {(rank, run index): what that image group leader saved}."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(WORKER), str(tmp_path), *runs, *(["--graphs"] if graphs else [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    saved = {}
    for f in sorted(tmp_path.glob("rank*-run*.pt")):
        rank, run = f.stem[len("rank"):].split("-run")
        saved[int(rank), int(run)] = torch.load(f)
    return saved


# 4 ranks: (the run, its image group leaders, its labels)
AGAINST_STOCK = [
    ("cfg,ulysses/0", [0], ["parallel:cfg2", "parallel:ulysses2"]),
    ("ulysses/2", [0, 2], ["parallel:ulysses2"]),  # two data-parallel groups of 2
]


def test_parallel_against_stock(tmp_path, stock_latents, single_process_applied):
    """The registry's checks of the parallel optimization (test_optimizations.py's case points here), with gloo
    processes under torchrun, each of AGAINST_STOCK's runs in one launch of 4: (a) its labels are what it adds to
    the single-process run's `applied`, which loses batched_cfg where CFG-parallel runs the negative prompt on the
    other rank; (b) the latents equal stock diffusers' (fp32, 1e-5); (c) each rank's forwards hold a part only: one
    of prompt / negative prompt with CFG-parallel, its slice of the tokens in the blocks with Ulysses, whose BF16
    GEMMs around the blocks (img_in, txt_in, proj_out) take all rows, as on one GPU (cuBLAS rounds a row by the row
    count it picks a kernel for)."""
    every = launch(tmp_path, 4, [run for run, _, _ in AGAINST_STOCK])
    for i, (run, leaders, labels) in enumerate(AGAINST_STOCK):
        parallel = run.split("/")[0]
        saved = {rank: results for (rank, j), results in every.items() if j == i}
        assert sorted(saved) == leaders, run
        expected = [label for label in single_process_applied if not (label == "batched_cfg" and "cfg" in parallel)]
        for rank, results in saved.items():
            for case, got, want in zip(CASES, results["latents"], stock_latents):
                assert got.shape == want.shape, case
                assert_close(got, want, EXACT_TOL, f"{run}, rank {rank}, {case}")
            for entries in results["applied"]:
                assert [e for e in entries if not e.startswith("parallel:")] == expected, run
                assert [e for e in entries if e.startswith("parallel:")] == labels, run
            rows = results["rows"]  # the first forward of the first case (40x24): 2 ranks share its tokens
            batch, image, text = 1 if "cfg" in parallel else 2, image_tokens(40, 24), rows["txt_in"][1]
            assert rows["img_in"] == rows["proj_out"] == (batch, image) and rows["txt_in"][0] == batch, rows
            assert rows["block_img"] == (batch, even_sizes(image, 2)[0]), rows
            assert rows["block_txt"] == (batch, even_sizes(text, 2)[0]) and text >= 2, rows
        assert [results["dp_rank"] for results in saved.values()] == list(range(len(leaders))), run


def test_parallel_graphs_over_calls_in_a_row(tmp_path, stock_latents):
    """Two ranks, CUDA graphs (the CPU stand-in), CFG-parallel then Ulysses in one launch, the cases one call after
    another (other prompts, text lengths, sizes, batches and step counts; the last replays graphs the first call
    captured): every call equals stock, and every tensor a captured forward read from outside is owned by the graph
    store (graph_stand_in.py). A Ulysses layout made anew each call, its index tensors not kept by the graph that
    reads them, is what crashed the second call on two GPUs (an index out of bounds in the replay)."""
    runs = ["cfg", "ulysses"]
    saved = launch(tmp_path, 2, runs, graphs=True)
    assert sorted(saved) == [(0, i) for i in range(len(runs))]
    for (_, i), results in saved.items():
        parallel = runs[i]
        for case, got, want in zip(CASES, results["latents"], stock_latents):
            assert_close(got, want, EXACT_TOL, f"{parallel}, {case}")
        log = results["graphs"]
        assert not log["unowned"], f"{parallel}: read by a graph that does not own them: {log['unowned']}"
        assert log["captures"] and len(log["replays"]) > len(CASES), log  # captured, and replayed across calls
        assert all("cuda_graphs" in applied and f"parallel:{parallel}2" in applied
                   for applied in results["applied"]), results["applied"]


STEP_CACHES = ("every:2,1,0", "dbcache:1,0,0.71,w=0")


def test_cfg_parallel_with_a_step_cache_equals_one_process(tmp_path):
    """CFG-parallel (2 ranks: the prompt on one, the negative prompt on the other) with FastConfig.cache, each rule
    in STEP_CACHES (in one launch): each rank keeps its branch's cache state and decides as the single-process run
    decides for that branch; the same latents. The threshold 0.71 sits between the first case's branches
    (second-step differences 0.699 and 0.721 here): one branch reuses its middle blocks, the other computes them."""
    saved = launch(tmp_path, 2, [f"cfg/0/{cache}" for cache in STEP_CACHES])
    assert sorted(saved) == [(0, i) for i in range(len(STEP_CACHES))]
    for i, cache in enumerate(STEP_CACHES):
        one = optimize(tiny_pipeline(QwenImagePipeline, 0, TRANSFORMER), FastConfig(fp8=False, cuda_graphs=False,
                                                                                   cache=cache))
        one.set_progress_bar_config(disable=True)
        expected, decisions = [], []
        for seed, case in enumerate(CASES):
            expected.append(render(one, case, seed))
            decisions.append({b: [c for c, _ in branch.decisions]
                              for b, branch in one._last_step_cache.branches.items()})
        results = saved[0, i]
        for case, got, want in zip(CASES, results["latents"], expected):
            assert_close(got, want, EXACT_TOL, f"{cache}, {case}")
        assert all(f"step_cache:{FastConfig(cache=cache).cache.label()}" in applied for applied in results["applied"])
        assert all("parallel:cfg2" in applied for applied in results["applied"])
        if cache.startswith("dbcache"):
            assert decisions[0] == {"cond": [True, False], "uncond": [True, True]}, decisions[0]


def test_ulysses_plan_splits_without_padding_and_restores_the_order():
    assert even_sizes(9, 4) == [3, 2, 2, 2]
    plans = [UlyssesPlan(9, 5, 4, rank, torch.device("cpu")) for rank in range(4)]
    assert [p.img for p in plans] == [slice(0, 3), slice(3, 5), slice(5, 7), slice(7, 9)]
    assert [p.txt for p in plans] == [slice(0, 2), slice(2, 3), slice(3, 4), slice(4, 5)]
    gathered = torch.cat([torch.cat([torch.arange(9)[p.img], 100 + torch.arange(5)[p.txt]]) for p in plans])
    joint = gathered[plans[0].to_joint]
    assert joint.tolist() == list(range(9)) + [100 + i for i in range(5)]  # [image | text], the 1-GPU layout
    assert torch.equal(joint[plans[0].to_gathered], gathered)
    with pytest.raises(ValueError, match="at least 4 image and text tokens"):
        UlyssesPlan(3, 5, 4, 0, torch.device("cpu"))


@pytest.mark.parametrize("parallel, ulysses, world, heads, message", [
    ("cfg", 0, 3, 24, "does not divide the world size 3"),
    ("ulysses", 0, 5, 24, "does not divide the transformer's 24 attention heads"),
    ("cfg,ulysses", 3, 8, 24, "does not divide the world size 8"),
    ("ulysses", 0, 1, 24, "needs at least 2 ranks"),
    ("cfg,ulysses", 0, 2, 24, "needs at least 2 ranks"),
])
def test_bad_mesh_names_the_degrees(parallel, ulysses, world, heads, message):
    with pytest.raises(ValueError, match=message):
        MeshShape.resolve(parallel, ulysses, world, heads)


def test_mesh_shapes():
    assert MeshShape.resolve("cfg,ulysses", 0, 8, 24) == MeshShape(2, 4, 8)
    shape = MeshShape.resolve("cfg,ulysses", 2, 8, 24)
    assert (shape.cfg, shape.ulysses, shape.dp) == (2, 2, 2)
    assert MeshShape.resolve("cfg", 0, 6, 24).dp == 3


@pytest.mark.parametrize("kwargs, message", [
    (dict(parallel="tensor"), "parallel='tensor'; allowed: none, cfg, ulysses, cfg,ulysses"),
    (dict(parallel="cfg", ulysses_degree=2), "ulysses_degree=2 needs parallel='ulysses'"),
    (dict(parallel="ulysses", ulysses_degree=-1), "ulysses_degree=-1"),
    (dict(parallel="ulysses", fused_transformer=False, fp8=False), "keep fused_transformer=True"),
])
def test_bad_parallel_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FastConfig(**kwargs)


def test_parallel_without_a_process_group_fails_before_converting():
    pipe = tiny_pipeline(QwenImagePipeline, 0, TRANSFORMER)
    with pytest.raises(RuntimeError, match="needs an initialised torch.distributed process group: launch with `torchrun"):
        optimize(pipe, FastConfig(fp8=False, parallel="cfg"))
    assert type(pipe) is QwenImagePipeline and type(pipe.transformer).__name__ == "QwenImageTransformer2DModel"
    with pytest.raises(RuntimeError, match="process group"):
        check_parallel_setup(FastConfig(parallel="ulysses"))


@pytest.fixture
def one_process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_in_a_group_of_one(one_process_group):
    with pytest.raises(ValueError, match="needs at least 2 ranks"):
        optimize(tiny_pipeline(QwenImagePipeline, 0, TRANSFORMER), FastConfig(fp8=False, parallel="ulysses"))
    pipe = optimize(tiny_pipeline(QwenImagePipeline, 0, TRANSFORMER), FastConfig(fp8=False, cuda_graphs=False))
    assert pipe.parallel is None  # a process group alone changes nothing
    with pytest.raises(ValueError, match="does not divide the world size 1"):
        optimize(tiny_pipeline(QwenImagePipeline, 0, TRANSFORMER), FastConfig(fp8=False, parallel="cfg"))


def test_cfg_parallel_needs_cfg_and_the_family_refuses_parallel(one_process_group, monkeypatch):
    from diffusers import QwenImageImg2ImgPipeline

    with pytest.raises(ValueError, match="supported by the text-to-image QwenImageFastPipeline only"):
        optimize(tiny_pipeline(QwenImageImg2ImgPipeline), FastConfig(fp8=False, parallel="cfg"))
    # a group of one cannot hold a CFG pair; the call-time check is the same for any group
    monkeypatch.setattr(MeshShape, "resolve", classmethod(lambda cls, *args: cls(2, 1, 2)))
    monkeypatch.setattr(dist, "new_group", lambda ranks: None)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    pipe = optimize(tiny_pipeline(QwenImagePipeline, 0, TRANSFORMER),
                    FastConfig(fp8=False, cuda_graphs=False, parallel="cfg"))
    for kwargs in (dict(true_cfg_scale=1.0, negative_prompt="bad"), dict(true_cfg_scale=4.0)):
        with pytest.raises(ValueError, match=r"needs CFG: true_cfg_scale > 1 \(got .*\) and a negative prompt"):
            pipe(prompt="a cat", height=32, width=32, num_inference_steps=2, output_type="latent", **kwargs)
