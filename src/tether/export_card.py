"""The model card (``README.md``) of a ``tether export`` directory: what was exported, from which
run, recipe and checkpoint, the run's final metrics, how to load it, and the tether version and
git commit that wrote it. See :mod:`tether.export`.

It imports nothing of tether's above ``tether.algo`` (the run checkpoint is only read, and whether
the base model is a Hub id is decided by the caller), so it sits low in the layers of
``tests/test_structure.py``."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from . import __version__
from .sections import as_dict
from .userio import loads_json

if TYPE_CHECKING:
    from .eval.run import RunCheckpoint


def _git_commit() -> Optional[str]:
    """The tether source checkout's commit (``+dirty`` with local changes), or None outside git."""
    pkg = Path(__file__).resolve().parent
    try:
        def git(*a: str) -> str:
            return subprocess.run(["git", "-C", str(pkg), *a], capture_output=True, text=True, timeout=10,
                                  check=True).stdout.strip()

        top = Path(git("rev-parse", "--show-toplevel")).resolve()
        if not (top / "src" / "tether").resolve() == pkg:  # tether installed inside some other repo
            return None
        commit = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", str(pkg))
        return commit + ("+dirty" if dirty else "")
    except Exception:
        return None


def _metrics_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    rows = []
    if path.is_file():
        for line in path.read_bytes().splitlines():
            try:
                rows.append(loads_json(line))
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue  # a line cut by a crash, or damaged
    return rows


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def _metrics_table(row: dict) -> str:
    lines = ["| metric | value |", "| --- | --- |"]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in row.items() if isinstance(v, (int, float, str, bool))]
    return "\n".join(lines)


def render_card(rc: RunCheckpoint, *, anchor: bool, fmt: str, dtype: str, base_ref: str, base_on_hub: bool) -> str:
    """The export's ``README.md`` (`tether.export.model_card`): what was exported, from which run and
    recipe, metrics, versions. ``base_on_hub``: the base model is a Hub id (the card names it as
    ``base_model``)."""
    mc = rc.model_config
    cfg = rc.config
    if rc.kind == "sft":
        train = (cfg.get("train") or {}) if isinstance(cfg, dict) else as_dict(cfg.train)
        algo = "supervised fine-tuning on assistant tokens (tether sft)"
        total = train.get("steps") or f"{train.get('epochs', '?')} epoch(s)"
    elif isinstance(cfg, dict):
        algo = f"{rc.recipe} (config no longer validates here; see the run's config.yaml)"
        total = (cfg.get("train") or {}).get("steps", "?")
    else:
        from .config.recipes import describe  # deferred: pulls in torch (this module imports none)

        algo = describe(cfg.algo)
        total = cfg.train.steps
    what = "anchor" if anchor else "policy"
    if anchor and not isinstance(cfg, dict):
        a = cfg.algo.anchor
        what += f" ({a.kind}" + (f", eta={a.eta:g}, every={a.every}" if a.kind == "ema" else "") + ")"
    elif anchor:
        what += f" ({rc.anchor_kind})"
    lora = "none (full fine-tuning)"
    if rc.lora:
        lora = (f"r={mc.lora_r}, alpha={mc.lora_alpha}, targets={mc.lora_target_modules}; "
                + ("merged into the base weights" if fmt == "full" else "exported as a PEFT adapter"))
    rows = _metrics_rows(rc.run_dir)
    commit = _git_commit()
    header = ["---", "library_name: " + ("peft" if fmt == "adapter" else "transformers"), "tags:", "- tether",
              "- sft" if rc.kind == "sft" else "- reinforcement-learning"]
    if base_on_hub:
        header.append(f"base_model: {mc.name}")
    header.append("---")
    out = header + [
        "",
        f"# {rc.run_dir.resolve().name} step {rc.step} {'anchor' if anchor else 'policy'}",
        "",
        "Exported with `tether export` from a tether " + ("SFT run." if rc.kind == "sft" else "RL training run."),
        "",
        "| | |",
        "| --- | --- |",
        f"| weights | {what} |",
        f"| base model | `{mc.name}`" + (f" (adapter base: `{base_ref}`)" if fmt == "adapter" else "") + " |",
        f"| LoRA | {lora} |",
        f"| dtype | {dtype} |",
        f"| recipe | {rc.recipe} |",
        f"| algorithm | `{algo}` |",
        f"| steps | {rc.step} of {total} (checkpoint `{rc.checkpoint.name}`) |",
        f"| run directory | `{rc.run_dir.resolve()}` |",
        f"| tether | {__version__}" + (f", git commit `{commit}`" if commit else "") + " |",
        "",
    ]
    if rows:
        last = rows[-1]
        out += [f"## Final metrics (last row of metrics.jsonl, step {last.get('step', '?')})", "",
                _metrics_table(last), ""]
        at = [r for r in rows if r.get("step") == rc.step]
        if at and at[-1] is not last:
            out += [f"## Metrics at the exported step {rc.step}", "", _metrics_table(at[-1]), ""]
    else:
        out += ["## Final metrics", "", "The run has no metrics.jsonl.", ""]
    if fmt == "adapter":
        load = ["from transformers import AutoModelForCausalLM, AutoTokenizer", "from peft import PeftModel", "",
                f'base = AutoModelForCausalLM.from_pretrained("{base_ref}")',
                'model = PeftModel.from_pretrained(base, "THIS_DIR")',
                'tokenizer = AutoTokenizer.from_pretrained("THIS_DIR")']
    else:
        load = ["from transformers import AutoModelForCausalLM, AutoTokenizer", "",
                'model = AutoModelForCausalLM.from_pretrained("THIS_DIR")',
                'tokenizer = AutoTokenizer.from_pretrained("THIS_DIR")']
    out += ["## Loading", "", "```python", *load, "```", ""]
    return "\n".join(out)
