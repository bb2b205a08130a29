"""Test setup. Runs before any test module imports triton (diffusers imports it too)."""

import os

import torch

# Without CUDA, Triton kernels run in its interpreter; this must be set before `import triton`.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
# Every launcher output starts as NaN, so an element a kernel forgets to write fails the comparison.
os.environ["QWEN_IMAGE_FAST_POISON"] = "1"
# No hub access here or in CI; without this each missing hub file costs ~30 s of retries.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import sys  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture
def small_condition_images():
    """The edit and layered pipelines' input images at 1/256 of their area, the same for stock and fast (what the
    command line does for test-size models: pipelines/tiny.py)."""
    from qwen_image_fast.pipelines.tiny import small_condition_images

    with small_condition_images():
        yield


@pytest.fixture(autouse=True)
def _condition_image_sizes_restored():
    """A test that leaves diffusers' calculate_dimensions patched (pipelines/tiny.py's small_condition_images entered
    and not left) fails here, not in the test that runs next in its process (whose shrinking would then apply
    twice)."""
    yield
    tiny = sys.modules.get("qwen_image_fast.pipelines.tiny")
    if tiny is None:
        return
    patched = [name for name in tiny.CONDITION_IMAGE_PIPELINES if name in sys.modules
               and getattr(sys.modules[name].calculate_dimensions, "__name__", "") == "<lambda>"]
    if patched:
        for name in patched:  # the next test starts from diffusers' own
            sys.modules[name].calculate_dimensions = sys.modules[name].calculate_dimensions.__defaults__[0]
        pytest.fail(f"this test left calculate_dimensions patched in {patched}")


@pytest.fixture(autouse=True)
def _release_gpu_memory(request):
    """After each GPU test, what it left unreferenced is freed and the allocator's cache emptied: the GPU tests run
    in one process, and on an 80 GiB card the step caches' test (two pipelines per config, ten configs) ran out of
    memory after the others had run."""
    yield
    if "gpu" in request.keywords and torch.cuda.is_available():
        import gc

        gc.collect()
        torch.cuda.empty_cache()


def pytest_addoption(parser):
    parser.addoption("--gpu-shard", default=None, metavar="K/N",
                     help="run the K-th of N parts of the selected tests (every N-th in collection order, from the "
                          "K-th): the GPU suite in parts that each fit a 10-minute GPU run (benchmarks/gpu_tests.py)")
    parser.addoption("--report-json", default=None, metavar="FILE",
                     help="write each test's outcome, duration and skip reason to FILE (benchmarks/gpu_tests.py)")


def pytest_collection_modifyitems(config, items):
    shard = config.getoption("--gpu-shard")
    if shard:
        k, n = (int(x) for x in shard.split("/"))
        if not 1 <= k <= n:
            raise pytest.UsageError(f"--gpu-shard {shard}: K must be in 1..N")
        config.hook.pytest_deselected(items=[item for i, item in enumerate(items) if i % n != k - 1])
        items[:] = [item for i, item in enumerate(items) if i % n == k - 1]
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


_outcomes: dict = {}


def pytest_runtest_logreport(report):
    """--report-json: a test's outcome is its call's, or its setup's or teardown's where that failed or skipped."""
    entry = _outcomes.setdefault(report.nodeid, {"outcome": "passed", "duration_s": 0.0})
    entry["duration_s"] += report.duration
    if report.failed:
        entry["outcome"] = "error" if report.when != "call" else "failed"
        entry.setdefault("message", str(report.longrepr)[-2000:])
    elif report.skipped and entry["outcome"] == "passed":
        entry["outcome"] = "skipped"
        entry["reason"] = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)


def pytest_sessionfinish(session):
    path = session.config.getoption("--report-json", None)
    if path:
        import json

        with open(path, "w") as f:
            json.dump({"shard": session.config.getoption("--gpu-shard"), "tests": _outcomes}, f, indent=1)


@pytest.fixture
def stand_in_graphs(monkeypatch):
    """CUDA graphs on the CPU: the registry lets them run, and a stand-in for the capture records it and replays
    by running the captured function on the captured static inputs (the GPU tests of test_pipeline.py and
    test_family.py replay real graphs); it also checks that the graph store owns every tensor a captured forward
    reads from outside (graph_stand_in.py), and the test fails at its end if one was not. Returns the log: the
    batch of each capture and of each replay, in order."""
    from graph_stand_in import install

    log = install(monkeypatch.setattr)
    yield log
    assert not log["unowned"], f"a captured forward read tensors its graph does not own: {log['unowned']}"
