"""The package's structure (docs/architecture.md): imports at module level only and pointing
one way (no cycle), and ``import gradzip`` light (no plotting, no scikit-learn, nothing that
torch itself does not already import)."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import gradzip

PACKAGE = Path(gradzip.__file__).parent


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__``)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imported(name: str, path: Path, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The gradzip modules an import statement of module ``name`` names."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "gradzip"]
    if node.level:
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    if base.split(".")[0] != "gradzip":
        return []
    # "from X import y": y is a module of its own when it is one, else an attribute of X
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]


def _imports(name: str, path: Path) -> tuple[set[str], list[str]]:
    """(modules imported anywhere in the module, ``file:line`` of imports inside functions)."""
    tree = ast.parse(path.read_text(), str(path))
    top, nested = set(), []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                targets = _imported(name, path, child)
                if targets and in_function:
                    nested.append(f"{path.relative_to(PACKAGE.parent)}:{child.lineno}")
                top.update(targets)
            visit(child, inside)

    visit(tree, False)
    return top, nested


def test_no_function_level_import_of_a_gradzip_module():
    nested = [where for name, path in MODULES.items() for where in _imports(name, path)[1]]
    assert nested == [], f"imports of gradzip modules inside functions (move them to the top): {nested}"


def test_the_imports_have_no_cycle():
    graph = {name: {m for m in _imports(name, path)[0] if m != name} for name, path in MODULES.items()}
    assert graph["gradzip"] >= {"gradzip.optim", "gradzip.compressors"}  # the walk sees imports
    done: set[str] = set()

    def walk(name: str, stack: list[str]) -> None:
        if name in stack:
            cycle = stack[stack.index(name):] + [name]
            raise AssertionError("import cycle: " + " -> ".join(cycle))
        if name in done:
            return
        for dep in sorted(graph.get(name, ())):
            walk(dep, stack + [name])
        done.add(name)

    for name in graph:
        walk(name, [])


#: The layers of docs/architecture.md, lowest first: a module imports only from its own
#: layer or the ones below.
LAYERS = [
    ("foundations", ("gradzip.errors", "gradzip.version", "gradzip.specs", "gradzip.seeds", "gradzip.trace",
                     "gradzip.units", "gradzip.validation", "gradzip.allocator", "gradzip.files", "gradzip._moved")),
    ("kernels", ("gradzip.kernels",)),
    ("codecs and groups", ("gradzip.compressors", "gradzip.comm")),
    ("guards", ("gradzip.guards",)),
    ("exchange", ("gradzip.exchange",)),
    ("methods", ("gradzip.optim",)),
    ("integrations", ("gradzip.integrations",)),
    ("harness", ("gradzip.train",)),
    ("benchmarks", ("gradzip.bench",)),
    ("command line", ("gradzip.cli", "gradzip.__main__", "gradzip")),
]
#: Packages of one layer that do not import each other: codecs know nothing of workers,
#: groups nothing of packets.
APART = {"gradzip.compressors", "gradzip.comm"}


def _place(module: str) -> tuple[int, str]:
    """(layer index, package) of a module: the longest package prefix in :data:`LAYERS`."""
    best = None
    for i, (_, packages) in enumerate(LAYERS):
        for package in packages:
            if (module == package or module.startswith(package + ".")) and (best is None or len(package) > len(best[1])):
                best = (i, package)
    assert best is not None, f"{module} is in no layer of LAYERS: give it one (and docs/architecture.md)"
    return best


def test_imports_point_down_the_layer_table():
    wrong = []
    for name, path in MODULES.items():
        layer, package = _place(name)
        for dep in _imports(name, path)[0]:
            dep_layer, dep_package = _place(dep)
            if dep_layer > layer or (dep_package != package and {dep_package, package} == APART):
                wrong.append(f"{name} ({LAYERS[layer][0]}) imports {dep} ({LAYERS[dep_layer][0]})")
    assert wrong == [], "imports against the layers:\n" + "\n".join(wrong)


def test_the_package_root_holds_only_foundations_and_the_package_face():
    """The tree shows the layers: every other module lives in its layer's package."""
    loose = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert loose == sorted(["__init__", "__main__", "_moved", "allocator", "errors", "files", "seeds", "specs",
                            "trace", "units", "validation", "version"])


def test_old_module_paths_import_the_same_modules():
    import importlib
    import pickle

    from gradzip import _moved
    for old, new in _moved.MOVED.items():
        assert importlib.import_module(old) is importlib.import_module(new), old
    assert gradzip.hierarchy is importlib.import_module("gradzip.exchange.hierarchy")
    from gradzip.ddp.state import HookState
    from gradzip.integrations.ddp import state
    assert HookState is state.HookState and state.__spec__.name == "gradzip.integrations.ddp.state"
    old_pickle = pickle.dumps(state.HookState, protocol=0).replace(b"gradzip.integrations.ddp.state",
                                                                   b"gradzip.ddp.state")
    assert pickle.loads(old_pickle) is HookState   # a pickle written before the move loads


def test_importing_gradzip_pulls_in_no_plotting_no_sklearn_and_nothing_torch_does_not():
    code = ("import sys, torch; before = set(sys.modules); import gradzip, gradzip.cli; "
            "print(sorted({m.split('.')[0] for m in set(sys.modules) - before}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    added = eval(out.stdout)  # a printed list of names
    assert not {"matplotlib", "sklearn", "scipy", "tqdm"} & set(added), added
    assert "gradzip" in added


def test_a_workers_run_imports_neither_scikit_learn_nor_torch_dynamo():
    """What one worker of ``gradzip train`` does (data, model, optimizer, steps, evaluation,
    a checkpoint), and gradzip's plain optimizers (LARS, LAMB, SAM), import neither
    scikit-learn (with the SciPy modules it loads: longer than ``import torch``) nor
    ``torch._dynamo`` (which torch's optimizer methods import on their first call: about as
    long as ``import torch``) — docs/benchmarks/startup.md."""
    code = ("import sys, tempfile, torch\n"
            "from gradzip.comm import simulate\n"
            "from gradzip.train.config import RunConfig\n"
            "from gradzip.train.loop import run_worker\n"
            "with tempfile.TemporaryDirectory() as ckpt:\n"
            "    cfg = RunConfig(algo='efsgd', options={'compressor': 'topk:ratio=0.1'}, label='efsgd', lr=0.1,\n"
            "                    epochs=1, progress=False, checkpoint_dir=ckpt)\n"
            "    simulate(1, lambda comm: run_worker(comm, cfg))\n"
            "from gradzip.optim import LAMB, LARS, SAM\n"
            "p = torch.nn.Parameter(torch.ones(3))\n"
            "for opt in (LARS([p], lr=0.1), LAMB([p], lr=0.1), SAM(LARS([p], lr=0.1))):\n"
            "    p.grad = torch.ones(3)\n"
            "    opt.step(lambda: (p * p).sum().backward()) if isinstance(opt, SAM) else opt.step()\n"
            "    opt.zero_grad()\n"
            "    opt.load_state_dict(opt.state_dict())\n"
            "print(sorted(m for m in ('sklearn', 'scipy.stats', 'torch._dynamo') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
