"""What tether reads from a user, and where it writes what a user named: the one place for each.

Every file or text a user hands tether (a config, data rows, a run's records, a corpus, an override's value,
``--env-options``) is parsed here, and every path a user names for an output is claimed here, so that a rule
fixed once holds everywhere. ``tests/test_structure.py`` fails when code under ``src/`` calls ``json.loads`` /
``json.load`` / ``yaml.safe_load`` / ``yaml.load`` or opens a file for writing outside this module (an allow-list
there names the few internal writers, each with its reason).

Reading
    `loads_json` (JSON nested deeper than the parser recurses is a ``ValueError``, `JSONTooDeep`, not a
    ``RecursionError``), `read_json`, `json_copy`; `read_utf8` (a file's text, non-UTF-8 named by line and byte);
    `loads_yaml` (one YAML value, e.g. an override's) and `read_yaml_mapping` (a YAML config file) through a loader
    that accepts trees only: a key written twice in one mapping, or a node that contains itself through an alias,
    is refused with the line, where PyYAML would silently keep the last value or recurse forever.

Writing to a path a user named
    `claim_output_file`: before any heavy work, the path must be absent or a regular file that tether wrote as this
    kind of output (its mark: `mark_line` for markdown, `MARK_KEY` in a JSON object or in every row of JSONL,
    `image_metadata` in a PNG / PDF / SVG), and its directory must take a new file (created, and a probe file
    written and removed). A file of yours is never replaced. `write_output_text` then writes through a temporary
    file and a rename. `claim_output_dir` is the same for a directory tether fills (a sweep's ``--out``); a
    directory of runs, an export or an evaluation is `tether.rundir.owned.check_replaceable`'s.

This module imports nothing from tether but its errors.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, TextIO

import yaml

from .errors import ConfigError, OutputError

# ---------------------------------------------------------------- JSON


class JSONTooDeep(json.JSONDecodeError):
    """JSON nested more deeply than the parser can recurse (``"[" * 100000``): a `JSONDecodeError`,
    so every reader that refuses invalid JSON refuses it too, instead of a `RecursionError` traceback."""


def loads_json(text):
    """``json.loads(text)``, except that JSON nested too deeply for the parser raises `JSONTooDeep`
    (a ``ValueError``) rather than ``RecursionError``: every reader of a file a user may hand tether
    (data rows, a corpus, a marker, a checkpoint's manifest, a sweep's records) parses through it."""
    try:
        return json.loads(text)
    except RecursionError:
        raise JSONTooDeep("nested too deeply for the parser", text if isinstance(text, str) else "", 0) from None


def json_error(e: json.JSONDecodeError) -> str:
    """What is wrong with invalid JSON, for an error line: the parser's message and column (none when it
    is nested too deeply: the parser gives up at no one column)."""
    return e.msg if isinstance(e, JSONTooDeep) else f"{e.msg} at column {e.colno}"


def json_copy(obj, **dumps_kwargs):
    """``obj`` as JSON would give it back (tuples as lists, keys as strings): a deep copy in JSON's types."""
    return loads_json(json.dumps(obj, **dumps_kwargs))


