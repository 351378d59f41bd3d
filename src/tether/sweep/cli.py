"""``tether sweep SPEC.yaml --out DIR`` and ``tether sweep report DIR [DIR...]``: the command lines.

``tether sweep`` has two parsers of its own (a run and a report), chosen by its first argument, so that
``tether sweep SPEC.yaml`` needs no ``run`` word; ``tether.cli.main`` hands it every argument after
``sweep``. Nothing heavy is imported until a command runs.
"""

from __future__ import annotations

import argparse
import os

RUN_DESCRIPTION = (
    "Run a grid of `tether train` runs: the arms of SPEC.yaml (its axes' cartesian product plus its extra arms) "
    "times its seeds, as subprocesses in lanes, into DIR/runs/<arm>/seed-<s>/. Every arm's config is resolved "
    "(as `tether config` would) before any run starts. Resumable: run the same command again after a kill; done "
    "runs are never re-run, interrupted ones continue from their checkpoint. docs/sweeps.md describes the spec.")
RUN_EPILOG = (
    "Then: tether sweep report DIR (tether sweep report -h). Exit 0: every run of this share is done; 1: a run "
    "failed (recorded, with its stderr, in DIR/runs/<arm>/seed-<s>.json; --retry-failed re-runs it); 2: an error "
    "in the spec or the command; 130 / 143: stopped by SIGINT / SIGTERM (each running run checkpointed first).")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (else argparse's own one-line error naming the option, exit 2); also
    ``tether plot --smooth``'s."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0 (else argparse's own one-line error naming the option, exit 2)."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not x >= 0 or x == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return x


def run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tether sweep", description=RUN_DESCRIPTION, epilog=RUN_EPILOG)
    p.add_argument("spec", metavar="SPEC.yaml", help="the sweep's spec (docs/sweeps.md; configs/sweeps/example.yaml)")
    p.add_argument("--out", metavar="DIR", help="the sweep directory (required unless --dry-run)")
    p.add_argument("--lanes", type=positive_int, default=None,
                   help=f"runs at once (default: os.cpu_count(), here {os.cpu_count()})")
    p.add_argument("--threads", type=positive_int, default=1, help="threads per run (OMP_NUM_THREADS etc.; default 1)")
    p.add_argument("--shard", metavar="I/N", help="run only the I-th of N round-robin shares of the sorted "
                   "(arm, seed) list (a cluster array job: one share per task, into one shared DIR or one DIR each; "
                   "tether sweep report merges DIRs)")
    p.add_argument("--retry-failed", action="store_true", help="run again the runs recorded as failed (from their "
                   "checkpoint when they have one)")
    p.add_argument("--dry-run", action="store_true", help="check the spec, list the runs (and, with --out, what "
                   "each needs) and start nothing")
    p.add_argument("--seeds", metavar="SEEDS", help="replace the spec's seeds: a count (10: seeds 0-9), a range "
                   "(10-19) or a list (0,3,7-9); e.g. a second, disjoint set of seeds to replicate a result")
    p.add_argument("--arms", metavar="A,B", help="run only these arms of the spec (comma list of their names; "
                   "--dry-run lists them): e.g. only the arms a comparison needs")
    return p


def report_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tether sweep report", description="Write a sweep's report: learning curves with 95 % bands "
        "(PNG), per-arm tables (mean, s.e., sd, bootstrap CI, IQM, AUC, collapse rate, per-seed values) and "
        "pairwise comparisons (probability of improvement, paired differences by seed), as markdown, with every "
        "number in a JSON file beside it. Several DIRs (shards, added arms) merge. Definitions: docs/sweeps.md.")
    p.add_argument("dirs", nargs="+", metavar="DIR", help="sweep directories (tether sweep --out)")
    p.add_argument("--out", metavar="REPORT.md", help="the markdown's path (default DIR/report.md of the first DIR); "
                   "the PNG and JSON get its name with .png / .json")
    p.add_argument("--metric", help="the metric to compare (default: the spec's `metric`, else the first "
                   "eval/<benchmark>/avg@<n> the runs logged, else reward_mean)")
    p.add_argument("--also", action="append", default=[], metavar="METRIC",
                   help="one more metric to tabulate, e.g. reward_mean (repeatable)")
    p.add_argument("--last-n", type=positive_int, default=10, help="a training metric's final value: its mean over the "
                   "last N logged steps (default 10); an evaluation metric's is its last evaluation")
    p.add_argument("--baseline", metavar="ARM", help="compare every arm with ARM only (default: every pair), and "
                   "draw the paired differences against it as a forest plot, REPORT-forest.png (rliable's interval "
                   "estimates, one row per arm; with --set, one panel per seed set and the pooled one)")
    p.add_argument("--arms", metavar="A,B,...", help="report these arms only (comma-separated; default: every arm of "
                   "the DIRs), e.g. the arms a replication re-ran, merged with the sweep it replicates")
    p.add_argument("--reps", type=positive_int, default=2000, help="bootstrap resamples (default 2000)")
    p.add_argument("--seed", type=int, default=0, help="the bootstrap's random seed (default 0)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="NAME=SEEDS",
                   help="a named set of seeds (e.g. first=0-9, second=10-19; repeatable): each pair of arms is also "
                   "compared within every set and pooled, with a verdict: replicates (the pooled interval excludes 0 "
                   "and every set points the same way), sets disagree, or not shown")
    p.add_argument("--collapse-drop", type=non_negative_float, default=0.0, help="a run collapsed if its final "
                   "value is below its first point by more than this (>= 0; default 0: any drop), or it failed or went "
                   "non-finite")
    return p


