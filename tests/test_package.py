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


def module_imports(folder: Path, package: str) -> dict[str, tuple[set, set]]:
    """{module: (modules it imports at module level, modules it imports anywhere)} for the .py files under folder,
    installed as `package`; relative imports resolved, only the project's own modules kept."""
    import ast

    found = {}
    for path in folder.rglob("*.py"):
        parts = list(path.relative_to(folder).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        module = ".".join([package, *parts[:-1]] if is_package else [package, *parts])
        tree = ast.parse(path.read_text())
        top, anywhere = set(), set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module
                names = [f"{target}.{alias.name}" for alias in node.names] + [target]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            names = {n for n in names if n and n.startswith("qwen_image_fast")}
            anywhere |= names
            if node in tree.body:
                top |= names
        found[module] = (top, anywhere)
    return found


def strongly_connected(graph: dict[str, set]) -> list[list[str]]:
    """The cycles of a graph as its strongly connected components of more than one node, each sorted (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return sorted(found)


def project_modules() -> dict[str, tuple[set, set]]:
    modules = {}
    for folder, package in ((REPO / "qwen_image_fast", "qwen_image_fast"), (REPO / "pipelines", "qwen_image_fast.pipelines"),
                            (REPO / "kernels", "qwen_image_fast.kernels")):
        modules |= module_imports(folder, package)
    return modules


def folder_of(module: str, modules: dict) -> str:
    """A module's folder as a package name: itself for a package's __init__, else its parent."""
    return module if f"{module}.__init__" in modules or any(m.startswith(module + ".") for m in modules) else (
        module.rsplit(".", 1)[0])


def module_graph(modules: dict) -> dict[str, set]:
    """Module -> the project's modules it imports anywhere: at module level, inside functions, under TYPE_CHECKING
    (a deferred import still ties the two modules together)."""
    return {m: {n for n in anywhere if n in modules and n != m} for m, (_, anywhere) in modules.items()}


def test_imports_point_one_way_and_have_no_cycle():
    """qwen_image_fast -> pipelines -> kernels, never back; no cycle among modules, deferred imports counted."""
    modules = project_modules()

    def layer(name):
        return ("kernels" if name.startswith("qwen_image_fast.kernels") else
                "pipelines" if name.startswith("qwen_image_fast.pipelines") else "api")

    order = {"api": 2, "pipelines": 1, "kernels": 0}
    for module, (_, anywhere) in modules.items():
        upward = sorted(n for n in anywhere if n != "qwen_image_fast" and order[layer(n)] > order[layer(module)])
        assert not upward, f"{module} imports {upward}: imports point qwen_image_fast -> pipelines -> kernels"
    assert strongly_connected(module_graph(modules)) == [], "import cycles among modules"


# The model families: the leaves of pipelines/, above core/. None imports another (deferred imports counted): what
# two families share is in core/, and a name one family resolves for another goes through a core registry (the
# 2512 pipeline's enhance_prompt=True: core/prompt_enhancer.py, filled in by qwen35/enhance.py).
LEAVES = ("qwen_image_fast.pipelines.qwen_image", "qwen_image_fast.pipelines.qwen_image21",
          "qwen_image_fast.pipelines.qwen35")


def test_no_folders_import_each_other():
    """No cycle among folders either (deferred imports counted): command.py above cli/ and server/, server/ above cli/;
    in pipelines/, core/ below the model families and loading.py above them."""
    modules = project_modules()
    graph = {}
    for m, targets in module_graph(modules).items():
        graph.setdefault(folder_of(m, modules), set()).update(
            folder_of(n, modules) for n in targets if folder_of(n, modules) != folder_of(m, modules))
    for targets in list(graph.values()):
        for t in targets:
            graph.setdefault(t, set())
    assert strongly_connected(graph) == [], "folders that import each other"


def test_no_model_family_imports_another():
    def leaf(module):
        return next((name.rsplit(".", 1)[1] for name in LEAVES if module == name or module.startswith(name + ".")),
                    None)

    found = sorted((m, n) for m, targets in module_graph(project_modules()).items() for n in targets
                   if leaf(m) and leaf(n) and leaf(m) != leaf(n))
    assert found == [], "a model family imports another (move what they share to pipelines/core/)"


def test_the_core_imports_no_model_family():
    """pipelines/core/ is below the families: nothing in it imports a family, loading.py or tiny.py (deferred imports
    counted), so a family can be added or removed without touching it."""
    above = (*LEAVES, "qwen_image_fast.pipelines.loading", "qwen_image_fast.pipelines.tiny")
    found = sorted((m, n) for m, targets in module_graph(project_modules()).items()
                   if m.startswith("qwen_image_fast.pipelines.core") for n in targets
                   if any(n == a or n.startswith(a + ".") for a in above))
    assert found == []
