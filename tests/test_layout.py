"""The package's layout holds: every module imports, no import cycles, imports run the right way between folders."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Set

import pytest

PKG = Path(__file__).resolve().parents[1] / "rlhpc"
# Modules that need an optional dependency (vLLM) to import.
OPTIONAL = {"rlhpc.infer.engines.vllm": "vllm", "rlhpc.infer.engines.disagg": "vllm",
            "rlhpc.env.verifiers_harness": "verifiers"}


def module_names() -> List[str]:
    names = []
    for path in sorted(PKG.rglob("*.py")):
        parts = path.relative_to(PKG.parent).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def _resolve(name: str, known: Set[str]) -> str | None:
    """The rlhpc module an imported name refers to (`rlhpc.algo.loss.check` -> `rlhpc.algo.loss`)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, known: Set[str]) -> Set[str]:
    """Every rlhpc module `module` imports, at the top or inside functions, except under `if TYPE_CHECKING:`."""
    path = PKG.parent / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = PKG.parent / module.replace(".", "/") / "__init__.py"
    tree = ast.parse(path.read_text())
    out: Set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets = [f"{node.module}.{a.name}" for a in node.names]
        else:
            targets = []
        for t in targets:
            if t.startswith("rlhpc"):
                r = _resolve(t, known)
                if r and r != module:
                    out.add(r)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    # `from rlhpc.algo import loss` imports rlhpc.algo too (its __init__ runs first); parents of a package's own
    # modules are not dependencies in the sense of a cycle, so they are left out.
    return {m for m in out if not module.startswith(m + ".")}


def graph() -> Dict[str, Set[str]]:
    known = set(module_names())
    return {m: imports_of(m, known) for m in known}


def find_cycle(g: Dict[str, Set[str]]) -> List[str] | None:
    state: Dict[str, int] = {}
    stack: List[str] = []

    def dfs(n: str) -> List[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(g[n]):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (c := dfs(m)):
                return c
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(g):
        if n not in state and (c := dfs(n)):
            return c
    return None


def test_every_module_imports_in_a_fresh_interpreter():
    names = [n for n in module_names() if n not in OPTIONAL or importlib.util.find_spec(OPTIONAL[n])]
    code = "import importlib, sys\nfor n in sys.argv[1:]: importlib.import_module(n)"
    out = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]


def test_the_import_graph_has_no_cycle():
    assert find_cycle(graph()) is None, f"import cycle: {' -> '.join(find_cycle(graph()))}"


def test_a_planted_cycle_is_found():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("folder", ["rlhpc.train", "rlhpc.infer", "rlhpc.transport", "rlhpc.algo", "rlhpc.env"])
def test_roles_and_their_parts_never_import_a_launcher(folder):
    g = graph()
    wrong = {m: sorted(i for i in deps if i.startswith("rlhpc.cluster") or i in ("rlhpc.launch", "rlhpc.role", "rlhpc.sft"))
             for m, deps in g.items() if m == folder or m.startswith(folder + ".")}
    assert not {m: d for m, d in wrong.items() if d}, wrong



# What the inference role takes from the trainer's folder (docs/code-map.md): the held-out schedule and results, and
# GLM-5's indexer, so that generation chooses the keys the trainer's forward chooses.
INFER_FROM_TRAIN = {"rlhpc.run.evaluation", "rlhpc.modeling.sparse"}


def test_inference_takes_from_the_trainers_folder_only_what_the_code_map_names():
    g = graph()
    taken = {d for m, deps in g.items() if m.startswith("rlhpc.infer") for d in deps if d.startswith("rlhpc.train")}
    assert taken <= INFER_FROM_TRAIN, sorted(taken - INFER_FROM_TRAIN)

# The entry points of the role processes and of the standalone commands.
ENTRY_POINTS = ["rlhpc.role", "rlhpc.sft", "rlhpc.serve", "rlhpc.eval"]
# All they take from the launcher side: who a Slurm task is (read from Slurm's environment, not from a launcher). The
# config folder and the run-directory setup they share with `rlhpc.launch` live in rlhpc.config.schema and rlhpc.preflight.checks.
FROM_LAUNCHERS = {"rlhpc.run.slurm_identity.identity_from_slurm"}


def launcher_names(source: str) -> Set[str]:
    """The names a module's source imports from rlhpc.launch or rlhpc.cluster, anywhere in it."""
    out: Set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return {n for n in out if n.startswith(("rlhpc.launch", "rlhpc.cluster"))}


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_entry_points_take_nothing_more_from_a_launcher(module):
    names = launcher_names((PKG.parent / (module.replace(".", "/") + ".py")).read_text())
    assert names <= FROM_LAUNCHERS, names - FROM_LAUNCHERS


def test_a_planted_launcher_import_is_found():
    source = "import rlhpc.launch\ndef f():\n    from rlhpc.cluster.local import LocalLauncher\n"
    assert launcher_names(source) == {"rlhpc.launch", "rlhpc.cluster.local.LocalLauncher"}


def test_the_ground_floor_imports_no_concern_folder():
    ground = {"rlhpc.config.schema", "rlhpc.run.rundir", "rlhpc.run.metrics", "rlhpc.modeling.models", "rlhpc.modeling.names", "rlhpc.modeling.dtypes",
              "rlhpc.run.procs", "rlhpc.run.identity", "rlhpc.run.stop", "rlhpc.run.summary", "rlhpc.plots"}
    folders = ("rlhpc.train", "rlhpc.infer", "rlhpc.transport", "rlhpc.algo", "rlhpc.env", "rlhpc.cluster")
    g = graph()
    wrong = {m: sorted(d for d in g[m] if d.startswith(folders)) for m in ground if m in g}
    assert not {m: d for m, d in wrong.items() if d}, wrong


def test_no_module_of_the_package_uses_unittest_mock():
    users = [str(p) for p in PKG.rglob("*.py") if "unittest" in p.read_text()]
    assert not users, users
