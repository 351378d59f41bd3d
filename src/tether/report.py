"""What a run measures and tells its user beside the update itself: the rollout's metrics, the
held-out evaluation and its accuracy lines, the reward-failure log and the rows of samples.jsonl (the
progress bar is `tether.metrics.Progress`, below the run loop).

* `rollout_metrics(...)` -- reward, accuracy, lengths, throughput of a step's rollouts (all ranks').
* `HeldOut` -- the held-out evaluation of ``eval.*``: its sets, when it is due, the policy's (and
  the anchor's) scores with the trainer's own agent and engine, and the lines printed before and
  after training.
* `accuracy_line(row)` -- ``arithmetic 22.0 % (100 problems)`` for a metrics row's held-out evals.
* `before_after(run_dir, eval_cfg, names)` -- the before -> after line printed at the end of a run,
  read back from metrics.jsonl (so a resumed run finds its step-0 evaluation too).
* `RewardErrorLog` -- counts failed reward calls; the first failure of each kind goes to
  ``RUN/reward_errors.log`` and to the console.
* `sample_rows(batch, n)` -- a few prompts, responses and rewards of a step for samples.jsonl.

Metrics are gathered on every rank (collectives); only rank 0 logs and writes. The trainer decides
when (see `tether.train`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import torch

from . import distributed as dist
from .algo import zero_variance_groups
from .eval import runner as eval_runner  # eval_runner.evaluate_during_training: read at call time (tests patch it)
from .metrics import read_metrics
from .resolve import eval_benchmarks, evaluating
from .tasks.stream import held_out_sets


def rollout_metrics(seen: list, kept_rewards: torch.Tensor, kept_groups: torch.Tensor, agent: dict) -> dict:
    """Metrics over every sampled response of a step, all ranks': ``seen`` holds each generation round's
    (RolloutBatch, rewards, correct), kept or dropped by dynamic sampling; ``kept_rewards`` /
    ``kept_groups`` are the global batch that trains; ``agent`` is the agent's own ``metrics()``."""
    rew, _ = dist.all_gather_cat(torch.cat([s[1] for s in seen]))
    cor, _ = dist.all_gather_cat(torch.cat([s[2] for s in seen]))
    length, _ = dist.all_gather_cat(torch.cat([s[0].response_lengths.float() for s in seen]))
    gen_time = dist.all_reduce(float(sum(s[0].gen_time_s for s in seen)), "max")  # wall time: the slowest rank
    gen_tokens = int(dist.all_reduce(float(sum(s[0].gen_tokens for s in seen))))
    n_trunc = int(dist.all_reduce(float(sum(f == "length" for s in seen for f in s[0].finish_reason))))
    agent = dist.mean_over_ranks(agent)
    return {
        "reward_mean": float(rew.mean()), "reward_std": float(rew.std()) if len(rew) > 1 else 0.0,
        "accuracy": float(cor.float().mean()), "response_len": float(length.mean()),
        "truncation_rate": n_trunc / max(len(rew), 1), "gen_tokens": gen_tokens,
        "gen_tokens_per_s": gen_tokens / max(gen_time, 1e-9), "time_gen_s": gen_time,
        "groups_zero_variance_frac": float(zero_variance_groups(kept_rewards, kept_groups).float().mean()),
        **agent,
    }


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


def sample_rows(b, n: int) -> list[dict]:
    """A few prompts, responses and rewards of a step (a `tether.passes.StepBatch`), for samples.jsonl."""
    rows = []
    for i in range(min(n, len(b.rb))):
        rows.append({"id": b.examples[i].id, "prompt": b.examples[i].prompt, "answer": b.examples[i].answer,
                     "response": b.rb.texts[i], "reward": float(b.rewards[i]), "correct": bool(b.correct[i]),
                     "finish_reason": b.rb.finish_reason[i]})
    return rows
