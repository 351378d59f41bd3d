"""``eval.benchmarks=auto``: the held-out set of a training task, from the tasks' registered ``held_out``
(`tether.tasks.registry.TASKS`; tasks not listed have none)."""

from __future__ import annotations

from ..config.schema import Config
from ..tasks.registry import TASKS, held_out_benchmark

#: task name -> its held-out benchmark
HELD_OUT = {k: v for n in TASKS if isinstance(TASKS.meta(n)["held_out"], dict)
            for k, v in TASKS.meta(n)["held_out"].items()}


def eval_benchmarks(cfg: "Config") -> list[str]:
    """eval.benchmarks with ``auto`` replaced by the training task's held-out set (dropped if it has none)."""
    out = []
    for b in cfg.eval.benchmarks:
        if b != "auto":
            out.append(b)
        elif held_out_benchmark(cfg) is not None:
            out.append(held_out_benchmark(cfg))
    return list(dict.fromkeys(out))


def evaluating(cfg: "Config") -> bool:
    """Whether the run evaluates at all (before, after or every N steps) on at least one benchmark."""
    return cfg.eval.scheduled and bool(eval_benchmarks(cfg))
