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
import statistics
import sys
from pathlib import Path

from tether.errors import ConfigError, OutputError
from tether.sweep.results import Run, collect, final_value
from tether.sweep.stats import paired_difference, summary
from tether.userio import loads_json

ROOT = Path(__file__).resolve().parents[1]
METRIC = "eval/arithmetic/avg@1"
FULL, LORA = "full_lr=1.0e-05", "r1_lr=1.0e-04"
SEED1_FULL = 0.586  # sync seed 1 of docs/evidence/smollm2_runs, committed in 438040f's report.json (record lost)


def committed_full() -> dict[int, float]:
    """Seed -> final held-out accuracy of the committed synchronous (full fine-tuning) arm."""
    rep = loads_json((ROOT / "docs/evidence/smollm2_runs/report.json").read_text())
    out = {int(s): v for s, v in rep["results"][0]["arms"]["sync"]["per_seed"].items()}
    out.setdefault(1, SEED1_FULL)
    return dict(sorted(out.items()))


def done_runs(dirs: list[Path], arm: str) -> dict[int, Run]:
    """Seed -> the done run of ``arm`` in the sweep directories ``dirs`` (`tether.sweep.results.collect`)."""
    try:
        return {r.seed: r for r in collect(dirs).of(arm)}
    except (ConfigError, OutputError) as e:  # not a sweep directory, a run done twice: its one line
        raise SystemExit(f"error: {e}") from None


def cost(run: Run) -> tuple[float, float]:
    """Mean time_step_s (its steps 1-16) and the largest peak_rss_mb of one run."""
    return (statistics.mean(r["time_step_s"] for r in run.rows if "time_step_s" in r),
            max(r["peak_rss_mb"] for r in run.rows if "peak_rss_mb" in r))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+", type=Path, help="sweep directories holding the LoRA arm's runs")
    ap.add_argument("--rerun", type=Path, required=True, help="sweep directory holding a re-run of the full arm")
    a = ap.parse_args()
    full = committed_full()
    rerun = done_runs([a.rerun], FULL)
    if not rerun:
        raise SystemExit(f"{a.rerun}: no finished {FULL} run")
    for s, run in rerun.items():
        v = final_value(run, METRIC, last_n=1)
        if v is None or abs(v - full[s]) > 1e-9:
            raise SystemExit(f"{a.rerun}: {FULL} seed {s} ends at {v}, the committed run at {full[s]}: "
                             "today's code does not reproduce it, so the committed finals cannot be paired")
        print(f"full fine-tuning seed {s} re-run: {v:.3f} (committed {full[s]:.3f}): reproduced")
    runs = done_runs(a.dirs, LORA)
    lora = {s: v for s, r in runs.items() if (v := final_value(r, METRIC, last_n=1)) is not None}
    pd = paired_difference({s: 100 * v for s, v in lora.items()}, {s: 100 * v for s, v in full.items()})
    if pd["ci"] is None:
        raise SystemExit(f"need two paired seeds, have {sorted(pd['diffs'])}")
    seeds = sorted(pd["diffs"])
    print(f"{'seed':>5} {'full 1e-5':>10} {'r1 1e-4':>10} {'r1 - full':>10}")
    for s in seeds:
        print(f"{s:>5} {100 * full[s]:>10.1f} {100 * lora[s]:>10.1f} {pd['diffs'][s]:>+10.1f}")
    for name, arm in (("full 1e-5", full), ("r1 1e-4", lora)):
        sm = summary([100 * arm[s] for s in seeds])
        print(f"{name}: {sm['mean']:.1f} +- {sm['se']:.1f} % (sd {sm['sd']:.1f}) over seeds {seeds}")
    (lo, hi), n = pd["ci"], pd["n"]
    print(f"r1 - full, paired over {n} seeds: {pd['mean']:+.1f} +- {pd['se']:.1f} points, t 95 % CI [{lo:+.1f}, "
          f"{hi:+.1f}]; r1 higher on {sum(d > 0 for d in pd['diffs'].values())} of {n}")
    for s in sorted(set(rerun) & set(runs)):
        (t_lora, m_lora), (t_full, m_full) = cost(runs[s]), cost(rerun[s])
        print(f"r1 / full, seed {s} (run side by side): step time {t_lora / t_full:.2f}x, "
              f"peak RSS {m_lora / m_full:.2f}x ({m_lora:.0f} / {m_full:.0f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
