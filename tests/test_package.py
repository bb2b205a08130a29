"""The install layout: kernels/ and pipelines/ only exist as qwen_image_fast.kernels / .pipelines."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PROBE = """
import importlib.util, json
import qwen_image_fast.kernels, qwen_image_fast.pipelines
def origin(name):
    spec = importlib.util.find_spec(name)
    return None if spec is None else (spec.origin or str(list(spec.submodule_search_locations or [])))
print(json.dumps({
    "kernels": origin("kernels"),
    "pipelines": origin("pipelines"),
    "ours": [qwen_image_fast.kernels.__file__, qwen_image_fast.pipelines.__file__],
}))
"""


def test_no_top_level_kernels_or_pipelines(tmp_path):
    # Run outside the repo so the working directory is not on sys.path: only the installed layout counts.
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, capture_output=True, text=True, check=True)
    found = json.loads(out.stdout)
    assert found["ours"] == [str(REPO / "kernels" / "__init__.py"), str(REPO / "pipelines" / "__init__.py")]
    for name in ("kernels", "pipelines"):
        # Hugging Face's `kernels` may be installed; what must not exist is a top-level module of ours.
        assert found[name] is None or str(REPO) not in found[name], f"top-level {name!r} resolves to {found[name]}"


def test_benchmarks_not_installed(tmp_path):
    code = "import importlib.util; print(importlib.util.find_spec('benchmarks'))"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "None"


def test_wheel_has_only_the_qwen_image_fast_top_level(tmp_path):
    # A regular (non-editable) install is what users get: every file in the wheel sits under qwen_image_fast/.
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(REPO)],
        check=True, capture_output=True,
    )
    import zipfile

    (wheel,) = tmp_path.glob("qwen_image_fast-*.whl")
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"qwen_image_fast"}, tops
    names = zipfile.ZipFile(wheel).namelist()
    assert "qwen_image_fast/kernels/fp8.py" in names and "qwen_image_fast/pipelines/__init__.py" in names
