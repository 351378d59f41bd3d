"""Shared helpers of the benchmark scripts in bench/ (not part of the tether package).

Kept free of torch imports so that a parent process that only drives child processes stays
small (its peak RSS would otherwise leak into a vfork'ed child's ``ru_maxrss``).
"""

from __future__ import annotations

import json
import os
import platform
import re
import resource
import shlex
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


# --------------------------------------------------------------------------- paths and data


def default_data_dir() -> str | None:
    """Directory with gsm8k_train.jsonl: $TETHER_DATA_DIR, else shared/data/math next to or above the repo."""
    env = os.environ.get("TETHER_DATA_DIR")
    if env:
        return env
    for cand in (ROOT / "shared" / "data" / "math", ROOT.parent / "shared" / "data" / "math"):
        if (cand / "gsm8k_train.jsonl").is_file():
            return str(cand)
    return None


# --------------------------------------------------------------------------- memory


def peak_rss() -> dict:
    """This process's peak resident set size in MiB.

    ``peak_rss_mb`` is VmHWM (the high-water mark of this process's own address space, so a
    parent's memory never counts); ``ru_maxrss_mb`` is getrusage's figure, which on Linux also
    carries the peak of the address space a (v)forked child started from.
    """
    from _memory import peak_rss_bytes

    hwm = peak_rss_bytes()
    ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    return {"peak_rss_mb": hwm / 2**20 if hwm is not None else ru, "ru_maxrss_mb": ru}


def memory_breakdown(trainer, baseline_rss: int | None) -> dict:
    """One more trainer step with its memory recorded (`_memory.StepMemory`, bench/_memory.py), as a JSON-able dict.

    ``timed_peak_rss_mb`` is this process's VmHWM read before the step (the step resets VmHWM per
    phase), ``process_peak_rss_mb`` the highest resident memory seen, this step included; ``rows``
    are `_memory.breakdown_rows`; ``phases`` the per-phase records in MiB.
    """
    from _memory import MB, StepMemory, breakdown_rows

    timed = peak_rss()["peak_rss_mb"]
    m, mem = StepMemory(trainer, baseline_rss=baseline_rss).step()
    rows = breakdown_rows(mem)
    phases = {n: {k: (v / MB if isinstance(v, (int, float)) else v) for k, v in r.items()}
              for n, r in mem["phases"].items()}
    print("[memory] " + json.dumps({name: None if v is None else round(v, 1) for name, v, _ in rows}), flush=True)
    return {"timed_peak_rss_mb": timed, "process_peak_rss_mb": max(timed, mem["process_peak_rss"] / MB),
            "rows": [list(r) for r in rows], "phases": phases,
            "step": {k: m[k] for k in ("time_step_s", "gen_tokens", "train_tokens") if k in m}}


def memory_table(mem: dict) -> list[str]:
    """Markdown lines of a `memory_breakdown`: the breakdown, then the phases' resident memory."""
    lines = [md_table(["piece", "MiB", "what"], [[n, fmt(v, 1), w] for n, v, w in mem["rows"]]), ""]
    cuda = any("cuda_peak_allocated" in r for r in mem["phases"].values())
    header = ["phase", "RSS at start MiB", "peak RSS MiB", "RSS at end MiB"]
    if cuda:
        header += ["CUDA peak allocated MiB", "CUDA peak reserved MiB"]
    rows = []
    for name, r in mem["phases"].items():
        row = [name, fmt(r.get("rss_start"), 0), fmt(r.get("peak_rss"), 0), fmt(r.get("rss_end"), 0)]
        if cuda:
            row += [fmt(r.get("cuda_peak_allocated"), 0), fmt(r.get("cuda_peak_reserved"), 0)]
        rows.append(row)
    lines.append(md_table(header, rows))
    st = mem.get("step", {})
    lines += ["", f"- the breakdown's step is an extra one after the timed steps (not in the table above): "
              f"{fmt(st.get('time_step_s'))} s, {fmt(st.get('gen_tokens'), 0)} generated and "
              f"{fmt(st.get('train_tokens'), 0)} trained tokens; its hooks (saved-tensor tracking) slow it a little.",
              "- sizes are read from the tensors (`bench/_memory.py`); activations are the peak of the bytes autograd "
              "saves for backward (parameters excluded); the rest is the peak phase's RSS minus the runtime before "
              "the model load minus the tensors live at that peak: the allocator's kept pages, transient buffers "
              "(log-prob chunks, backward temporaries) and everything that is not a tensor."]
    return lines


# --------------------------------------------------------------------------- statistics


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def mean(xs):
    return statistics.fmean(xs) if xs else float("nan")


def after_warmup(xs: list) -> list:
    """Drop the first (warm-up) element when more than one is there."""
    return list(xs[1:]) if len(xs) > 1 else list(xs)


def linfit(x: list[float], y: list[float]) -> dict:
    """Least-squares line y = slope * x + intercept, with R^2 (numpy)."""
    import numpy as np

    xa, ya = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if len(xa) < 2 or np.ptp(xa) == 0:
        return {"slope": float("nan"), "intercept": float("nan"), "r2": float("nan"), "n": len(xa)}
    A = np.stack([xa, np.ones_like(xa)], axis=1)
    (slope, intercept), *_ = np.linalg.lstsq(A, ya, rcond=None)
    pred = slope * xa + intercept
    ss_res = float(((ya - pred) ** 2).sum())
    ss_tot = float(((ya - ya.mean()) ** 2).sum())
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    return {"slope": float(slope), "intercept": float(intercept), "r2": r2, "n": len(xa)}


