"""Reading a YAML config file as a tree (imports nothing from tether but its errors).

Every YAML file tether reads goes through ``read_yaml_mapping``, whose loader accepts trees
only: a key written twice in one mapping, or a node that contains itself through an alias, is
refused with the file and line, where PyYAML would silently keep the last value or recurse
forever. It sits low in the house so that the reader of a run directory (`tether.rundir.reader`) can read
a run's ``config.yaml`` without the config package (`tether.config.yaml_io` re-exports it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError, read_utf8


class _YamlTreeError(yaml.YAMLError):
    """A YAML document that parses but is no config tree: a duplicate key, or an alias to an
    enclosing node. ``line`` is 1-based; ``read_yaml_mapping`` adds the file name."""

    def __init__(self, line: int, message: str):
        super().__init__(message)
        self.line, self.message = line, message


def _key_path(parent: str, key: Any) -> str:
    return f"{parent}.{key}" if parent else str(key)


_MERGE_TAG = "tag:yaml.org,2002:merge"


class _ConfigLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that accepts trees only.

    * A duplicate key in any mapping is refused (PyYAML silently keeps the last one, so a
      setting written twice would quietly lose its first value). Keys a merge (``<<: *base``)
      brings in may be overridden, as YAML intends.
    * A node that contains itself through an alias (``train: &t {steps: 2, more: *t}``) is
      refused: it is an endless value (flattening it into dotted keys never ends).

    Both are checked on the composed document before anything is constructed (`_check_tree`
    records each mapping's own keys, since PyYAML rewrites a mapping's pairs in place when it
    resolves merges); `construct_mapping` then compares the keys as YAML values (``yes`` and
    ``true`` are one key).
    """

    def get_single_data(self):
        node = self.get_single_node()
        if node is None:
            return None
        self._paths: dict[int, str] = {}  # id(mapping node) -> its dotted path
        self._own_keys: dict[int, list] = {}  # id(mapping node) -> its key nodes as written
        self._check_tree(node)
        return self.construct_document(node)

    def _check_tree(self, root: yaml.Node) -> None:
        """Refuse a node reachable from itself; record each mapping's path and key nodes.

        Iterative, and each node is entered once: a shared (aliased) node is not walked again, so a
        document of nested aliases ("billion laughs") costs its number of nodes, not its expansion.
        """
        done: set[int] = set()
        on_path: set[int] = set()  # the nodes from the root down to the current one
        stack: list = [("enter", root, "", 1)]
        while stack:
            what, node, path, line = stack.pop()
            if what == "leave":
                on_path.discard(id(node))
                done.add(id(node))
                continue
            if id(node) in on_path:
                raise _YamlTreeError(line, f"key {path!r} refers to a node that contains it (a recursive alias, "
                                           f"as in `a: &x {{b: *x}}`); a config must be a tree of values")
            if id(node) in done or not isinstance(node, (yaml.MappingNode, yaml.SequenceNode)):
                continue
            on_path.add(id(node))
            stack.append(("leave", node, path, line))
            if isinstance(node, yaml.MappingNode):
                self._paths[id(node)] = path
                self._own_keys[id(node)] = [k for k, _ in node.value if k.tag != _MERGE_TAG]
                children = [(v, _key_path(path, k.value if isinstance(k, yaml.ScalarNode) else "?"),
                             k.start_mark.line + 1) for k, v in node.value]
            else:
                children = [(v, f"{path}[{i}]", v.start_mark.line + 1) for i, v in enumerate(node.value)]
            stack.extend(("enter", v, p, ln) for v, p, ln in reversed(children))

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}  # key -> the line it first appears on
            for key_node in self._own_keys.get(id(node), ()):
                key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
                try:
                    first = seen.get(key)
                except TypeError:  # an unhashable key: SafeConstructor reports it below
                    continue
                if first is not None:
                    name = _key_path(self._paths.get(id(node), ""), key)
                    raise _YamlTreeError(line, f"duplicate key {name!r} (first at line {first}); YAML would "
                                               f"keep only the last value: write each key once")
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def read_yaml_mapping(path: str | Path) -> dict:
    """The mapping at the top of a YAML config file (an empty file is ``{}``).

    Raises ConfigError naming the file (and the line, where the problem has one) when it is
    missing or unreadable, not UTF-8, not valid YAML, or its top level is not a mapping; also
    when a key appears twice in one mapping, at any depth (naming the dotted key and both
    lines: YAML itself would silently keep the last), a node contains itself through an
    alias (``a: &x {b: *x}``, naming the key), or it is nested too deeply for the parser. Every
    YAML file tether reads (``--config`` files, a run's config.yaml on ``--resume``, ``tether
    eval`` and ``tether export``) goes through here.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {path} {'is not a file' if p.exists() else 'does not exist'}")
    text = read_utf8(p, f"config file {path}", ConfigError)
    try:
        data = yaml.load(text, Loader=_ConfigLoader)
    except _YamlTreeError as e:
        raise ConfigError(f"config file {path} line {e.line}: {e.message}") from None
    except RecursionError:  # e.g. `train: [[[[...` 20,000 deep: PyYAML composes and constructs recursively
        raise ConfigError(f"config file {path}: not valid YAML: nested too deeply for the parser (a config is a "
                          f"few levels deep)") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f" line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        what = " ".join(str(getattr(e, "problem", None) or e).split())
        raise ConfigError(f"config file {path}{where}: not valid YAML: {what}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: the top level must be a mapping of config keys "
                          f"(key: value lines), got a {type(data).__name__}")
    return data
