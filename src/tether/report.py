"""What a run tells its user beside metrics.jsonl: the held-out accuracy lines, the reward-failure
log, the progress bar and the rows of samples.jsonl.

* `accuracy_line(row)` -- ``arithmetic 22.0 % (100 problems)`` for a metrics row's held-out evals.
* `before_after(run_dir, eval_cfg, names)` -- the before -> after line printed at the end of a run,
  read back from metrics.jsonl (so a resumed run finds its step-0 evaluation too).
* `RewardErrorLog` -- counts failed reward calls; the first failure of each kind goes to
  ``RUN/reward_errors.log`` and to the console.
* `Progress` -- the tqdm bar of ``run.progress`` (reward, accuracy, KL, seconds per step).
* `sample_rows(batch, n)` -- a few prompts, responses and rewards of a step for samples.jsonl.

Only rank 0 reports; the trainer decides when (see `tether.train`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable


def _pct(x) -> str:
    return f"{100 * x:.1f} %" if isinstance(x, (int, float)) else "?"


def accuracy_line(m: dict) -> str:
    """'arithmetic 22.0 % (100 problems)' for each eval/<name>/avg@n of a metrics row."""
    out = []
    for k, v in m.items():
        parts = k.split("/")
        if len(parts) == 3 and parts[0] == "eval" and parts[2].startswith("avg@"):
            out.append(f"{parts[1]} {_pct(v)} ({int(m.get(f'eval/{parts[1]}/n_problems', 0))} problems)")
    return ", ".join(out)


def before_after(run_dir: Path, e, names) -> str:
    """'arithmetic (100 problems, greedy, 256 tokens): 22.0 % -> 51.0 %' for each held-out set in ``names``,
    from the step-0 and the last eval rows of ``run_dir``'s metrics.jsonl (a resumed run finds its
    'before' there too); '?' where one is missing. ``e`` is the run's `tether.config.EvalConfig`."""
    from .metrics import read_metrics
    rows = read_metrics(run_dir)
    first = next((r for r in rows if r.get("step") == 0), {})
    last = next((r for r in reversed(rows) if any(k.startswith("eval/") for k in r)), {})
    how = ("greedy" if e.greedy else f"{e.n} samples at T={e.temperature:g}") + f", {e.max_new_tokens} tokens"
    parts = []
    for name in names:
        key = f"eval/{name}/avg@{e.n}"
        n = int(last.get(f"eval/{name}/n_problems", 0) or first.get(f"eval/{name}/n_problems", 0) or 0)
        parts.append(f"{name} ({n} problems, {how}): {_pct(first.get(key))} -> {_pct(last.get(key))} "
                     f"(step {last.get('step', '?')})")
    return "; ".join(parts)


class RewardErrorLog:
    """Counts failed reward calls (``count``, checkpointed by the trainer); the first failure of each
    kind (raised, invalid, timeout, crashed) is appended to ``run_dir/reward_errors.log`` and logged."""

    def __init__(self, run_dir: Path, log: Callable = print):
        self.path, self.log = Path(run_dir) / "reward_errors.log", log
        self.count = 0
        self._kinds: set[str] = set()  # the kinds of failure already logged

    def add(self, errors: list, step: int) -> None:
        """Count ``errors`` (`tether.tasks.rewards.RewardFailure`) of trainer step ``step`` (1-based)."""
        self.count += len(errors)
        for err in errors:
            if err.kind not in self._kinds:
                self._kinds.add(err.kind)
                with open(self.path, "a") as f:
                    f.write(f"step {step}: {err}\n")
                self.log(f"[tether] step {step}: {err.WHAT[err.kind]}; such calls score 0, count in "
                         f"reward_errors, and training goes on. The first (also in {self.path}):\n{err}")


class Progress:
    """The progress bar of a run (tqdm), from step ``initial`` of ``total``; ``enabled=False``: nothing."""

    def __init__(self, total: int, initial: int, desc: str, enabled: bool = True):
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm
            self.bar = tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True)

    def update(self, m: dict) -> None:
        """One step done, with its metrics row ``m`` shown beside the bar."""
        if self.bar is None:
            return
        post = {"reward": f"{m['reward_mean']:.3f}", "acc": f"{m['accuracy']:.2f}"}
        if "kl" in m:
            post["kl"] = f"{m['kl']:.2e}"
        post["s/step"] = f"{m['time_step_s']:.1f}"
        self.bar.set_postfix(post)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def sample_rows(b, n: int) -> list[dict]:
    """A few prompts, responses and rewards of a step (a `tether.passes.StepBatch`), for samples.jsonl."""
    rows = []
    for i in range(min(n, len(b.rb))):
        rows.append({"id": b.examples[i].id, "prompt": b.examples[i].prompt, "answer": b.examples[i].answer,
                     "response": b.rb.texts[i], "reward": float(b.rewards[i]), "correct": bool(b.correct[i]),
                     "finish_reason": b.rb.finish_reason[i]})
    return rows
