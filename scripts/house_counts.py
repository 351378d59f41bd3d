"""Count what makes the plan of src/tether harder to see (issue #40's table), from the code's own imports.

    .venv/bin/python scripts/house_counts.py            # the figures
    .venv/bin/python scripts/house_counts.py --list     # and every line behind them

- imports inside functions: ``import`` / ``from`` statements of tether modules inside a def;
- ``from X import _private``: imports of an underscore name from another tether module;
- ConfigError from algo: modules importing ``ConfigError`` from ``tether.algo`` (or a module of it);
- folder pairs importing each other: packages A, B of tether where a module of A imports one of B and the
  reverse, at any depth (top-level or inside a function);
- src lines: the lines of src/tether/**/*.py.
"""

from __future__ import annotations

import argparse
import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def absolute(mod: str, node: ast.ImportFrom, is_pkg: bool) -> str:
    if not node.level:
        return node.module or ""
    base = mod.split(".")
    base = base if is_pkg else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def folder(mod: str) -> str:
    """The package a module belongs to: tether.<pkg> for a sub-package and its modules, tether for the rest."""
    parts = mod.split(".")
    if len(parts) >= 2 and (ROOT / "tether" / parts[1]).is_dir():
        return ".".join(parts[:2])
    return "tether"


def scan():
    inside, private, config_error = [], [], []
    edges = defaultdict(set)
    lines = 0
    for path in sorted((ROOT / "tether").rglob("*.py")):
        text = path.read_text()
        lines += len(text.splitlines())
        mod = module_name(path)
        is_pkg = path.name == "__init__.py"
        tree = ast.parse(text)
        funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        nested = {id(x) for f in funcs for x in ast.walk(f) if x is not f}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                target = absolute(mod, node, is_pkg)
                names = [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                target, names = None, []
                for a in node.names:
                    if a.name.startswith("tether"):
                        target = a.name
            else:
                continue
            if not target or not target.startswith("tether"):
                continue
            where = f"{path.relative_to(ROOT.parent)}:{node.lineno}"
            if id(node) in nested:
                inside.append(where)
            if any(n.startswith("_") and not n.startswith("__") for n in names):
                private.append(f"{where} from {target} import {', '.join(names)}")
            if "ConfigError" in names and target.startswith("tether.algo"):
                config_error.append(where)
            src, dst = folder(mod), folder(target)
            if src != dst:
                edges[src].add(dst)
    pairs = sorted({tuple(sorted((a, b))) for a in edges for b in edges[a] if a in edges.get(b, ())
                    and a != "tether" and b != "tether"})
    return inside, private, sorted(set(config_error)), pairs, lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--list", action="store_true", help="print every line behind the counts")
    args = ap.parse_args()
    inside, private, config_error, pairs, lines = scan()
    files_config_error = sorted({w.rsplit(":", 1)[0] for w in config_error})
    print(f"imports inside functions (tether modules): {len(inside)}")
    print(f"from X import _private:                    {len(private)}")
    print(f"files importing ConfigError from algo:     {len(files_config_error)}")
    print(f"folder pairs importing each other:         {len(pairs)}"
          + (": " + ", ".join(f"{a[7:]} <-> {b[7:]}" for a, b in pairs) if pairs else ""))
    print(f"src/ lines:                                {lines}")
    if args.list:
        for title, rows in (("inside functions", inside), ("private", private), ("ConfigError", config_error)):
            print(f"\n# {title}")
            print("\n".join(rows))


if __name__ == "__main__":
    main()
