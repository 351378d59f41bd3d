"""Run logs: metrics.jsonl (one line per step, flushed at once), samples.jsonl, optional TensorBoard / W&B, the
progress bar of ``run.progress`` (`Progress`); JSON result files written whole (`write_json_atomic`, used by
``tether eval`` and the benchmarks).

A JSONL log survives the ways a run ends badly: a row whose write fails (disk full) is cut back
out of the file at once; a row torn by a kill (the last line, incomplete) is dropped with a
warning by the next reader; trimming the rows of steps after the checkpoint on resume replaces
the file atomically, so a kill during it loses nothing.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
from pathlib import Path
from typing import Callable, Optional

import torch

from .algo.correction import ess_frac
from .errors import RunError
from .userio import loads_json


def warn(msg: str) -> None:
    """A warning for the user: one line on stderr (the run goes on)."""
    print(f"tether: warning: {msg}", file=sys.stderr, flush=True)


def peak_memory_mb() -> dict[str, float]:
    """Peak resident memory of this process (MiB), and peak CUDA memory when on a GPU."""
    out = {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["peak_cuda_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def json_safe(v):
    """``v`` with non-finite floats written as strings (JSON has no NaN/inf), through dicts and lists."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, dict):
        return {k: json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_safe(x) for x in v]
    return v


def write_json_atomic(path: Path, obj) -> None:
    """Write ``json_safe(obj)`` to ``path`` via a temporary file and a rename (never a partial file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(json_safe(obj), indent=2, ensure_ascii=False) + "\n")


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no nan/inf
    return v


def read_jsonl(path: Path, warn: Callable[[str], None] = warn) -> tuple[list[dict], bool]:
    """``(rows, dirty)``: the rows of a JSONL log, and whether its text needs a rewrite to be clean
    (a line was dropped, or the last line has no newline, so that an append would run into it).

    An incomplete last line (a write torn by a kill or a full disk) is dropped with a warning naming
    the file and line; a malformed line before the last is damage that no interrupted append makes,
    and raises `RunError` naming the file and line.
    """
    text = Path(path).read_bytes().decode("utf-8", errors="replace")
    lines = text.split("\n")
    numbered = [(i, ln) for i, ln in enumerate(lines, 1) if ln.strip()]
    rows, dirty = [], bool(lines[-1].strip())  # text after the last newline
    for k, (i, ln) in enumerate(numbered):
        try:
            row = loads_json(ln)
        except ValueError as e:
            if k < len(numbered) - 1:
                raise RunError(f"{path}: line {i} is not a JSON row ({e}); fix or delete that line") from None
            warn(f"{path}: line {i} is incomplete (a write interrupted by a kill or a full disk); dropped")
            dirty = True
            continue
        if not isinstance(row, dict):  # complete JSON, so not a torn write, wherever it stands
            raise RunError(f"{path}: line {i} is a JSON {type(row).__name__}, not a row (an object); fix or delete "
                           f"that line")
        rows.append(row)
    return rows, dirty


def with_path(e: OSError, path: Path) -> OSError:
    """``e`` naming ``path`` when it names no file (a failed ``write`` does not), for the user's error."""
    return e if e.filename else OSError(e.errno, e.strerror or str(e), str(path))


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via a fsynced temporary file and a rename: a kill or a full disk leaves
    the old file or the new one, never part of one. A failure removes the temporary file and names ``path``."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise with_path(e, path) from e


class JsonlWriter:
    """Append-only JSONL file; each line is flushed and fsynced so a crash loses nothing written.

    ``truncate_after_step`` (on resume): rows of later steps are dropped, since they will be redone,
    as is a torn last line (see `read_jsonl`); the file is replaced atomically, and only if needed.

    Raises:
        RunError: ``path`` exists but is not a regular file (a directory, a FIFO: appending would fail
            or block), or, on resume, the old log cannot be read; the message names ``path``.
            Write failures (disk full, read-only) stay ``OSError``s naming the path, for the
            trainer to report (`tether.rundir.guard.RunDirectory.write_errors`).
    """

    def __init__(self, path: Path, truncate_after_step: Optional[int] = None, warn: Callable[[str], None] = warn):
        self.path = Path(path)
        if (self.path.exists() or self.path.is_symlink()) and not self.path.is_file():
            what = "a directory" if self.path.is_dir() else "not a regular file"
            raise RunError(f"{self.path} is {what}, not a JSONL log: move it out of the way (tether then starts "
                           f"a new log there) and run again")
        if truncate_after_step is not None and self.path.exists():
            for old in self.path.parent.glob(f"{self.path.name}.tmp-*"):  # a rewrite that was killed
                old.unlink(missing_ok=True)
            try:
                rows, dirty = read_jsonl(self.path, warn)
            except OSError as e:  # permissions, an I/O error: a write error would name the file on its own
                raise RunError(f"cannot read {self.path} to trim it to step {truncate_after_step} on resume: "
                               f"{e.strerror or e}") from None
            keep = [r for r in rows if r.get("step", 0) <= truncate_after_step]
            if dirty or len(keep) < len(rows):
                write_text_atomic(self.path, "".join(json.dumps(r) + "\n" for r in keep))
        self.f = open(self.path, "ab", buffering=0)

    def _write_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[self.f.write(view):]

    def write(self, row: dict) -> None:
        """Append one row; if the write fails (disk full), the file is cut back to its previous rows."""
        data = (json.dumps({k: _clean(v) for k, v in row.items()}) + "\n").encode()
        start = os.fstat(self.f.fileno()).st_size
        try:
            self._write_all(data)
            os.fsync(self.f.fileno())
        except OSError as e:
            try:
                os.ftruncate(self.f.fileno(), start)  # needs no space: no torn row stays behind
            except OSError:
                pass  # then the next reader drops the torn last line
            raise with_path(e, self.path) from e

    def close(self) -> None:
        self.f.close()