def read_utf8(path, label: str, error: type[Exception]) -> str:
    """The text of file ``path``; an unreadable or non-UTF-8 file raises ``error`` naming ``label``,
    the line and the byte (shared by config files and data files)."""
    try:
        raw = open(path, "rb").read()
    except OSError as e:
        raise error(f"{label}: cannot read it: {e.strerror or e}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise error(f"{label} line {line}: not valid UTF-8 (byte {e.start}: {e.reason})") from None


def read_json(path, label: str, error: type[Exception] = ConfigError):
    """The JSON value in file ``path``: one ``error`` naming ``label`` when it cannot be read, is not UTF-8, or
    is not JSON (nested too deeply included)."""
    text = read_utf8(path, label, error)
    try:
        return loads_json(text)
    except json.JSONDecodeError as e:
        raise error(f"{label}: not valid JSON: {json_error(e)}") from None


# ---------------------------------------------------------------- YAML


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


def loads_yaml(text: str, where: str, error: type[Exception] = ConfigError):
    """One YAML value (an override's ``key=value``, ``--env-options``), through the tree loader: a duplicate key
    at any depth, a recursive alias, nesting too deep for the parser and text that is not YAML are each one
    ``error`` naming ``where``."""
    try:
        return yaml.load(text, Loader=_ConfigLoader)
    except _YamlTreeError as e:
        raise error(f"{where}: {e.message}") from None
    except RecursionError:
        raise error(f"{where}: the value is nested too deeply for the YAML parser") from None
    except yaml.YAMLError as e:
        what = " ".join(str(getattr(e, "problem", None) or e).split())
        shown = text if len(text) <= 60 else text[:57] + "..."
        raise error(f"{where}={shown}: not a valid YAML value: {what}") from None


# ---------------------------------------------------------------- outputs at paths a user named

#: The key that marks a JSON object (or each row of a JSONL file) tether wrote; its value names the command.
MARK_KEY = "tether"
_MARK_SCAN = 1 << 16  # bytes read at each end of an image to find its mark (PNG text chunks, a PDF's Info)


def mark_line(kind: str) -> str:
    """The first line of a markdown or text file tether writes as ``kind`` (an HTML comment: invisible rendered)."""
    return f"<!-- written by tether {kind}; it may replace this file -->"


def image_metadata(fmt: str, kind: str) -> dict:
    """``savefig(metadata=...)`` that marks an image as tether's ``kind`` output (PNG: Software; PDF, SVG:
    Creator); other formats carry no mark, so an existing one is never replaced."""
    key = {"png": "Software", "pdf": "Creator", "svg": "Creator"}.get(fmt.lower())
    return {key: f"written by tether {kind}"} if key else {}


def _carries_mark(p: Path, kind: str) -> tuple[bool, str]:
    """Whether regular file ``p`` carries tether's mark for ``kind`` (by its suffix), and if not, why not."""
    suffix = p.suffix.lower()
    try:
        if suffix == ".jsonl":
            with open(p, "rb") as f:
                for n, raw in enumerate(f, start=1):
                    if not raw.strip():
                        continue
                    try:
                        row = loads_json(raw.decode("utf-8"))
                    except ValueError:  # not UTF-8, not JSON
                        row = None
                    if not isinstance(row, dict) or row.get(MARK_KEY) != kind:
                        return False, f"line {n} is not a row tether {kind} wrote"
            return True, ""
        if suffix == ".json":
            try:
                obj = loads_json(p.read_bytes().decode("utf-8"))
            except ValueError:
                obj = None
            ok = isinstance(obj, dict) and obj.get(MARK_KEY) == kind
            return ok, "" if ok else f"it holds no \"{MARK_KEY}\": \"{kind}\" key"
        if suffix in (".md", ".txt", ".markdown"):
            with open(p, "rb") as f:
                first = f.readline().decode("utf-8", errors="replace").rstrip("\r\n")
            ok = first == mark_line(kind)
            return ok, "" if ok else "its first line is not tether's mark"
        size = p.stat().st_size
        with open(p, "rb") as f:
            head = f.read(_MARK_SCAN)
            f.seek(max(0, size - _MARK_SCAN))
            tail = f.read()
        ok = f"written by tether {kind}".encode() in head + tail
        return ok, "" if ok else "it carries no mark of tether's"
    except OSError as e:
        raise OutputError(f"cannot read {p}: {e.strerror or e}") from None


def _probe_dir(d: Path, what: str) -> None:
    """Create directory ``d`` (and its parents) and check that it takes a new file (written and removed)."""
    for parent in [d, *d.parents]:
        if parent.exists():
            if not parent.is_dir():
                raise OutputError(f"cannot write {what}: {parent} is a file, not a directory")
            break
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / f".tether-probe-{os.getpid()}"
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        where = f" ({e.filename})" if e.filename and os.fspath(e.filename) != str(d) else ""
        raise OutputError(f"cannot write {what}: {e.strerror or e}{where}; choose a writable place") from None


def claim_output_file(path, kind: str, *, flag: str = "--out",
                      legacy: Optional[Callable[[Path], bool]] = None) -> Path:
    """Check, before any heavy work, that tether may write its ``kind`` output to the file ``path`` a user named:

    * absent, or a regular file carrying tether's mark for ``kind`` (module docstring) -- a file of yours, a
      symbolic link or a directory is refused (`OutputError` naming it and why), and nothing is touched;
      ``legacy(path)``: True for a file an earlier tether wrote before it marked its outputs;
    * its directory exists or can be created, and takes a new file.

    Returns ``Path(path)``. Write it with `write_output_text` (or through a temporary name and ``os.replace``)."""
    p = Path(path)
    if p.is_symlink() or (p.exists() and not p.is_file()):
        what = "a symbolic link" if p.is_symlink() else "a directory" if p.is_dir() else "not a regular file"
        raise OutputError(f"{flag} {p} is {what}; tether writes its {kind} only to a regular file: choose "
                          f"another path")
    if p.exists():
        ok, why = _carries_mark(p, kind)
        if not ok and not (legacy is not None and legacy(p)):
            raise OutputError(f"{p} exists and was not written by tether {kind} ({why}): tether replaces only a "
                              f"file it wrote, and never yours; choose another {flag} or move it yourself")
    _probe_dir(p.parent, str(p))
    return p


def claim_output_dir(path, what: str, *, owns: Callable[[Path], bool] = lambda p: True) -> Path:
    """Check, before any heavy work, that directory ``path`` (a user named it, e.g. a sweep's ``--out``) can be
    created or used and takes new files; ``owns(path)``: False refuses an existing directory whose entries
    tether would write into but did not make. Returns ``Path(path)``."""
    p = Path(path)
    if p.is_symlink() and not p.is_dir():
        raise OutputError(f"{what} {p} is a symbolic link to no directory; choose another path")
    if p.exists() and not p.is_dir():
        raise OutputError(f"{what} {p} is a file, not a directory; choose another path")
    if p.is_dir() and not owns(p):
        raise OutputError(f"{what} {p} holds entries tether did not write where it would write its own; tether "
                          f"never writes into yours: choose another path")
    _probe_dir(p, f"{what} {p}")
    return p


@contextlib.contextmanager
def output_writer(path, *, note: str = "") -> Iterator[TextIO]:
    """``with output_writer(path) as f: f.write(...)``: a text file on a temporary name beside ``path``, fsynced and
    renamed onto ``path`` when the block ends normally (a kill, a full disk or an error in the block leaves the old
    file or none, never part of one). An OSError of the write is an `OutputError` naming ``path`` (``note`` appended,
    e.g. "nothing was written"), the temporary file removed; an OSError that names another file (raised by the
    block's own reading, e.g. a cache) passes through as it was."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except OSError as e:
        if e.filename not in (None, str(tmp), str(p)):
            raise
        raise OutputError(f"cannot write {p}: {e.strerror or e}" + (f"; {note}" if note else "")) from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def write_output_text(path, text: str) -> None:
    """Write ``text`` to ``path`` at once (`output_writer`)."""
    with output_writer(path) as f:
        f.write(text)


def slug(s: str) -> str:
    """``s`` made safe as a file name (an output named after a benchmark, a model or a run): runs of other characters
    than ``[A-Za-z0-9_.+-]`` become ``_``, leading/trailing ``.``/``_`` go (``"x"`` if nothing is left)."""
    return re.sub(r"[^A-Za-z0-9_.+-]+", "_", str(s)).strip("._") or "x"


__all__ = ["JSONTooDeep", "MARK_KEY", "claim_output_dir", "claim_output_file", "image_metadata", "json_copy",
           "json_error", "loads_json", "loads_yaml", "mark_line", "output_writer", "read_json", "read_utf8",
           "read_yaml_mapping", "slug", "write_output_text"]
