"""The package's layout holds: every module imports, no import cycles, imports run the right way between folders."""

from __future__ import annotations

import ast
import io
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


# ---- the folder graph ------------------------------------------------------------------------------------------------

# The top floor: the commands users type (`python -m rlhpc.<name>`) and the reference of every command.
TOP_FLOOR = {"rlhpc", "rlhpc.launch", "rlhpc.role", "rlhpc.sft", "rlhpc.serve", "rlhpc.eval", "rlhpc.status",
             "rlhpc.plots", "rlhpc.commands"}
# Which folders each folder may import directly (docs/code-map.md draws it). Every folder of the package is here, and
# the table itself is one-way: a folder never reaches itself, however indirectly.
ALLOWED: Dict[str, Set[str]] = {
    "config": set(),
    "patches": set(),
    "modeling": {"config", "patches"},
    "run": {"config", "modeling"},
    "algo": {"config"},
    "transport": {"config", "modeling", "run"},
    "env": {"config", "modeling", "patches", "run"},
    "infer": {"config", "patches", "modeling", "run", "algo", "transport", "env"},
    "train": {"config", "patches", "modeling", "run", "algo", "transport", "env"},
    "preflight": {"config", "modeling", "run", "algo", "env", "infer", "train"},
    "cluster": {"config", "patches", "modeling", "run", "preflight"},
    "top": {"config", "patches", "modeling", "run", "algo", "transport", "env", "infer", "train", "preflight",
            "cluster"},
}


def folder_of(module: str) -> str:
    """`rlhpc.train.step` -> "train"; a module of the top floor -> "top"."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (PKG / parts[1]).is_dir()) else "top"


def folder_graph(g: Dict[str, Set[str]]) -> Dict[str, Dict[str, List[str]]]:
    """folder -> folder it imports -> the module imports that make the edge ("a -> b")."""
    out: Dict[str, Dict[str, List[str]]] = {}
    for m, deps in sorted(g.items()):
        for d in sorted(deps):
            a, b = folder_of(m), folder_of(d)
            if a != b:
                out.setdefault(a, {}).setdefault(b, []).append(f"{m} -> {d}")
    return out


def reachable(edges: Dict[str, Set[str]]) -> Dict[str, Set[str]]:
    """Every folder each folder reaches, directly or through others."""
    out = {}
    for start in edges:
        seen, todo = set(), list(edges[start])
        while todo:
            n = todo.pop()
            if n not in seen:
                seen.add(n)
                todo += edges.get(n, ())
        out[start] = seen
    return out


def layering_errors(g: Dict[str, Set[str]], allowed: Dict[str, Set[str]]) -> List[str]:
    """What breaks the layering: a folder the table lacks, a direct import the table does not allow."""
    errors = [f"folder {f}: not in the layering table" for f in sorted({folder_of(m) for m in g} - set(allowed))]
    for a, targets in sorted(folder_graph(g).items()):
        for b, why in sorted(targets.items()):
            if b not in allowed.get(a, set()):
                errors.append(f"{a} imports {b}: {'; '.join(why)}")
    return errors


def test_the_layering_table_is_one_way():
    assert not [f for f, targets in reachable(ALLOWED).items() if f in targets]


def test_every_folder_imports_only_the_folders_below_it():
    assert layering_errors(graph(), ALLOWED) == []


def test_every_folder_reaches_only_what_the_table_allows_and_never_itself():
    does = reachable({a: set(t) for a, t in folder_graph(graph()).items()})
    may = reachable(ALLOWED)
    assert {a: sorted(t - may[a]) for a, t in does.items() if t - may[a]} == {}
    assert [f for f, targets in does.items() if f in targets] == []


def test_the_trainer_and_inference_reach_neither_each_other_nor_the_launchers():
    does = reachable({a: set(t) for a, t in folder_graph(graph()).items()})
    assert not does["train"] & {"infer", "preflight", "cluster", "top"}, does["train"]
    assert not does["infer"] & {"train", "preflight", "cluster", "top"}, does["infer"]
    assert not does["env"] & {"infer", "train", "transport", "top"}, does["env"]


def test_the_top_floor_holds_only_what_users_type():
    assert {m for m in module_names() if folder_of(m) == "top"} == TOP_FLOOR


def test_nothing_below_the_top_floor_imports_it():
    g = graph()
    wrong = {m: sorted(d for d in deps if folder_of(d) == "top") for m, deps in g.items() if folder_of(m) != "top"}
    assert not {m: d for m, d in wrong.items() if d}


def test_a_planted_upward_import_is_found():
    g = {"rlhpc.run.procs": {"rlhpc.train.step"}, "rlhpc.train.step": set()}
    assert layering_errors(g, ALLOWED) == ["run imports train: rlhpc.run.procs -> rlhpc.train.step"]
    g = {"rlhpc.algo.loss": {"rlhpc.config.schema"}, "rlhpc.config.schema": {"rlhpc.algo.loss"}}
    assert "config imports algo: rlhpc.config.schema -> rlhpc.algo.loss" in layering_errors(g, ALLOWED)
    assert layering_errors({"rlhpc.newfolder.x": set()}, ALLOWED) == ["folder newfolder: not in the layering table"]


def test_reachability_follows_imports_through_other_folders():
    assert reachable({"a": {"b"}, "b": {"c"}, "c": set()}) == {"a": {"b", "c"}, "b": {"c"}, "c": set()}
    assert "a" in reachable({"a": {"b"}, "b": {"a"}})["a"]


# The entry points of the role processes and of the standalone commands.
ENTRY_POINTS = ["rlhpc.role", "rlhpc.sft", "rlhpc.serve", "rlhpc.eval"]
# All they take from the launcher side: nothing (who a Slurm task is comes from rlhpc.run.slurm_identity, read from
# Slurm's environment; the config and the run-directory setup they share with `rlhpc.launch` live in rlhpc.config and
# rlhpc.preflight).
FROM_LAUNCHERS: Set[str] = set()


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


def test_no_module_of_the_package_uses_unittest_mock():
    users = [str(p) for p in PKG.rglob("*.py") if "unittest" in p.read_text()]
    assert not users, users


def test_no_module_uses_a_name_nothing_defines():
    """A function that uses a name no import or assignment defines fails only when that line runs (a moved helper
    once broke the evaluation's error path this way): pyflakes finds every such name in the package, the tests and
    the benchmarks."""
    api = pytest.importorskip("pyflakes.api", reason="pip install -e '.[test]'")
    from pyflakes import messages
    from pyflakes.reporter import Reporter

    class Undefined(Reporter):
        def __init__(self):
            super().__init__(io.StringIO(), io.StringIO())
            self.found = []

        def flake(self, message):
            if isinstance(message, (messages.UndefinedName, messages.UndefinedLocal, messages.UndefinedExport)):
                self.found.append(str(message))

    reporter = Undefined()
    api.checkRecursive([str(PKG), str(PKG.parent / "tests"), str(PKG.parent / "benchmarks")], reporter)
    assert reporter.found == []
