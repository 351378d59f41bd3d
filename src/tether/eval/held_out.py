"""The held-out evaluation during training (``eval.*``), and the lines it prints.

* `HeldOut` -- its sets, when it is due, the policy's (and the anchor's) scores with the trainer's own agent and
  engine (`tether.eval.runner.evaluate_during_training`), and the lines printed before and after training.
* `accuracy_line(row)` -- ``arithmetic 22.0 % (100 problems)`` for a metrics row's held-out evals.
* `before_after(run_dir, eval_cfg, names)` -- the before -> after line printed at the end of a run,
  read back from metrics.jsonl (so a resumed run finds its step-0 evaluation too).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from .. import distributed as dist
from ..metrics import read_metrics
from ..resolve import eval_benchmarks, evaluating
from ..tasks.stream import held_out_sets
from . import runner as eval_runner  # eval_runner.evaluate_during_training: read at call time (tests patch it)


class HeldOut:
    """The held-out evaluation of a run (``eval.*``): its sets, when it is due, the policy's (and the anchor's)
    scores, the lines printed before and after training.

    ``sets`` maps a benchmark's name to (examples, reward function); it is empty when the run does not evaluate.
    ``e`` is the run's ``eval`` section; ``steps`` its ``train.steps``; ``sampling`` what the evaluation takes from
    the run besides ``eval.*`` (``rollout.batch_size``, ``train.seed``, ``rollout.stop``). `HeldOut.of` builds it from
    a whole config. Every rank evaluates the whole set (not split across ranks).
    """

    def __init__(self, sets: dict, e, steps: int, sampling: dict, log: Callable = print):
        self.sets, self.e, self.steps, self.sampling, self.log = sets, e, steps, sampling, log

    @classmethod
    def of(cls, cfg, log: Callable = print) -> "HeldOut":
        """The held-out evaluation ``cfg`` asks for (`tether.tasks.stream.held_out_sets`: the sets load here, so a
        set that cannot load fails before a run directory or a model). A run that asked for eval.before /
        eval.after without a held-out set is told why."""
        sets = held_out_sets(cfg, eval_benchmarks(cfg)) if evaluating(cfg) else {}
        if (cfg.eval.before or cfg.eval.after) and not sets and dist.is_main():
            log(f"[tether] no held-out evaluation: data.task={cfg.data.task!r} has no held-out set for "
                f"eval.benchmarks=auto (name one, e.g. eval.benchmarks=[gsm8k], or set eval.before=false "
                f"eval.after=false)")
        sampling = dict(batch_size=cfg.rollout.batch_size, seed=cfg.train.seed, stop=list(cfg.rollout.stop))
        return cls(sets, cfg.eval, cfg.train.steps, sampling, log)

    def due_before(self, step: int) -> bool:
        """Whether to evaluate the initial policy (a run at trainer step ``step`` that has not trained)."""
        return bool(self.e.before and self.sets and step == 0)

    def due(self, step: int) -> bool:
        """Whether to evaluate after trainer step ``step``: every ``eval.every`` steps, and after the last
        one with ``eval.after`` (or ``eval.every``)."""
        e, last = self.e, step == self.steps
        return bool(((e.every and step % e.every == 0) or (last and (e.after or e.every))) and self.sets)

    def evaluate(self, model, agent, engine, anchor) -> dict:
        """eval/<bench>/<metric> for the policy (and eval_anchor/... for the anchor with ``eval.anchor``),
        and time_eval_s. ``agent`` and ``engine`` are the trainer's own (``rollout.agent``,
        ``rollout.engine``): held-out problems are encoded, run and sampled as training's are. For the
        anchor the engine gets the anchor's weights for the evaluation, and the policy's back after it
        (``sync_weights``: nothing to do for transformers, a reload for vLLM's copy)."""
        t0 = time.perf_counter()
        e = self.e
        settings = dict(n=e.n, greedy=e.greedy, temperature=0.0 if e.greedy else e.temperature, top_p=e.top_p,
                        max_new_tokens=e.max_new_tokens, **self.sampling)
        examples = {k: v[0] for k, v in self.sets.items()}
        rewards = {k: v[1] for k, v in self.sets.items()}
        with dist.gathered(model):
            out = eval_runner.evaluate_during_training(agent, examples, rewards, settings)
        if e.anchor:
            try:
                with anchor.applied(model), dist.gathered(model):
                    engine.sync_weights(model)
                    res = eval_runner.evaluate_during_training(agent, examples, rewards, settings)
            finally:
                engine.sync_weights(model)  # the policy's weights again
            out.update({"eval_anchor/" + k[len("eval/"):]: v for k, v in res.items()})
        out["time_eval_s"] = time.perf_counter() - t0
        return out

    def before(self, model, agent, engine, anchor) -> dict:
        """The initial policy's row (logged at step 0), announced and summed up on the console."""
        self.log("[tether] evaluating the initial policy on the held-out set: "
                 + ", ".join(f"{k} ({len(v[0])} problems)" for k, v in self.sets.items()))
        m = self.evaluate(model, agent, engine, anchor)
        self.log(f"[tether] held-out before training: {accuracy_line(m)}")
        return m

    def after(self, run_dir: Path, step: int) -> None:
        """Print the before -> after line once a run that evaluated reached its last step ``step``."""
        e = self.e
        if dist.is_main() and self.sets and step == self.steps and (e.after or e.every):
            self.log(f"[tether] held-out accuracy, before -> after training: {before_after(run_dir, e, self.sets)}")


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