def fmt(v, nd: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and v != v:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


# --------------------------------------------------------------------------- full-length responses


def full_length_engine(model, tokenizer, **engine_kwargs):
    """The ``hf`` engine from `tether.rollout.make_engine` for the benchmarks' fixed-length decoding.

    Full length comes from the sampling parameters, not the engine: callers pass
    ``SamplingParams(min_new_tokens=max_new_tokens)`` (EOS banned below it), so every response
    has exactly ``max_new_tokens`` tokens and timings do not depend on where sampling happened
    to stop. The sampling distribution changes (no EOS), which does not matter for timing.
    ``engine_kwargs`` (``batch_size``, ``sampler``, ``kv_cache``, ...) override the engine's
    options from a default `RolloutConfig`.
    """
    from tether.config import RolloutConfig
    from tether.rollout import make_engine

    return make_engine(RolloutConfig(engine="hf"), model, tokenizer, **engine_kwargs)


def force_full_length(trainer) -> None:
    """Make a tether Trainer decode every response to ``rollout.max_new_tokens`` (EOS banned below it).

    Sets ``rollout.min_new_tokens = rollout.max_new_tokens``; the trainer passes it on in its
    `SamplingParams` at every step, so the engine itself (and its sampler / KV-cache settings)
    stays the trainer's own.
    """
    r = trainer.cfg.rollout
    r.min_new_tokens = r.max_new_tokens


# --------------------------------------------------------------------------- machine and command


def version_of(pkg: str) -> str:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return "not installed"


def machine_info() -> dict:
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = "unknown"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = f"{int(line.split()[1]) / 2**20:.1f} GiB"
                break
    except OSError:
        pass
    try:
        nproc = subprocess.run(["nproc"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        nproc = str(os.cpu_count())
    return {
        "nproc": nproc,
        "cpu": cpu,
        "memory": mem,
        "python": platform.python_version(),
        "torch": version_of("torch"),
        "transformers": version_of("transformers"),
        "trl": version_of("trl"),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "thread_env": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS") if k in os.environ},
    }


def command_line() -> str:
    """The command as run, relative to the repository root when possible."""
    exe = sys.executable
    try:
        exe = os.path.relpath(exe, ROOT) if Path(exe).absolute().is_relative_to(ROOT) else exe
    except ValueError:
        pass
    script = sys.argv[0]
    try:
        script = os.path.relpath(Path(script).resolve(), ROOT)
    except ValueError:
        pass
    return " ".join(shlex.quote(a) for a in [exe, script, *sys.argv[1:]])


def machine_lines(info: dict, cmd: str) -> list[str]:
    thr = info.get("threads")
    lines = [
        f"- command: `{cmd}` (from the repository root)",
        f"- date: {info['date']}",
        f"- machine: {info['nproc']} CPUs (`nproc`), {info['cpu']}, {info['memory']} RAM",
        f"- versions: python {info['python']}, torch {info['torch']}, transformers {info['transformers']}, "
        f"trl {info['trl']}",
    ]
    if thr:
        lines.append(f"- threads: {thr}")
    return lines


# --------------------------------------------------------------------------- markdown output


def write_section(path: str | Path, heading: str, body: str) -> None:
    """Write/replace the section ``heading`` (e.g. "## vs TRL") of a markdown file.

    The section runs from its heading to the next heading of the same or a higher level (or
    the end of the file); other sections are kept as they are.
    """
    path = Path(path)
    level = len(heading) - len(heading.lstrip("#"))
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.strip() == heading.strip()), None)
    new = [heading, "", *body.strip("\n").splitlines(), ""]
    if start is None:
        while lines and not lines[-1].strip():
            lines.pop()
        lines += ["", *new]
    else:
        end = len(lines)
        for j in range(start + 1, len(lines)):
            m = re.match(r"^(#+)\s", lines[j])
            if m and len(m.group(1)) <= level:
                end = j
                break
        lines = lines[:start] + new + lines[end:]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines).rstrip("\n") + "\n")


def md_table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


# --------------------------------------------------------------------------- child processes


def run_child(argv: list[str], log_path: Path, result_path: Path,
              timeout: float | None = None, env: dict[str, str] | None = None) -> tuple[dict | None, str]:
    """Run ``python argv...`` in a fresh process; return (its JSON result or None, an error text).

    stdout and stderr of the child go to ``log_path``; the child writes its result to
    ``result_path``. ``env``: variables added to this process's environment for the child only.
    """
    result_path.unlink(missing_ok=True)
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run([sys.executable, *argv], stdout=log, stderr=subprocess.STDOUT, timeout=timeout,
                                  cwd=str(ROOT), env={**os.environ, **env} if env else None)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    tail = "\n".join(Path(log_path).read_text(errors="replace").splitlines()[-40:])
    if result_path.is_file():
        res = json.loads(result_path.read_text())
        if res.get("ok"):
            return res, ""
        return None, res.get("error", "") + f"\n(exit status {rc}; log {log_path})"
    return None, f"child exited with status {rc} and no result; last lines of {log_path}:\n{tail}"