class MetricsLogger:
    """metrics.jsonl, samples.jsonl (unless ``samples=False``: an SFT run samples nothing) plus the optional
    TensorBoard and W&B sinks (off by default)."""

    def __init__(self, run_dir: Path, *, resume_step: Optional[int] = None, tensorboard: bool = False,
                 wandb: bool = False, wandb_project: str = "tether", config: Optional[dict] = None,
                 samples: bool = True):
        self.metrics = JsonlWriter(Path(run_dir) / "metrics.jsonl", resume_step)
        try:
            self.samples = JsonlWriter(Path(run_dir) / "samples.jsonl", resume_step) if samples else None
        except BaseException:
            self.metrics.close()
            raise
        self.tb = self.wb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
        if wandb:
            import wandb as _wandb
            self.wb = _wandb.init(project=wandb_project, dir=str(run_dir), config=config,
                                  name=Path(run_dir).name, resume="allow")

    def log(self, step: int, row: dict) -> None:
        row = {"step": step, **row}
        self.metrics.write(row)
        scalars = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "step"}
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)
        if self.wb is not None:
            self.wb.log(scalars, step=step)

    def log_samples(self, step: int, rows: list[dict]) -> None:
        for r in rows:
            self.samples.write({"step": step, **r})

    def close(self) -> None:
        self.metrics.close()
        if self.samples is not None:
            self.samples.close()
        if self.tb is not None:
            self.tb.close()
        if self.wb is not None:
            self.wb.finish()


def read_metrics(run_dir: Path) -> list[dict]:
    """All rows of a run's metrics.jsonl (a torn last line is skipped with a warning, see `read_jsonl`).

    Raises FileNotFoundError when there is none, RunError when it is a directory (or another non-file)."""
    path = Path(run_dir) / "metrics.jsonl"
    if path.exists() and not path.is_file():
        raise RunError(f"{path} is {'a directory' if path.is_dir() else 'not a regular file'}, not a JSONL log")
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} has no metrics.jsonl (is it a tether run directory?)")
    return read_jsonl(path)[0]


