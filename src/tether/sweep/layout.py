"""A sweep directory's layout and the sweep's records in it (written by the runner, read by the report).

    DIR/sweep.json                 the spec as run: path, name, metric, seeds, base, each arm's overrides
    DIR/runs/<arm>/seed-<s>/       the run directory of `tether train` (config.yaml, metrics.jsonl, ...)
    DIR/runs/<arm>/seed-<s>.json   the sweep's record of the run: state "done" or "failed", exit code, times,
                                   the command, its final metrics row (done) or the tail of its stderr (failed)
    DIR/runs/<arm>/seed-<s>.out    the run's stdout, every attempt appended
    DIR/runs/<arm>/seed-<s>.err    the run's stderr, every attempt appended

The records sit beside the run directory, not in it: a run directory holds only what `tether train`
writes, so ``--resume`` and ``--overwrite`` treat it as they treat any run (`tether.rundir.owned`). A run
without a record has not finished (never started, running, or killed): the next ``tether sweep`` of
the same spec continues it. Records and sweep.json are written atomically (a kill leaves the old file
or the new one).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Callable, Optional

from ..config.migration import migrate_saved
from ..config.train_async import async_shorthand
from ..errors import ConfigError, OutputError
from ..userio import json_copy, json_error, loads_json


def warn(msg: str) -> None:
    """A warning on stderr (a damaged record is named, then counted as not finished)."""
    print(f"[tether] warning: {msg}", file=sys.stderr, flush=True)

DONE, FAILED = "done", "failed"


def run_dir(out: Path, arm: str, seed: int) -> Path:
    return Path(out) / "runs" / arm / f"seed-{seed}"


def record_path(out: Path, arm: str, seed: int) -> Path:
    return Path(out) / "runs" / arm / f"seed-{seed}.json"


def log_paths(out: Path, arm: str, seed: int) -> tuple[Path, Path]:
    """(stdout, stderr) files of the run's process."""
    base = Path(out) / "runs" / arm
    return base / f"seed-{seed}.out", base / f"seed-{seed}.err"


def _write_json(path: Path, obj) -> None:
    from ..metrics import json_safe  # deferred: pulls in torch

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(json_safe(obj), indent=1, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def read_record(out: Path, arm: str, seed: int, warn: Callable[[str], None] = warn) -> Optional[dict]:
    """The run's record, or None when it has none. A record that cannot be read, is not JSON (empty, truncated,
    nested too deeply) or is not a sweep's record is reported by ``warn`` naming the file, and also counts as
    none: the run is then redone (resumed from its checkpoint), and the next record replaces the damaged one."""
    path = record_path(out, arm, seed)
    if not path.exists():
        return None
    try:
        rec = loads_json(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError) as e:  # unreadable, not UTF-8, not JSON
        why = getattr(e, "strerror", None) or (json_error(e) if isinstance(e, json.JSONDecodeError) else str(e))
        warn(f"{path}: the sweep's record of this run is damaged ({why}); the run counts as not finished")
        return None
    if not isinstance(rec, dict) or rec.get("state") not in (DONE, FAILED):
        warn(f"{path}: not a sweep's record of a run (no state done / failed); the run counts as not finished")
        return None
    return rec


def write_record(out: Path, arm: str, seed: int, rec: dict) -> None:
    _write_json(record_path(out, arm, seed), rec)


def read_sweep(out: Path) -> dict:
    """DIR/sweep.json; OutputError when DIR is not a sweep directory."""
    p = Path(out) / "sweep.json"
    if not Path(out).is_dir():
        what = "it is a file" if Path(out).exists() else "no such directory"
        raise OutputError(f"{out} is not a sweep directory: {what}")
    try:
        data = loads_json(p.read_bytes().decode("utf-8"))
    except (OSError, ValueError) as e:
        why = getattr(e, "strerror", None) or (json_error(e) if isinstance(e, json.JSONDecodeError) else str(e))
        raise OutputError(f"{out} is not a sweep directory: no readable sweep.json ({why})") from None
    if not isinstance(data, dict) or "arms" not in data:
        raise OutputError(f"{p} is not a sweep's sweep.json")
    return data


def migrated(record: dict) -> dict:
    """A sweep.json's base and arms with keys of the earlier flat layout in their nested places
    (`tether.config.migration.migrate_saved`; ``train.max_staleness: 0`` is ``train.async: none``)."""
    base = dict(record.get("base") or {})
    if isinstance(base.get("overrides"), dict):
        base["overrides"] = migrate_saved(base["overrides"])
    arms = {arm: migrate_saved(over) if isinstance(over, dict) else over
            for arm, over in (record.get("arms") or {}).items()}
    return {**record, "base": base, "arms": arms}


def same_overrides(a, b) -> bool:
    """Two arms' overrides set the same thing: equal, with the spellings of one value the config reads alike taken
    as one (``train.async``: none / null / 0 / false are all synchronous; an archived sweep recorded None, a spec
    writes ``none``)."""
    def canonical(over):
        if not isinstance(over, dict):
            return over
        return {k: async_shorthand(v) if k == "train.async" else v for k, v in over.items()}
    return canonical(a) == canonical(b)


def write_sweep(out: Path, spec) -> None:
    """Write DIR/sweep.json for ``spec`` (a `tether.sweep.spec.Spec`). A DIR made by a spec whose common
    base or one of whose arms differs from this one is refused (ConfigError naming the arm): its runs were
    made with other settings. New arms and seeds may be added."""
    out = Path(out)
    p = out / "sweep.json"
    fp = spec.fingerprint()
    if p.exists():
        old = migrated(read_sweep(out))  # a sweep run with the earlier flat keys compares in the nested layout
        if old.get("base") != json_copy(fp["base"]):
            raise ConfigError(f"{out} was made by a spec with another base ({old.get('base')}); use another --out")
        for arm, over in fp["arms"].items():
            if arm in old["arms"] and not same_overrides(old["arms"][arm], json_copy(over)):
                raise ConfigError(f"{out}: arm {arm!r} had overrides {old['arms'][arm]} there, the spec now gives "
                                  f"{over}; rename the arm or use another --out")
        arms = {**old["arms"], **fp["arms"]}
        seeds = sorted(set(old.get("seeds", [])) | set(spec.seeds))
    else:
        arms, seeds = fp["arms"], spec.seeds
    _write_json(p, {"spec": spec.path, "name": spec.name, "metric": spec.metric, "seeds": seeds,
                    "base": fp["base"], "arms": arms})
