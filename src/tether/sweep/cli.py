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
    p.add_argument("--baseline", metavar="ARM", help="compare every arm with ARM only (default: every pair)")
    p.add_argument("--reps", type=positive_int, default=2000, help="bootstrap resamples (default 2000)")
    p.add_argument("--seed", type=int, default=0, help="the bootstrap's random seed (default 0)")
    p.add_argument("--collapse-drop", type=float, default=0.0, help="a run collapsed if its final value is below "
                   "its first point by more than this (default 0: any drop), or it failed or went non-finite")
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
    from .report import write_report  # deferred: pulls in numpy (tether.cli stays light)

    md = write_report(a.dirs, a.out, metric=a.metric, extra_metrics=tuple(a.also), last_n=a.last_n, reps=a.reps,
                      seed=a.seed, collapse_drop=a.collapse_drop, baseline=a.baseline)
    print(md)
    return 0


def _run(a) -> int:
    from pathlib import Path

    from ..errors import ConfigError  # deferred: loads json (tether.cli stays light)
    from .runner import action, run_sweep, train_command  # deferred: loads subprocess (tether.cli stays light)
    from .spec import check_arms, load_spec, parse_shard, shard  # deferred: pulls in yaml (tether.cli stays light)

    i, n = parse_shard(a.shard)
    spec = load_spec(a.spec)
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