def add_sweep_parser(sub) -> None:
    s = sub.add_parser("sweep", add_help=False, help="run a grid of training runs over seeds (tether sweep -h), "
                       "and report it (tether sweep report -h)")
    s.add_argument("argv", nargs=argparse.REMAINDER)
    s.set_defaults(fn=sweep_main)


def sweep_main(args) -> int:
    argv = list(args.argv)
    if argv[:1] == ["report"]:
        return _report(report_parser().parse_args(argv[1:]))
    return _run(run_parser().parse_args(argv))


def _report(a) -> int:
    from ..errors import ConfigError  # deferred: loads json (tether.cli stays light)
    from .report import write_report  # deferred: pulls in numpy (tether.cli stays light)
    from .spec import parse_seed_list  # deferred: pulls in yaml

    sets = {}
    for item in a.sets:
        name, eq, seeds = item.partition("=")
        if not eq or not name.strip():
            raise ConfigError(f"--set {item!r}: expected NAME=SEEDS, e.g. --set second=10-19")
        sets[name.strip()] = set(parse_seed_list(seeds, flag=f"--set {name.strip()}=", count=False))
    names = list(sets)
    for i, x in enumerate(names):
        for y in names[i + 1:]:
            if sets[x] & sets[y]:
                raise ConfigError(f"--set {x} and --set {y} share seeds {sorted(sets[x] & sets[y])}: sets are disjoint")
    md = write_report(a.dirs, a.out, metric=a.metric, extra_metrics=tuple(a.also), last_n=a.last_n, reps=a.reps,
                      seed=a.seed, collapse_drop=a.collapse_drop, baseline=a.baseline, sets=sets or None,
                      arms=[x.strip() for x in a.arms.split(",") if x.strip()] if a.arms is not None else None)
    print(md)
    return 0


def _run(a) -> int:
    from pathlib import Path

    from ..errors import ConfigError  # deferred: loads json (tether.cli stays light)
    from .runner import action, run_sweep, train_command  # deferred: loads subprocess (tether.cli stays light)
    from .spec import check_arms, load_spec, parse_shard, select, shard  # deferred: yaml (tether.cli stays light)

    i, n = parse_shard(a.shard)
    spec = select(load_spec(a.spec), seeds=a.seeds, arms=a.arms)
    configs = check_arms(spec)
    runs = shard(spec.runs(), i, n)
    if a.dry_run:
        out = Path(a.out) if a.out else Path("DIR")
        print(f"[sweep] {spec.path}: {len(spec.arms)} arm(s) x {len(spec.seeds)} seed(s) = {len(spec.runs())} run(s)"
              + (f"; share {i}/{n}: {len(runs)}" if n > 1 else ""))
        for arm, seed in runs:
            act = action(out, arm, seed, a.retry_failed) if a.out else "fresh"
            print(f"{arm} seed {seed} [{act}]: tether {' '.join(train_command(spec, arm, seed, out, act))}")
        return 0
    if not a.out:
        raise ConfigError("tether sweep: --out DIR is required (where the runs go), unless --dry-run")
    lanes = a.lanes or os.cpu_count() or 1
    return run_sweep(spec, configs, Path(a.out), runs, lanes=lanes, threads=a.threads,
                     retry_failed=a.retry_failed, shard=(i, n))
