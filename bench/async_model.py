"""A model on paper of the speed-up of asynchronous RL (train.async.max_staleness K) over the synchronous loop.

Inputs are measured times, each on the resources its side has in the run predicted (bench/async.py
measures them on this CPU; elsewhere, a run's metrics.jsonl:
``time_rollout_s`` and ``time_step_s - time_rollout_s`` of a K = 0 run, or ``async/worker_gen_s`` of a K >= 1
run): a sample of per-step generation times ``gen`` (their spread is the long tail: a batch waits for its
slowest response) and of update times ``upd`` (everything else of a trainer step: scoring, passes, update,
push). Output: the predicted seconds per step, and the speed-up sync / async.

* Synchronous: a step takes G_i + U_i.
* K >= 1 (tether's workers, verl's one-step-off for K = 1): `simulate` runs the event recurrence of
  tether.asynchronous.workers: L = max(K + 1, W) jobs in flight; job i is submitted when step i - L + 1 begins
  waiting (the end of step i - L), starts on the first free of W workers, is ready G_i later; step i starts at
  max(its batch ready, step i - 1 done) and takes U_i. With constant times this is max(G / W, U, (G + U) / L) per step,
  so the overlap alone is at most (G + U) / max(G, U) <= 2 (W = 1); with spread-out G_i, K = 1 pays
  E[max(G_i, U)] and a larger K absorbs the tail towards max(E[G] / W, E[U]).
* Streaming / partial rollouts (AReaL, verl's fully async): the generator refills finished slots, so a batch's
  generation costs its *mean* response, not its longest: G_i / tail with tail = E[max length] / E[mean length]
  over a batch (``--tail``, measured from response lengths).
* Resources (GPUs): colocated sync uses all N devices for both phases; a split gives N_g to generation and
  N - N_g to training. With linear scaling the async step is max(G N / N_g / tail, U N / (N - N_g)), minimized at
  N_g / N = (G / tail) / (G / tail + U), where speed-up = (G + U) / (G / tail + U): without the tail (tail = 1) a
  split gains nothing over colocation, and the gain is bounded by the tail and by how much of the sync step
  generation is: speed-up <= 1 / (g / tail + 1 - g), g = G / (G + U).

Usage::

    python bench/async_model.py --gen 10,12,30 --upd 5 --k 1,4          # seconds per step, from measurements
    python bench/async_model.py --paper                                  # what inputs verl / AReaL's figures need
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys


def simulate(gen: list[float], upd: list[float], k: int, workers: int = 1, steps: int = 2000,
             seed: int = 0) -> float:
    """Mean seconds per trainer step of K >= 1 (tether's job pipeline) with generation and update times drawn
    (i.i.d., with replacement) from the measured ``gen`` and ``upd``; ``k = 0``: the synchronous mean."""
    rng = random.Random(seed)
    g = [rng.choice(gen) for _ in range(steps)]
    u = [rng.choice(upd) for _ in range(steps)]
    if k == 0:
        return (sum(g) + sum(u)) / steps
    lookahead = max(k + 1, workers)
    free = [0.0] * workers  # when each worker is next free
    ready, end = [0.0] * steps, [0.0] * steps
    for i in range(steps):
        # jobs up to i + lookahead - 1 are submitted when step i begins waiting; so job i at the end of step i - L
        submit = end[i - lookahead] if i >= lookahead else 0.0
        w = min(range(workers), key=free.__getitem__)
        start = max(submit, free[w])
        free[w] = ready[i] = start + g[i]
        end[i] = max(ready[i], end[i - 1] if i else 0.0) + u[i]
    return end[-1] / steps


def speedup(gen: list[float], upd: list[float], k: int, workers: int = 1, tail: float = 1.0) -> float:
    """Synchronous seconds per step / K-step-off-policy seconds per step (streaming: generation / ``tail``)."""
    return simulate(gen, upd, 0) / simulate([x / tail for x in gen], upd, k, workers)


def split_speedup(gen_share: float, tail: float = 1.0) -> tuple[float, float]:
    """Colocated synchronous against the best split of the same devices (linear scaling): (speed-up, share of
    the devices that generate). ``gen_share`` = G / (G + U) of the synchronous step."""
    g, u = gen_share / tail, 1.0 - gen_share
    return 1.0 / (g + u), g / (g + u)


# What the papers report (their speed-up figures; the inputs that would produce them are ours, see --paper):
PAPERS = {
    "verl fully_async_policy (Qwen2.5-7B, 128 GPUs; recipe/fully_async_policy docs)": (2.35, 2.67),
    "AReaL (arXiv 2505.24298, 'up to 2.77x'; the issue quotes 2.27-2.77x)": (2.27, 2.77),
}


def paper_lines() -> list[str]:
    out = ["The papers do not state the generation share g and the tail (E[max] / E[mean] response length) of "
           "their runs in a form we have; below, the (g, tail) that the split model needs for their figures:"]
    for name, (lo, hi) in PAPERS.items():
        out.append(f"  {name}: {lo:.2f}-{hi:.2f}x")
        for g in (0.6, 0.7, 0.8, 0.9):
            need = [(target, g / (1 / target - (1 - g))) if 1 / target > 1 - g else (target, float("inf"))
                    for target in (lo, hi)]
            out.append("    g = {:.1f}: tail needed ".format(g) + ", ".join(
                f"{t:.2f}x -> {x:.2f}" if x != float("inf") else f"{t:.2f}x -> impossible (g too small)"
                for t, x in need))
    out.append("  The overlap alone (tail = 1, same devices) gives at most 2x, so figures above 2x come from the "
               "tail (streaming, partial rollouts) and/or from generation scaling worse than linearly when "
               "colocated; the model cannot separate the two without the papers' per-phase times.")
    return out


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gen", default="", help="measured generation seconds per step, comma-separated")
    p.add_argument("--upd", default="", help="measured update seconds per step, comma-separated")
    p.add_argument("--k", default="1,4", help="staleness bounds to predict (default 1,4)")
    p.add_argument("--workers", type=int, default=1, help="rollout workers (default 1)")
    p.add_argument("--tail", type=float, default=1.0, help="E[max]/E[mean] response length per batch, for "
                   "streaming generation (default 1: whole batches, as tether's workers)")
    p.add_argument("--paper", action="store_true", help="print what verl's and AReaL's figures need")
    a = p.parse_args(argv)
    if a.paper:
        print("\n".join(paper_lines()))
    if a.gen and a.upd:
        gen, upd = _floats(a.gen), _floats(a.upd)
        print(f"gen mean {statistics.mean(gen):.3f} s (max {max(gen):.3f}), update mean {statistics.mean(upd):.3f} s")
        for k in (int(x) for x in a.k.split(",")):
            print(f"K={k} workers={a.workers} tail={a.tail:g}: {simulate(gen, upd, k, a.workers):.3f} s/step, "
                  f"predicted speed-up {speedup(gen, upd, k, a.workers, a.tail):.2f}x")
    elif not a.paper:
        p.error("give --gen and --upd, or --paper")
    return 0


if __name__ == "__main__":
    sys.exit(main())
