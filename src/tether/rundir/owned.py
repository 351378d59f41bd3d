"""What tether wrote, and the one rule for replacing it: ``--overwrite`` deletes only what tether wrote.

Every directory tether creates for its output carries a marker file, ``.tether.json``, that
says what it is (``{"kind": "run" | "sft" | "export" | "eval", "files": [...]}``, plus the tether
version and the time). A run directory (``tether train --output-dir``), an SFT run directory
(``tether sft --output-dir``), an export (``tether export OUT``) and an evaluation's output
(``tether eval --out``) may be replaced, by ``--overwrite``, only when

* it is absent or empty, or
* it holds the marker of the same kind, and every entry in it is one tether writes for that
  kind: for a run (RL or SFT) the fixed set `RUN_NAMES` (``config.yaml``, ``metrics.jsonl``,
  ``checkpoints/``, ...), for an export or an evaluation the files the marker lists.

Anything else -- a directory tether did not make (a ``config.yaml`` of your own is not enough),
a file of yours put into a run or export, an output of another kind (``eval --out`` into a
run directory) -- is refused with one error naming the directory and the entries in the way,
and nothing is deleted. `check_replaceable` is that rule; `tether.rundir.guard`, `tether.export` and
`tether.eval.cli` call it, and nothing else in tether deletes a user's directory.

An output that is one file (``tether demos --out``, ``tether sweep report --out``, ``tether plot --out``)
carries its mark inside it, and `tether.userio.claim_output_file` is the same rule for it: such a file is
replaced only when it holds the mark, so a file of yours, or tether's file with rows of yours appended, is
refused.

`is_run_dir` and `is_checkpoint_dir` tell a run directory (of either kind) and one of its
checkpoints from a model directory by their files, without reading them.

This module imports nothing from tether but its errors.
"""

from __future__ import annotations

import fnmatch
import json
import os
import time
from pathlib import Path
from typing import Iterable, Optional

from .. import __version__
from ..errors import OutputError
from ..userio import loads_json

MARKER = ".tether.json"
KINDS = ("run", "sft", "export", "eval")
#: The kinds that are run directories (``config.yaml``, ``checkpoints/``...), and the command that resumes each.
RUN_KINDS = {"run": "tether train", "sft": "tether sft"}

#: What a training run writes at the top of its directory (patterns). Temporary names of atomic
#: writes and the moved-aside previous run of an ``--overwrite`` in progress are included.
RUN_NAMES = ("config.yaml", "metrics.jsonl", "samples.jsonl", "checkpoints", "curves.png", "reward_errors.log",
             "servers", "tensorboard", "wandb", ".lock", MARKER, "*.tmp-*", ".tether-replaced-*")

_WHAT = {"run": "training run", "sft": "supervised fine-tuning run", "export": "export", "eval": "evaluation output"}


def _a(what: str) -> str:
    """``what`` with its article: "an export", "a training run"."""
    return ("an " if what[0] in "aeiou" else "a ") + what


def is_run_dir(p: Path) -> bool:
    """``p`` looks like a run directory (``tether train`` or ``tether sft``): a ``config.yaml`` (and no
    ``config.json``: not a model directory)."""
    p = Path(p)
    return p.is_dir() and (p / "config.yaml").is_file() and not (p / "config.json").is_file()


def is_checkpoint_dir(p: Path) -> bool:
    """``p`` looks like one checkpoint ``RUN/checkpoints/step-N``: ``state.json`` and ``policy.safetensors``."""
    p = Path(p)
    return p.is_dir() and (p / "state.json").is_file() and (p / "policy.safetensors").is_file()


def run_kind(path: Path) -> str:
    """The kind of run directory ``path`` (``"run"`` or ``"sft"``, by its marker; ``"run"`` when the
    marker is missing or names no run kind: runs written before markers existed)."""
    marker = read_marker(path)
    return marker["kind"] if marker is not None and marker["kind"] in RUN_KINDS else "run"


def read_marker(path: Path) -> Optional[dict]:
    """The marker of directory ``path`` (None: none, or not readable as tether's)."""
    try:
        data = loads_json((Path(path) / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("kind") in KINDS else None


def write_marker(path: Path, kind: str, files: Iterable[str] = ()) -> None:
    """Write (atomically) the marker saying that tether wrote directory ``path`` as a ``kind``, with
    ``files``: the top-level entries it wrote there (for exports and evaluations)."""
    assert kind in KINDS, kind
    data = {"kind": kind, "files": sorted(set(files)), "tether": __version__,
            "created": time.strftime("%Y-%m-%d %H:%M:%S")}
    p = Path(path) / MARKER
    tmp = p.with_name(f"{MARKER}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, p)


def _owned(kind: str, name: str, marker: dict) -> bool:
    if name == MARKER or fnmatch.fnmatch(name, f"{MARKER}.tmp-*"):
        return True
    if kind in RUN_KINDS:
        return any(fnmatch.fnmatch(name, pat) for pat in RUN_NAMES)
    return name in set(marker.get("files", []))


def check_replaceable(path: str | os.PathLike, kind: str, *, flag: str = "--overwrite",
                      ignore: Iterable[str] = ()) -> list[str]:
    """The rule: raise `OutputError` unless ``path`` may be replaced by a new ``kind`` output.

    Returns the entries that replacing it deletes (``[]``: the path is absent or empty). A symlink
    or a file at ``path``, a directory without tether's marker, a marker of another kind, and any
    entry tether did not write are refused, naming what is in the way. ``ignore``: entries the
    caller itself has just made there (a trainer's own ``.lock``): neither counted nor named.
    """
    p = Path(path)
    what = _WHAT[kind]
    if p.is_symlink():
        raise OutputError(f"{p} is a symbolic link; tether writes {_a(what)} only to a real directory: name the "
                          f"target itself ({os.path.realpath(p)}) or another path")
    if not p.exists():
        return []
    if not p.is_dir():
        raise OutputError(f"{p} exists and is not a directory; choose another path for the {what}")
    try:
        names = sorted(e.name for e in p.iterdir() if e.name not in set(ignore))
    except OSError as e:
        raise OutputError(f"cannot read {p}: {e.strerror or e}") from None
    if not names or names == [".lock"]:
        return names
    marker = read_marker(p)
    shown = lambda xs: ", ".join(xs[:5]) + (f", ... ({len(xs)} entries)" if len(xs) > 5 else "")  # noqa: E731
    if marker is None:
        raise OutputError(f"{p} is not empty ({shown(names)}) and was not written by tether (no {MARKER}): {flag} "
                          f"replaces only {_a(what)} tether wrote, and never deletes your files; choose another path "
                          f"or empty it yourself")
    if marker["kind"] != kind:
        raise OutputError(f"{p} is a tether {_WHAT[marker['kind']]}, not {_a(what)}: {flag} will not replace it; "
                          f"choose another path")
    foreign = [n for n in names if not _owned(kind, n, marker)]
    if foreign:
        raise OutputError(f"{p} holds entries tether did not write ({shown(foreign)}); {flag} deletes only what "
                          f"tether wrote, so it refuses: move them out, or choose another path")
    return names
