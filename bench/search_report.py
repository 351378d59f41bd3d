"""The closed-pool search-agent results: curves of the training runs and dev EM before/after.

Reads run directories (``metrics.jsonl``) and ``tether eval --agent search`` output directories
(``results.json``), writes one PNG with four panels per metric (exact match, answered rate,
invalid-action rate, searches per response; one line per run) and prints Markdown tables:
the per-step curves and the dev metrics of each evaluation.

With ``--base NAME`` it also prints each evaluation's exact match paired against evaluation NAME
on the same questions (the difference and its paired standard error, each question its own
cluster, as bench/recipes_compare's ``clustered_se``: evaluation noise with the trained policies held
fixed, never the significance of a training effect, which is judged by how much whole runs differ),
the EM of each source dataset beside the paper's search table, and ``--per-problem FILE`` keeps every
question's EM per evaluation. ``--seeds GROUP=EVAL,EVAL`` pools a recipe's seeds into one row (EM per
seed, their mean, paired differences with their across-seed s.e., the error of a training effect,
beside the evaluation noise).

Usage::

    python bench/search_report.py --runs grpo=RUN_A ema_pg=RUN_B \\
        --evals initial=EVAL_0 grpo=EVAL_A ema_pg=EVAL_B --out docs/results_search.png \\
        --base initial --per-problem docs/results_search.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recipes_compare.report import clustered_se  # noqa: E402

CURVES = [("accuracy", "exact match (train samples)"), ("search/answered_rate", "answered rate"),
          ("search/invalid_action_rate", "invalid-action rate (per turn)"),
          ("search/searches", "searches per response")]
DEV = [("search/em", "EM"), ("search/f1", "F1"), ("search/answered_rate", "answered"), ("search/searches", "searches"),
       ("search/gold_recall", "gold recall")]


def _pairs(items: list[str], flag: str) -> dict[str, Path]:
    out = {}
    for it in items:
        name, sep, path = it.partition("=")
        if not sep:
            raise SystemExit(f"{flag} takes NAME=PATH, got {it!r}")
        out[name] = Path(path)
    return out


#: The paper's search table (EMA-PG, arXiv 2602.04417; Qwen2.5-3B base, e5 over Wikipedia-2018, top 3, up to 4
#: turns, exact match): the figures it reports for the datasets our closed pool shares.
PAPER = {"hotpotqa": {"grpo": 29.7, "ema_pg": 44.1}, "2wikimultihopqa": {"grpo": 27.4, "ema_pg": 40.1}}


def _rows(d: Path) -> dict[str, list[dict]]:
    """benchmark -> its per-question rows (``tether eval``'s BENCH.jsonl)."""
    res = json.loads((d / "results.json").read_text())
    return {b: [json.loads(x) for x in (d / v["file"]).read_text().splitlines() if x.strip()]
            for b, v in res["benchmarks"].items()}


def paired_table(evals: dict[str, Path], base: str) -> tuple[str, dict]:
    """Markdown: each evaluation's EM minus ``base``'s on the same questions, with the paired s.e.; and the
    per-question record {"id": [...], "em": {name: [0/1, ...]}} of the first benchmark."""
    if base not in evals:
        raise SystemExit(f"--base {base!r} is not one of --evals ({', '.join(evals)})")
    rows = {n: _rows(d) for n, d in evals.items()}
    bench = next(iter(rows[base]))
    em = {}
    for n, r in rows.items():
        if bench not in r:
            raise SystemExit(f"evaluation {n!r} has no benchmark {bench!r}")
        em[n] = {q["id"]: int(bool(q["correct"][0])) for q in r[bench]}
    ids = [q["id"] for q in rows[base][bench]]
    lines = [f"| model | EM | vs {base}: difference | evaluation noise (policy held fixed): paired s.e. | questions |",
             "| --- | --- | --- | --- | --- |"]
    for n in evals:
        common = [i for i in ids if i in em[n]]
        x, y = [em[base][i] for i in common], [em[n][i] for i in common]
        mean = 100 * sum(y) / max(len(y), 1)
        if n == base:
            lines.append(f"| {n} | {mean:.1f} | - | - | {len(common)} |")
            continue
        se = clustered_se(x, y, common)
        diff = 100 * (sum(y) - sum(x)) / max(len(common), 1)
        lines.append(f"| {n} | {mean:.1f} | {diff:+.1f} | {'-' if se is None else f'{100 * se:.1f}'} | {len(common)} |")
    record = {"benchmark": bench, "id": ids, "em": {n: [em[n].get(i) for i in ids] for n in evals}}
    return "\n".join(lines), record


def seeds_table(record: dict, groups: dict[str, list[str]], base: str) -> str:
    """Markdown: each group of seeds (one recipe's runs) pooled. Its EM per seed and their mean; the mean's
    difference from ``base`` (a single evaluation, e.g. the SFT start) and from every other group, seed i of one
    group paired with seed i of the other, with two errors: "across seeds", the s.e. of the mean of the seeds'
    differences (their sd / sqrt(seeds); "-" under two seeds), how much whole runs differ, the error of a
    training effect; and "evaluation noise", the s.e. of a paired difference where each question is one
    cluster holding all of its seeds' draws: question sampling and within-question seed noise, with the
    trained policies held fixed, not the significance of a training effect."""
    em, n_q = record["em"], len(record["id"])
    for g, names in groups.items():
        missing = [n for n in names if n not in em]
        if missing:
            raise SystemExit(f"--seeds {g}: {', '.join(missing)} not among --evals")

    def mean(xs):
        return 100 * sum(xs) / max(len(xs), 1)

    def diff(a: list[str], b: list[str]) -> str:  # b minus a, seeds paired by position (a single base repeats)
        a = a * len(b) if len(a) == 1 else a
        if len(a) != len(b):
            return "- (unequal seeds)"
        x = [v for n in a for v in em[n]]
        y = [v for n in b for v in em[n]]
        ids = [q for _ in b for q in record["id"]]
        se = clustered_se(x, y, ids)
        per_seed = [mean(em[m]) - mean(em[n]) for n, m in zip(a, b)]
        across = "-"
        if len(per_seed) > 1:
            mu = sum(per_seed) / len(per_seed)
            sd = (sum((d - mu) ** 2 for d in per_seed) / (len(per_seed) - 1)) ** 0.5
            across = f"{sd / len(per_seed) ** 0.5:.1f}"
        return (f"{mean(y) - mean(x):+.1f} (across seeds {across}; evaluation noise "
                f"{'-' if se is None else f'{100 * se:.1f}'})")

    lines = [f"| recipe | seeds | EM per seed | mean EM | vs {base} | " + " | ".join(f"vs {g}" for g in groups) + " |",
             "| --- | --- | --- | --- | --- |" + " --- |" * len(groups)]
    for g, names in groups.items():
        cells = [diff(groups[h], names) if h != g else "-" for h in groups]
        lines.append(f"| {g} | {len(names)} | " + ", ".join(f"{mean(em[n]):.1f}" for n in names)
                     + f" | {mean([v for n in names for v in em[n]]):.1f} | {diff([base], names)} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + f"\n\n({n_q} questions; each row's differences are its mean minus the column's)"


def source_table(evals: dict[str, Path]) -> str:
    """Markdown: EM per source dataset of each evaluation, beside the paper's figures (3B, full Wikipedia)."""
    res = {n: json.loads((d / "results.json").read_text()) for n, d in evals.items()}
    sources = sorted({k.split("/")[1] for r in res.values() for b in r["benchmarks"].values()
                      for k in b["metrics"] if k.startswith("search/") and k.endswith("/em") and k.count("/") == 2})
    head = "| model | " + " | ".join(sources) + " |"
    lines = [head, "| --- |" + " --- |" * len(sources)]
    for n, r in res.items():
        m = next(iter(r["benchmarks"].values()))["metrics"]
        cells = [f"{100 * m[f'search/{s}/em']:.1f}" if f"search/{s}/em" in m else "-" for s in sources]
        lines.append(f"| {n} (closed pool, 135M, CPU) | " + " | ".join(cells) + " |")
    for recipe in ("grpo", "ema_pg"):
        cells = [f"{PAPER[s][recipe]:.1f}" if s in PAPER else "-" for s in sources]
        lines.append(f"| paper {recipe} (Qwen2.5-3B, Wikipedia-2018) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs="+", required=True, help="NAME=RUN_DIR of each training run")
    p.add_argument("--evals", nargs="*", default=[], help="NAME=EVAL_OUT of each tether eval --agent search")
    p.add_argument("--out", required=True, help="PNG of the curves")
    p.add_argument("--base", default=None, help="NAME of the evaluation the others are paired against")
    p.add_argument("--per-problem", default=None, help="JSON file for every question's EM per evaluation "
                   "(with --base)")
    p.add_argument("--seeds", nargs="*", default=[], help="GROUP=EVAL1,EVAL2,... (with --base): pool a recipe's "
                   "seeds (names from --evals) into one row, paired against --base and the other groups")
    a = p.parse_args(argv)
    groups = {g: [n for n in v.split(",") if n] for g, v in
              ((k, str(v)) for k, v in _pairs(a.seeds, "--seeds").items())}
    runs = {k: [json.loads(x) for x in (v / "metrics.jsonl").read_text().splitlines() if x.strip()]
            for k, v in _pairs(a.runs, "--runs").items()}

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CURVES), figsize=(4.2 * len(CURVES), 3.2))
    for ax, (key, title) in zip(axes, CURVES):
        for name, rows in runs.items():
            ax.plot([r["step"] for r in rows], [r.get(key, float("nan")) for r in rows], marker="o", ms=3, label=name)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("trainer step")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(f"curves: {a.out}\n")

    for name, rows in runs.items():
        print(f"### {name}: {len(rows)} steps, {sum(r['time_step_s'] for r in rows) / 60:.1f} min of steps\n")
        print("| step | reward | EM | answered | invalid/turn | searches | turns | obs tokens | s/step |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in rows:
            print(f"| {r['step']} | {r['reward_mean']:.3f} | {r['accuracy']:.3f} | {r['search/answered_rate']:.2f} | "
                  f"{r['search/invalid_action_rate']:.2f} | {r['search/searches']:.2f} | {r['search/turns']:.2f} | "
                  f"{r['search/obs_tokens']:.0f} | {r['time_step_s']:.0f} |")
        print()
    if a.evals:
        print("| model | problems | " + " | ".join(t for _, t in DEV) + " |")
        print("| --- | --- | " + " | ".join("---" for _ in DEV) + " |")
        for name, d in _pairs(a.evals, "--evals").items():
            res = json.loads((d / "results.json").read_text())
            for bench, b in res["benchmarks"].items():
                m = b["metrics"]
                cells = [f"{100 * m[k]:.1f}" if k != "search/searches" else f"{m[k]:.2f}" for k, _ in DEV]
                print(f"| {name} ({bench}) | {int(m['n_problems'])} | " + " | ".join(cells) + " |")
    if a.base:
        evals = _pairs(a.evals, "--evals")
        table, record = paired_table(evals, a.base)
        print("\n" + table + "\n\n" + source_table(evals))
        if groups:
            print("\n" + seeds_table(record, groups, a.base))
        if a.per_problem:
            Path(a.per_problem).write_text(json.dumps(record) + "\n")
            print(f"\nper-question EM: {a.per_problem}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
