"""Issue #54, item 6: rank-1 LoRA at 1e-4 against full fine-tuning at 1e-5 on SmolLM2-135M, paired by seed.

The full fine-tuning arm is the synchronous arm of docs/evidence/smollm2_runs
(configs/sweeps/evidence_smollm2_async.yaml, the same base config as configs/sweeps/evidence_smollm2_lora.yaml's
``full_lr=1.0e-05``). Four of its five finals are in that report's report.json; seed 1's record was lost with an
earlier machine and its final is the one committed in 438040f's report (0.586). The LoRA arm's finals are read from
the run records of the sweep directories given. A full arm run re-run with today's code (``--rerun DIR``: seed 0)
must reproduce the committed final exactly, or the pairing is refused.

    python scripts/smollm2_lora_pairs.py sweeps/smollm2_lora sweeps/smollm2_lora_b --rerun sweeps/smollm2_lora_full
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from scipy import stats

ROOT = Path(__file__).resolve().parents[1]
METRIC = "eval/arithmetic/avg@1"
FULL, LORA = "full_lr=1.0e-05", "r1_lr=1.0e-04"
SEED1_FULL = 0.586  # sync seed 1 of docs/evidence/smollm2_runs, committed in 438040f's report.json (record lost)


def committed_full() -> dict[int, float]:
    """Seed -> final held-out accuracy of the committed synchronous (full fine-tuning) arm."""
    rep = json.loads((ROOT / "docs/evidence/smollm2_runs/report.json").read_text())
    out = {int(s): v for s, v in rep["results"][0]["arms"]["sync"]["per_seed"].items()}
    out.setdefault(1, SEED1_FULL)
    return dict(sorted(out.items()))


def curve(run: Path) -> dict[int, float]:
    """Step -> METRIC of one run directory's metrics.jsonl."""
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if METRIC in row:
            out[row["step"]] = row[METRIC]
    return out


def finals(dirs: list[Path], arm: str, steps: int = 16) -> dict[int, float]:
    """Seed -> final METRIC (at step ``steps``) of ``arm``'s finished runs in the sweep directories ``dirs``."""
    out = {}
    for d in dirs:
        for run in sorted((d / "runs" / arm).glob("seed-*")):
            if run.is_dir() and steps in (c := curve(run)):
                out[int(run.name.split("-")[1])] = c[steps]
    return dict(sorted(out.items()))


def cost(dirs: list[Path], arm: str, seed: int) -> tuple[float, float]:
    """Mean time_step_s (its steps 1-16) and the largest peak_rss_mb of one run."""
    for d in dirs:
        path = d / "runs" / arm / f"seed-{seed}" / "metrics.jsonl"
        if path.exists():
            rows = [json.loads(x) for x in path.read_text().splitlines()]
            return (statistics.mean(r["time_step_s"] for r in rows if "time_step_s" in r),
                    max(r["peak_rss_mb"] for r in rows if "peak_rss_mb" in r))
    raise SystemExit(f"no run {arm} seed {seed} in {', '.join(map(str, dirs))}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+", type=Path, help="sweep directories holding the LoRA arm's runs")
    ap.add_argument("--rerun", type=Path, required=True, help="sweep directory holding a re-run of the full arm")
    a = ap.parse_args()
    full = committed_full()
    again = finals([a.rerun], FULL)
    if not again:
        raise SystemExit(f"{a.rerun}: no finished {FULL} run")
    for s, v in again.items():
        if abs(v - full[s]) > 1e-9:
            raise SystemExit(f"{a.rerun}: {FULL} seed {s} ends at {v}, the committed run at {full[s]}: "
                             "today's code does not reproduce it, so the committed finals cannot be paired")
        print(f"full fine-tuning seed {s} re-run: {v:.3f} (committed {full[s]:.3f}): reproduced")
    lora = finals(a.dirs, LORA)
    seeds = sorted(set(full) & set(lora))
    if len(seeds) < 2:
        raise SystemExit(f"need two paired seeds, have {seeds}")
    diff = [100 * (lora[s] - full[s]) for s in seeds]
    n, m = len(diff), statistics.mean(diff)
    se = statistics.stdev(diff) / math.sqrt(n)
    t = stats.t.ppf(0.975, n - 1)
    print(f"{'seed':>5} {'full 1e-5':>10} {'r1 1e-4':>10} {'r1 - full':>10}")
    for s, d in zip(seeds, diff):
        print(f"{s:>5} {100 * full[s]:>10.1f} {100 * lora[s]:>10.1f} {d:>+10.1f}")
    for name, arm in (("full 1e-5", full), ("r1 1e-4", lora)):
        v = [100 * arm[s] for s in seeds]
        print(f"{name}: {statistics.mean(v):.1f} +- {statistics.stdev(v) / math.sqrt(n):.1f} % "
              f"(sd {statistics.stdev(v):.1f}) over seeds {seeds}")
    print(f"r1 - full, paired over {n} seeds: {m:+.1f} +- {se:.1f} points, "
          f"t 95 % CI [{m - t * se:+.1f}, {m + t * se:+.1f}]; r1 higher on {sum(d > 0 for d in diff)} of {n}")
    for s in sorted(again):
        if s in lora:
            (t_lora, m_lora), (t_full, m_full) = cost(a.dirs, LORA, s), cost([a.rerun], FULL, s)
            print(f"r1 / full, seed {s} (run side by side): step time {t_lora / t_full:.2f}x, "
                  f"peak RSS {m_lora / m_full:.2f}x ({m_lora:.0f} / {m_full:.0f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
