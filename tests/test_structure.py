"""Package structure, read from the source with ``ast`` (nothing is imported):

- no import cycle between tether's modules;
- ``tether.algo`` imports nothing but torch, the standard library and itself.

Every import statement counts, also those inside functions (a lazy import is still a
dependency, and a lazy cycle is still a cycle), with two rules:

- relative imports are resolved to absolute names; ``from PKG import x`` depends on the
  submodule ``PKG.x`` when that is a module, else on ``PKG`` itself. A package's
  ``__init__`` is the module named by the package. Importing ``a.b.c`` also runs the
  ``__init__`` of ``a`` and ``a.b``, but those implicit parent edges are left out: every
  submodule would otherwise form a "cycle" with its own package's ``__init__``.
- imports under ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``) do not count: they never
  run, so they can neither form a cycle at runtime nor pull a dependency into tether.algo.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import tether

SRC = Path(tether.__file__).resolve().parent  # .../src/tether


def module_files(root: Path = SRC) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under ``root`` (a package __init__ is the package)."""
    out = {}
    for f in sorted(root.rglob("*.py")):
        parts = list(f.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    """Every Import / ImportFrom node, at any depth, except those under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)  # the else branch does run
            continue
        stack.extend(ast.iter_child_nodes(node))


def imports_of(name: str, path: Path, modules: set[str]) -> set[str]:
    """Absolute names module ``name`` (file ``path``) imports; a submodule where ``from PKG import x`` names one."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    out = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
            continue
        if node.level:
            base = package.split(".")
            if node.level - 1 > len(base) - 1:
                raise ValueError(f"{path}:{node.lineno}: relative import beyond the top-level package")
            base = base[: len(base) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module
        for a in node.names:
            sub = f"{target}.{a.name}"
            out.add(sub if sub in modules else target)
    return out


def import_graph(root: Path = SRC) -> dict[str, set[str]]:
    """tether module -> the tether modules it imports."""
    files = module_files(root)
    mods = set(files)
    return {m: {t for t in imports_of(m, f, mods) if t in mods and t != m} for m, f in files.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle path [a, b, ..., a] per strongly connected component that has a cycle (Tarjan)."""
    index, low, on_stack, stack, comps = {}, {}, set(), [], []
    counter = [0]

    def strongconnect(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            comps.append(comp)

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)

    cycles = []
    for comp in comps:
        start = min(comp)
        if len(comp) == 1 and start not in graph.get(start, ()):
            continue
        # breadth-first search inside the component: the shortest path start -> ... -> start
        prev, frontier, found = {}, [start], None
        while frontier and found is None:
            nxt = []
            for v in frontier:
                for w in sorted(graph.get(v, ())):
                    if w not in comp:
                        continue
                    if w == start:
                        found = v
                        break
                    if w not in prev:
                        prev[w] = v
                        nxt.append(w)
                if found is not None:
                    break
            frontier = nxt
        path = [start]
        v = found
        while v != start:
            path.append(v)
            v = prev[v]
        cycles.append([start] + path[1:][::-1] + [start])
    return cycles


# ---------------------------------------------------------------- the detector itself


def test_find_cycles_on_a_synthetic_graph():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a", "c"}}) == []
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"a"}, "b": set()}) == [["a", "a"]]
    # two separate cycles, each reported; the shortest path inside a bigger component
    got = find_cycles({"a": {"b"}, "b": {"a", "c"}, "c": {"a"}, "x": {"y"}, "y": {"x"}})
    assert sorted(got) == [["a", "b", "a"], ["x", "y", "x"]]


def test_import_reader_on_a_synthetic_package(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\nfrom .sub import c, CONST\n")
    (pkg / "b.py").write_text("def f():\n    from .a import g\n")  # lazy: still an edge, and a cycle
    (pkg / "sub" / "__init__.py").write_text("CONST = 1\nfrom .. import a\n")
    (pkg / "sub" / "c.py").write_text(
        "import os\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..a import x\n"
        "else:\n    import json\n")
    g = import_graph(pkg)
    assert g == {"pkg": set(), "pkg.a": {"pkg.b", "pkg.sub.c", "pkg.sub"}, "pkg.b": {"pkg.a"},
                 "pkg.sub": {"pkg.a"}, "pkg.sub.c": set()}
    assert imports_of("pkg.sub.c", pkg / "sub" / "c.py", set(g)) == {"os", "typing", "json"}
    assert find_cycles(g) == [["pkg.a", "pkg.b", "pkg.a"]]  # one component {a, b, sub}: one (shortest) path


# ---------------------------------------------------------------- tether


def test_tether_has_no_import_cycle():
    graph = import_graph()
    assert "tether.algo.kl" in graph and "tether.train" in graph  # the graph was read
    cycles = find_cycles(graph)
    assert not cycles, "import cycles between tether modules:\n  " + "\n  ".join(" -> ".join(c) for c in cycles)


def test_algo_imports_only_torch_stdlib_and_itself():
    files = module_files()
    mods = set(files)
    algo = {m: f for m, f in files.items() if m == "tether.algo" or m.startswith("tether.algo.")}
    assert len(algo) > 5
    allowed_top = set(sys.stdlib_module_names) | {"torch", "__future__"}
    bad = []
    for m, f in sorted(algo.items()):
        for name in sorted(imports_of(m, f, mods)):
            if name == "tether.algo" or name.startswith("tether.algo."):
                continue
            if name.split(".")[0] in allowed_top and not name.startswith("tether"):
                continue
            bad.append(f"{m} imports {name}")
    assert not bad, "tether.algo must import only torch, the standard library and tether.algo:\n  " + "\n  ".join(bad)


@pytest.mark.parametrize("name", ["tether.assemble", "tether.agents", "tether.algo.objectives"])
def test_lazy_and_relative_imports_are_read(name):
    """Sanity check on the real tree: relative imports resolve, and imports inside functions count."""
    graph = import_graph()
    if name == "tether.assemble":
        assert "tether.anchor" in graph[name]  # 'from .anchor import Anchor, make_anchor' at the top
        assert "tether.models" in graph[name]  # 'from . import models': a module imported from its package
    elif name == "tether.agents":
        assert "tether.agents.verifiers_v1" in graph[name]  # 'from .verifiers_v1 import ...' inside multi_turn_agent
    else:
        assert {"tether.algo.kl", "tether.algo.trust_region", "tether.algo.aggregation"} <= graph[name]


# ---------------------------------------------------------------- layers, sizes


#: tether's layers, lowest first: a module may import its own layer and the ones below. A module
#: belongs to the layer of its longest matching prefix. Every package is a layer of its own, so two
#: packages that import each other (a folder cycle, even one riding on imports inside functions) put
#: an import upward and fail the test below; top-level modules share layers with their peers (a cycle
#: among them is an import cycle, which test_tether_has_no_import_cycle catches). ``python
#: tests/test_structure.py`` prints the graph's size and every edge that runs upward.
LAYERS = [
    ("the mathematics", ["tether.algo"]),
    ("shared modules", ["tether", "tether.errors", "tether.memory", "tether.logprobs_chunked", "tether.distributed",
                        "tether.gguf", "tether.logprobs", "tether.metrics", "tether.schedule",
                        "tether.anchor", "tether.optim", "tether.plot", "tether.sections", "tether.userio"]),
    ("the configuration's declarations (pydantic sections; nothing above them)", ["tether.config"]),
    ("engines", ["tether.rollout"]),
    ("run directories: guard, reader, checkpoints, ownership, graceful stop", ["tether.rundir"]),
    ("passes and test models", ["tether.passes", "tether.testing"]),
    ("tasks", ["tether.tasks"]),
    ("the model organism (built from its problems, tether.tasks.organism_problems)", ["tether.organism"]),
    ("models", ["tether.models"]),
    ("search", ["tether.search"]),
    ("environments", ["tether.envs"]),
    ("agents and the rollout builder", ["tether.agents"]),
    ("resolving a configuration against the registries (load_config, check)", ["tether.resolve"]),
    ("asynchronous RL", ["tether.asynchronous"]),
    ("a run at a checkpoint", ["tether.export_card"]),
    ("sweeps", ["tether.sweep"]),
    ("evaluation", ["tether.eval"]),
    ("reports and export", ["tether.report", "tether.export"]),
    ("the run loop (RL and SFT)", ["tether.loop"]),
    ("the RL trainer's parts, built from its config", ["tether.assemble"]),
    ("the RL trainer", ["tether.train"]),
    ("supervised fine-tuning", ["tether.sft"]),
    ("command line", ["tether.cli", "tether.__main__"]),
]

MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80
#: modules allowed over MAX_MODULE_LINES, each with the reason
LARGE_MODULES: dict[str, str] = {}
#: functions (module:qualname) allowed over MAX_FUNCTION_LINES, each with the reason
LONG_FUNCTIONS: dict[str, str] = {}


def layer_of(module: str) -> int:
    best = None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[1]):
                best = (i, len(p))
    if best is None:
        raise KeyError(f"{module} is in no layer of tests/test_structure.py LAYERS: add it")
    return best[0]


def graph_report(root: Path = SRC) -> tuple[int, int, list[tuple[str, str]]]:
    """(modules, import edges between them, the edges from a lower layer up to a higher one)."""
    graph = import_graph(root)
    edges = [(a, b) for a, targets in graph.items() for b in targets]
    return len(graph), len(edges), sorted((a, b) for a, b in edges if layer_of(b) > layer_of(a))


def test_every_package_is_a_layer_of_its_own():
    """A package shares its layer with nothing, so an import between two packages always runs one way."""
    packages = {f"tether.{d.name}" for d in SRC.iterdir() if (d / "__init__.py").is_file()}
    shared = [f"{name}: {prefixes}" for name, prefixes in LAYERS
              if len(prefixes) > 1 and any(p in packages for p in prefixes)]
    listed = {p for _, prefixes in LAYERS for p in prefixes}
    assert not shared, "packages sharing a layer:\n  " + "\n  ".join(shared)
    assert packages <= listed, f"packages in no layer: {sorted(packages - listed)}"


def test_no_import_runs_from_a_lower_layer_up():
    _, _, up = graph_report()
    assert not up, "imports from a lower layer up to a higher one:\n  " + "\n  ".join(f"{a} -> {b}" for a, b in up)


def _functions(tree: ast.AST, prefix: str = ""):
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}{node.name}"
            if not isinstance(node, ast.ClassDef):
                yield name, node.end_lineno - node.lineno + 1
            yield from _functions(node, name + ".")


def test_no_module_or_function_is_too_long():
    """No module over 500 lines and no function over 80 (docstring included), unless named above with a reason."""
    big, long_ = [], []
    for m, f in module_files().items():
        text = f.read_text()
        n = len(text.splitlines())
        if n > MAX_MODULE_LINES and m not in LARGE_MODULES:
            big.append(f"{m}: {n} lines")
        for name, lines in _functions(ast.parse(text)):
            if lines > MAX_FUNCTION_LINES and f"{m}:{name}" not in LONG_FUNCTIONS:
                long_.append(f"{m}:{name}: {lines} lines")
    assert not big and not long_, ("split these along their concerns (or name them in LARGE_MODULES / "
                                   "LONG_FUNCTIONS with the reason):\n  " + "\n  ".join(big + long_))


#: the builders of a run's parts (tether.assemble.build_parts calls them): the trainer imports none of them
PART_BUILDERS = {"RolloutPlan", "build_rollout", "make_engine", "prompt_stream", "training_reward", "HeldOut",
                 "load_model", "models", "shard_model", "make_anchor", "make_adamw", "LRSchedule", "Passes",
                 "loss_needs", "RewardErrorLog", "RolloutFeed", "RolloutWorkers"}


def test_the_trainer_builds_none_of_its_parts():
    """``tether.train`` runs a run's parts; ``tether.assemble`` builds them from the config (one module owns that
    arrow). A builder imported into train.py (a name of PART_BUILDERS, or a module of the same name) fails here."""
    tree = ast.parse((SRC / "train.py").read_text())
    imported = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                for a in node.names}
    assert "build_parts" in imported  # the check reads the right file
    assert not imported & PART_BUILDERS, f"tether.train imports builders of its parts: {imported & PART_BUILDERS}"


if __name__ == "__main__":
    n_mod, n_edges, up = graph_report(Path(sys.argv[1]) if len(sys.argv) > 1 else SRC)
    print(f"{n_mod} modules, {n_edges} import edges between them, {len(up)} from a lower layer up")
    for a, b in up:
        print(f"  {a} -> {b}")