class UpdateStats:
    """An update's metrics, summed as tensors over micro-batches and read once at the end.

    ``compute_loss`` reports token-means per micro-batch (weighted here by the micro-batch's
    token count), except:

    - ``pg_loss`` / ``kl_loss``, which it normalizes by the whole mini-batch: their micro-batch parts
      add up, and the result is their mean over mini-batches;
    - extremes (``*ratio_max`` / ``*ratio_min``): the step's max / min;
    - `WEIGHTED_BY`: a fraction over another unit than tokens, weighted by its micro-batch's own
      denominator, so the step's value is the step's numerator over the step's denominator
      (``rollout_corr/masked_seq_frac``: the step's fully masked responses / its responses with a
      loss token); the denominators are weights, not logged;
    - `FROM_MEAN`: a non-linear function of means, computed once from the step's means rather than
      averaged over micro-batches (``rollout_corr/ppl_ratio`` = exp(the step's ``rollout_corr/kl_k1``);
      ``rollout_corr/ess_frac`` = m1^2 / m2 of the step's means of r and r^2, ``seq_ess_frac`` of the
      responses' weights); the means it reads (`MOMENTS`) are not logged.

    The step is every micro-batch of every mini-batch and epoch of the update, and with ``reduce``
    every data-parallel rank's: numerators and denominators are summed before they are divided.
    ``pad_frac``: the fraction of the positions the micro-batches' forwards laid out that were padding.
    The ``rollout_corr/*`` definitions: `tether.algo.correction.mismatch_metrics`. Per optimizer step,
    `mini_batch_ess` is the same ESS over that step's mini-batch alone (``train.lr_scale``), and
    ``lr_scale`` (logged when `record_lr_scale` was called) the mean of the multipliers applied.
    """

    PARTIAL_SUMS = ("pg_loss", "kl_loss")
    WEIGHTED_BY = {k: "rollout_corr/n_seqs" for k in  # metric -> its denominator's
                   ("rollout_corr/masked_seq_frac", "rollout_corr/seq_ess_m1", "rollout_corr/seq_ess_m2")}
    FROM_MEAN = {"rollout_corr/ppl_ratio": (("rollout_corr/kl_k1",), torch.exp),  # metric -> (its means, f)
                 "rollout_corr/ess_frac": (("rollout_corr/ess_m1", "rollout_corr/ess_m2"), ess_frac),
                 "rollout_corr/seq_ess_frac": (("rollout_corr/seq_ess_m1", "rollout_corr/seq_ess_m2"), ess_frac)}
    MOMENTS = ("rollout_corr/ess_m1", "rollout_corr/ess_m2", "rollout_corr/seq_ess_m1", "rollout_corr/seq_ess_m2")

    def __init__(self):
        self.weighted: dict[str, torch.Tensor] = {}
        self.denominators: dict[str, torch.Tensor] = {}  # WEIGHTED_BY metrics: the sum of their denominators
        self.partial: dict[str, torch.Tensor] = {}
        self.extreme: dict[str, torch.Tensor] = {}
        self.derived: list[str] = []  # FROM_MEAN metrics reported
        self.weight = self.entropy = self.entropy_tokens = self.train_tokens = self.positions = 0
        self.mini_batches, self.grad_norms, self.lr_scales = 0, [], []
        self._ess_sums = self._last_ess_sums = None  # [sum w, sum w^2, N] of tokens, then of responses

    def add(self, metrics: dict, entropy_sum: torch.Tensor, entropy_tokens: torch.Tensor,
            train_tokens: torch.Tensor, positions: Optional[torch.Tensor] = None) -> None:
        """One micro-batch: compute_loss's metrics, the masked entropy sum, tokens forwarded, and the positions
        its forward laid out, padding included (`tether.passes.forwarded_positions`; None = no padding)."""
        w = metrics["n_tokens"]
        weights = {"n_tokens", *self.WEIGHTED_BY.values()}
        for k, v in metrics.items():
            if k in weights:
                continue
            if k in self.PARTIAL_SUMS:
                self.partial[k] = self.partial.get(k, 0) + v
            elif k in self.WEIGHTED_BY:
                d = metrics[self.WEIGHTED_BY[k]]
                self.weighted[k] = self.weighted.get(k, 0) + v * d
                self.denominators[k] = self.denominators.get(k, 0) + d
            elif k in self.FROM_MEAN:
                if k not in self.derived:
                    self.derived.append(k)
            elif k.endswith(("ratio_max", "ratio_min")):  # also rollout_corr/ratio_max
                pick = torch.maximum if k.endswith("ratio_max") else torch.minimum
                self.extreme[k] = v if k not in self.extreme else pick(self.extreme[k], v)
            else:
                self.weighted[k] = self.weighted.get(k, 0) + v * w
        if "rollout_corr/ess_m1" in metrics:  # this mini-batch's sums of the ESS weights (mini_batch_ess)
            n, ns = torch.as_tensor(w).double(), metrics["rollout_corr/n_seqs"].double()
            sums = torch.stack([metrics["rollout_corr/ess_m1"] * n, metrics["rollout_corr/ess_m2"] * n, n,
                                metrics["rollout_corr/seq_ess_m1"] * ns, metrics["rollout_corr/seq_ess_m2"] * ns, ns])
            self._ess_sums = sums if self._ess_sums is None else self._ess_sums + sums
        self.weight = self.weight + w
        self.entropy = self.entropy + entropy_sum
        self.entropy_tokens = self.entropy_tokens + entropy_tokens
        self.train_tokens = self.train_tokens + train_tokens
        self.positions = self.positions + (train_tokens if positions is None else positions)

    def optimizer_step(self, grad_norm: float) -> None:
        """Count a mini-batch whose update was applied (its grad norm already read)."""
        self.grad_norms.append(grad_norm)

    def end_mini_batch(self) -> None:
        self.mini_batches += 1
        self._last_ess_sums, self._ess_sums = self._ess_sums, None

    def mini_batch_ess(self, level: str = "token", reduce=None) -> torch.Tensor:
        """ESS / N (`tether.algo.correction.ess_frac`) of the mini-batch just ended: its tokens' weights r_t
        (``level`` token) or its responses' prod_t r_t (``sequence``), over every micro-batch and, with
        ``reduce`` (the all-reduce; every rank must call it), every rank. 1 without a weight."""
        sums = self._last_ess_sums if self._last_ess_sums is not None else torch.zeros(6, dtype=torch.float64)
        sums = (reduce or (lambda x, op="sum": x))(sums)
        s1, s2, n = sums[:3] if level == "token" else sums[3:]
        return ess_frac(s1 / n.clamp_min(1), s2 / n.clamp_min(1))

    def record_lr_scale(self, scale: torch.Tensor) -> None:
        """The LR multiplier of an optimizer step (``train.lr_scale``); ``lr_scale`` is their mean."""
        self.lr_scales.append(scale)

    def result(self, reduce=None) -> dict[str, float]:
        """The metrics row: every tensor read here, once.

        ``reduce(x, op)`` (``tether.distributed.all_reduce`` under data parallelism) combines the
        ranks' sums (op "sum") and extremes ("max" / "min") before the means are taken; every rank
        must call with the same metric names.
        """
        red = reduce or (lambda x, op="sum": x)
        weighted = {k: red(v) for k, v in self.weighted.items()}
        denominators = {k: red(v) for k, v in self.denominators.items()}
        partial = {k: red(v) for k, v in self.partial.items()}
        extreme = {k: red(v, "max" if k.endswith("ratio_max") else "min") for k, v in self.extreme.items()}
        weight, entropy, entropy_tokens, train_tokens, positions = (
            red(x) for x in (self.weight, self.entropy, self.entropy_tokens, self.train_tokens, self.positions))
        w = torch.as_tensor(weight).clamp_min(1.0)
        means = {k: v / (torch.as_tensor(denominators[k]).clamp_min(1.0) if k in denominators else w)
                 for k, v in weighted.items()}
        derived = {k: self.FROM_MEAN[k][1](*(torch.as_tensor(means[m], dtype=torch.float64)
                                             for m in self.FROM_MEAN[k][0]))
                   for k in self.derived if all(m in means for m in self.FROM_MEAN[k][0])}
        for k in self.MOMENTS:
            means.pop(k, None)
        scales = ({"lr_scale": torch.stack([x.to(self.lr_scales[0].device) for x in self.lr_scales]).mean()}
                  if self.lr_scales else {})
        names = (list(means) + list(derived) + list(scales) + list(partial) + list(extreme)
                 + ["_entropy", "_tokens", "_pad_frac"])
        vals = (list(means.values()) + list(derived.values()) + list(scales.values())
                + [v / max(self.mini_batches, 1) for v in partial.values()]
                + list(extreme.values())
                + [torch.as_tensor(entropy) / torch.as_tensor(entropy_tokens).clamp_min(1),
                   torch.as_tensor(train_tokens),
                   (torch.as_tensor(positions, dtype=torch.float64) - train_tokens)
                   / torch.as_tensor(positions, dtype=torch.float64).clamp_min(1)])
        dev = next((v.device for v in vals if isinstance(v, torch.Tensor)), "cpu")
        out = dict(zip(names, torch.stack([torch.as_tensor(v, dtype=torch.float64, device=dev)
                                           for v in vals]).tolist()))
        out["entropy"], out["train_tokens"] = out.pop("_entropy"), int(out.pop("_tokens"))
        out["pad_frac"] = out.pop("_pad_frac")
        out["grad_norm"] = max(self.grad_norms) if self.grad_norms else float("nan")
        return out


def rl_postfix(m: dict) -> dict:
    """What the bar of a training run shows beside it: reward, accuracy, KL, seconds per step."""
    post = {"reward": f"{m['reward_mean']:.3f}", "acc": f"{m['accuracy']:.2f}"}
    if "kl" in m:
        post["kl"] = f"{m['kl']:.2e}"
    post["s/step"] = f"{m['time_step_s']:.1f}"
    return post


class Progress:
    """The progress bar of a run (tqdm), from step ``initial`` of ``total``; ``enabled=False``: nothing.
    ``postfix(m)`` picks what a step's metrics row shows beside the bar (default: a training run's)."""

    def __init__(self, total: int, initial: int, desc: str, enabled: bool = True,
                 postfix: Callable[[dict], dict] = rl_postfix):
        self.bar, self.postfix = None, postfix
        if enabled:
            from tqdm.auto import tqdm
            self.bar = tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True)

    def update(self, m: dict) -> None:
        """One step done, with its metrics row ``m`` shown beside the bar."""
        if self.bar is None:
            return
        self.bar.set_postfix(self.postfix(m))
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
