"""What a run measures and tells its user beside the update itself: the rollout's metrics, the
reward-failure log and the rows of samples.jsonl (the held-out evaluation and its accuracy lines are
`tether.eval.held_out`; the progress bar is `tether.metrics.Progress`, below the run loop).

* `rollout_metrics(...)` -- reward, accuracy, lengths, throughput of a step's rollouts (all ranks').
* `RewardErrorLog` -- counts failed reward calls; the first failure of each kind goes to
  ``RUN/reward_errors.log`` and to the console.
* `sample_rows(batch, n)` -- a few prompts, responses and rewards of a step for samples.jsonl.

Metrics are gathered on every rank (collectives); only rank 0 logs and writes. The trainer decides
when (see `tether.train`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from . import distributed as dist
from .algo import zero_variance_groups


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
