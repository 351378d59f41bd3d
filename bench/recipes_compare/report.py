"""The markdown report: how the numbers were made, the budgets, Tables 1-4, and a hand-written
reading that survives re-rendering (the PNG is ``plot``'s, the JSON ``running``'s)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import _benchutil as bu

from .args import as_per_task
from .args import variant_text as _variant_text
from .plot import make_plot
from .results import mean as _mean
from .results import num as _num
from .results import paths_of, reported, run_key, runs_of

PLACEHOLDER = ("_Placeholder, written by hand after the run: what the tables and the plot show, including "
               "where EMA-PG or RPG do not beat GRPO at this scale. The script writes only measured numbers "
               "and no conclusions._")


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def _sci(x) -> str:
    return "-" if x is None else f"{x:.2e}"


def _f3(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def _f1(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def _dur(s) -> str:
    s = float(s or 0)
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m{int(s % 60):02d}s" if s >= 3600 else \
        f"{int(s // 60)}m{int(s % 60):02d}s"



def _sd(xs) -> float | None:
    """Sample standard deviation of the numbers in ``xs`` (None entries dropped); None under two."""
    xs = [x for x in xs if x is not None]
    if len(xs) < 2:
        return None
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def clustered_se(before: list[int], after: list[int] | None, clusters: list[str]) -> float | None:
    """Cluster-robust standard error of mean(after - before) (or of mean(before) when ``after`` is None)
    with problems grouped by content: sqrt(C/(C-1) * sum_c (sum_{i in c} (d_i - mean d))^2) / n. Problems that
    share a content are not independent draws, so this is the honest error bar of the evaluation (the binomial
    one assumes they are). It holds the trained policy fixed: the error of a training effect is the spread
    across seeds (Table 1's across-seed s.e.)."""
    d = [float(x) for x in before] if after is None else [float(y - x) for x, y in zip(before, after)]
    n = len(d)
    if n == 0 or len(clusters) != n:
        return None
    mean = sum(d) / n
    sums: dict[str, float] = {}
    for x, c in zip(d, clusters):
        sums[c] = sums.get(c, 0.0) + (x - mean)
    C = len(sums)
    if C < 2:
        return None
    return math.sqrt(C / (C - 1) * sum(v * v for v in sums.values())) / n


def recipe_trainer_text(settings: dict) -> str:
    """The trainer settings the compared recipes bring with them ('none' when none does)."""
    parts = ["{}: {}".format(r, ", ".join(f"`{k}={v}`" for k, v in s.items())) for r, s in settings.items() if s]
    if not parts:
        return "none"
    text = "; ".join(parts)
    if any(s.get("rollout.dynamic_sampling") for s in settings.values()):
        text += (". Dynamic sampling generates more than the other recipes; the generated tokens of every run "
                 "are in Table 4")
    return text



def render(res: dict, out: Path, png: Path) -> str:
    L = _made(res, out) + _budgets(res)
    L += ["", "## Reward curves", "", f"![training curves per step]({png.name})", "",
          "Per trainer step: training reward and accuracy of the sampled responses, the token KL to the anchor, "
          "the policy's entropy, the clip fraction and the response length. "
          "Thick line: mean over seeds; band: min-max over seeds; thin lines: the individual seeds.", ""]

    L += _table1(res) + _table2(res) + _table3(res) + _table4(res)
    L += ["### Reading these numbers", "", PLACEHOLDER, ""]
    return "\n".join(L)


def _made(res: dict, out: Path) -> list[str]:
    """The title and 'How these numbers were made': the commands, commits, wall times and machine."""
    st, info = res["settings"], res["machine"]
    L = ["# Results: recipe comparison", "",
         "Written by `bench/compare_recipes.py` from the runs described below; every number in this file was "
         "measured by it (all of them are also in "
         f"[`{paths_of(out)[0].name}`]({paths_of(out)[0].name})).", ""]
    L += ["## How these numbers were made", ""]
    cmds = res.get("commands", [])
    L.append("Command(s), from the repository root" + (" (later ones resumed the earlier)" if len(cmds) > 1 else "")
             + ":")
    L += ["", "```", *[c["command"] for c in cmds], "```", ""]
    for c in cmds:
        L.append(f"- {c['started']}" + (f" (commit `{c['commit']}`)" if c.get("commit") else "")
                 + f": ran {c.get('runs_run', '?')} run(s), wall time {_dur(c.get('wall_s'))}"
                 + (" (interrupted)" if c.get("interrupted") else "") + (f". {c['note']}" if c.get("note") else ""))
    L += [f"- total wall time: {_dur(sum(float(c.get('wall_s') or 0) for c in cmds))}",
          f"- machine: {info['nproc']} CPUs (`nproc`), {info['cpu']}, {info['memory']} RAM; torch threads "
          f"{info.get('torch_threads')}",
          f"- versions: python {info['python']}, torch {info['torch']}, transformers {info['transformers']}",
          f"- model: `{st['model']}`" + (" (SmolLM2-135M-Instruct, embedded GGUF dequantized to fp32)"
                                          if st["model"] == "smollm2" else "") + ", fp32, CPU", ""]
    return L


def _budgets(res: dict) -> list[str]:
    """'Budgets': what every run shares, the variants, the algorithms, evaluation and KL settings."""
    st = res["settings"]
    L: list[str] = []
    L += ["## Budgets (identical for every recipe)", "",
          f"- recipes: {', '.join(st['recipes'])}; seeds: {', '.join(map(str, st['seeds']))} (every recipe runs "
          f"every seed; the seeds were fixed before any run); tasks: {', '.join(st['tasks'])}",
          "- training per run: trainer steps " + ", ".join(f"{t} {n}" for t, n in as_per_task(st["steps"]).items()
                                                            if t in st["tasks"])
          + f" x {st['prompts_per_step']} prompts x {st['samples']} "
          f"samples at temperature {st.get('temperature', 1.0):g}; max new tokens "
          + ", ".join(f"{t} {n}" for t, n in st["max_new_tokens"].items())
          + f"; AdamW lr {st['lr']:g} (constant), {st.get('mini_batches', 1)} optimizer step(s) per rollout batch "
            f"(train.mini_batches), gradient clip 1.0, micro-batches of {st['micro_batch_size']}; EMA anchors move "
            f"every {st.get('anchor_every', '-')} steps (algo.anchor.every); otherwise "
            "each recipe's own algorithm settings (`tether.config.recipes`)",
          *(["- variants (`--variant`): " + "; ".join(_variant_text(k, v) for k, v in st["variants"].items())]
            if st.get("variants") else []),
          "- algorithms (`tether.algo.describe`): " + "; ".join(
              f"`{d}`" for d in dict.fromkeys(r.get("algo") for r in res["runs"].values() if r.get("algo"))),
          "- data order: the seed fixes it (the synthetic stream, or the shuffled GSM8K train order), so every "
          "recipe sees the same prompts in the same order, except that DAPO's dynamic sampling draws extra "
          "prompts when it refills",
          "- recipe-specific trainer settings (part of the recipe, `tether.config.RECIPE_TRAINER_DEFAULTS`): "
          + recipe_trainer_text(res.get("recipe_trainer_settings", {})),
          "- training reward: correctness (1/0)" + (f" + {st.get('format_weight', 0.2):g} if the answer is in the "
                                                    "requested `####` format" if st.get("format_weight", 0.2) else
                                                    " only (no format bonus)") + "; DAPO's "
          "reward also carries its overlong penalty (so its reward curve is not on exactly the same scale; the "
          "accuracy curves are)",
          "- evaluation (before and after, identical): greedy, one response per problem, max new tokens "
          + ", ".join(f"{t} {n}" for t, n in st["eval_max_new_tokens"].items())
          + ", accuracy = `avg@1` of `tether.eval.evaluate`",
          f"- KL and entropy: on the first {st['kl_prompts']} held-out prompts, one response each sampled from "
          f"the final policy at temperature 1 (max new tokens "
          + ", ".join(f"{t} {n}" for t, n in st["kl_max_new_tokens"].items())
          + "); at every response token the full-vocabulary log-probs of the final policy and of the initial "
          "model (`tether.logprobs.response_stats`): KL = token mean of sum_v p log(p/q), entropy = token mean "
          "of -sum_v p log p of the final policy, in nats", ""]
    for task in st["tasks"]:
        b = res.get("before", {}).get(task)
        if b:
            L.append(f"- {task} held-out set: {b.get('description', '')}")
    return L


def _table1(res: dict) -> list[str]:
    """Table 1: held-out accuracy before and after; the change's spread across seeds (the error of a training
    effect) and each seed's evaluation noise (clustered standard errors, the trained policy held fixed)."""
    st, md = res["settings"], bu.md_table
    L: list[str] = []
    L += ["## Table 1: held-out accuracy before and after training", "",
          "Greedy accuracy in %; 'before' is the initial model (one evaluation per task), 'after' each run's "
          "final policy; mean over the seeds that finished, then each seed. Across-seed s.e.: the standard "
          "deviation of the seeds' changes / sqrt(seeds), from how much whole runs differ: the error of the mean "
          "change as a training effect. Evaluation noise (policy held fixed): each seed's change's standard "
          "error over the problems, what the same trained policy would show on other problems; it is not the "
          "significance of a training effect.", ""]
    for task in st["tasks"]:
        b = res.get("before", {}).get(task, {})
        be = b.get("eval", {})
        acc0 = _num(be.get("avg@1"))
        n = int(be.get("n_problems", 0) or 0)
        se = math.sqrt(acc0 * (1 - acc0) / n) if acc0 is not None and n else None
        L += [f"### {task} ({n} problems)", ""]
        rows = []
        for recipe in st["recipes"]:
            rs = runs_of(res, task, recipe)
            ok = [r for r in rs if r.get("status") == "ok"]
            after = [_num(r["eval"].get("avg@1")) for r in ok]
            m = _mean(after)
            per = ", ".join(f"s{r['seed']}: " + (_pct(_num(r["eval"].get("avg@1"))) if r.get("status") == "ok"
                                                 else "failed") for r in rs) or "not run"
            contents, c0 = b.get("contents"), be.get("correct")
            ses = [clustered_se(c0, r["eval"].get("correct"), contents) if contents and c0 and r["eval"].get("correct")
                   else None for r in ok]
            sd_after, n_after = _sd(after), sum(x is not None for x in after)
            rows.append([recipe, _pct(acc0), _pct(m),
                         "-" if m is None or acc0 is None else f"{100 * (m - acc0):+.1f}",
                         "-" if sd_after is None else f"{_pct(sd_after / math.sqrt(n_after))} ({n_after})", per,
                         ", ".join(_pct(x) for x in ses) or "-",
                         _f1(_mean([_num(r["eval"].get("mean_response_tokens")) for r in ok])),
                         _pct(_mean([_num(r["eval"].get("truncation_rate")) for r in ok]))])
        L += [md(["recipe", "before %", "after % (mean)", "change (points)", "change: across-seed s.e. (seeds)",
                  "after % per seed", "evaluation noise of each seed's change (policy held fixed; clustered s.e.)",
                  "mean response tokens (after)", "truncated % (after)"],
                 rows), ""]
        contents = b.get("contents")
        n_c = len(set(contents)) if contents else None
        cse = clustered_se(be["correct"], None, contents) if contents and be.get("correct") else None
        L.append(f"Before: {_pct(acc0)} % (binomial s.e. {_pct(se)} points"
                 + (f"; clustered by the {n_c} distinct problem contents, {_pct(cse)} points" if cse is not None
                    else "") + f"), mean response {_f1(_num(be.get('mean_response_tokens')))} tokens, "
                 f"truncated {_pct(_num(be.get('truncation_rate')))} %. The clustered standard errors group the "
                 "held-out problems by content (arithmetic: start value and operations, told in different words), "
                 "since problems that share one are not independent; '-' where a run kept no per-problem results.")
        L.append("")

    return L


def _table2(res: dict) -> list[str]:
    """Table 2: the exact KL to the initial model and the entropy of the final policy."""
    st, md = res["settings"], bu.md_table
    L: list[str] = []
    L += ["## Table 2: KL to the initial model and entropy at the end", "",
          "Token-mean exact KL(pi_final || pi_initial) over the full vocabulary and token-mean entropy of "
          "pi_final (nats), on the final policy's own temperature-1 samples (see Budgets); mean over seeds, then "
          "each seed. The 'initial model' row is the initial model measured the same way on its own samples "
          "(its KL to itself is a check: it must be 0).", ""]
    for task in st["tasks"]:
        b = res.get("before", {}).get(task, {})
        L += [f"### {task}", ""]
        rows = [["initial model", _sci(_num(b.get("kl_to_initial"))), "-", _f3(_num(b.get("entropy"))), "-",
                 str(b.get("kl_tokens", "-"))]]
        for recipe in st["recipes"]:
            rs = runs_of(res, task, recipe)
            ok = [r for r in rs if r.get("status") == "ok"]
            per_kl = ", ".join(f"s{r['seed']}: " + (_sci(_num(r.get("kl_to_initial"))) if r.get("status") == "ok"
                                                    else "failed") for r in rs) or "not run"
            per_h = ", ".join(f"s{r['seed']}: " + (_f3(_num(r.get("entropy"))) if r.get("status") == "ok"
                                                   else "failed") for r in rs) or "not run"
            rows.append([recipe, _sci(_mean([_num(r.get("kl_to_initial")) for r in ok])), per_kl,
                         _f3(_mean([_num(r.get("entropy")) for r in ok])), per_h,
                         ", ".join(str(r.get("kl_tokens")) for r in ok) or "-"])
        L += [md(["recipe", "KL to initial (mean)", "KL per seed", "entropy (mean)", "entropy per seed",
                  "tokens measured"], rows), ""]

    return L


def _table3(res: dict) -> list[str]:
    """Table 3: clip fractions, the KL to the anchor, entropy and lengths during training, anchor updates."""
    st, md = res["settings"], bu.md_table
    L: list[str] = []
    L += ["## Table 3: trust regions, anchors and dynamics during training", "",
          "Per-step training metrics, mean over the run's steps, then over seeds (each seed's in brackets for the "
          "total). Clip fractions are fractions of response tokens whose gradient the trust region removes "
          "(`clip_frac_low`: ratio below the region with a negative advantage, `clip_frac_high`: above it with a "
          "positive one, `clip_frac`: total, incl. dual-clip), averaged over the optimizer steps of a trainer step; "
          "with one optimizer step per rollout they are 0 by construction. Token KL to the anchor: the recipe's "
          "KL estimator at the first and the last step (its anchor: the initial model for grpo / atr_grpo, the "
          "EMA for ema_pg, the sampler for rpg). Entropy and response length: first step -> last step.", ""]
    for task in st["tasks"]:
        rows = []
        for recipe in st["recipes"]:
            ok = [r for r in runs_of(res, task, recipe) if r.get("status") == "ok" and r.get("steps")]
            if not ok:
                rows.append([recipe] + ["-"] * 8)
                continue

            def run_mean(r, k):
                return _mean([_num(x.get(k)) for x in r["steps"] if x.get("step", 0) > 0])

            def first_last(k, fmt):
                f = _mean([_num(next((x.get(k) for x in r["steps"] if x.get("step", 0) > 0), None)) for r in ok])
                la = _mean([_num(r["steps"][-1].get(k)) for r in ok])
                return f"{fmt(f)} -> {fmt(la)}"

            tot = [run_mean(r, "clip_frac") for r in ok]
            rows.append([recipe, _pct(_mean([run_mean(r, "clip_frac_low") for r in ok])),
                         _pct(_mean([run_mean(r, "clip_frac_high") for r in ok])),
                         _pct(_mean(tot)) + " (" + ", ".join(_pct(x) for x in tot) + ")",
                         first_last("kl", _sci), first_last("entropy", _f3), first_last("response_len", _f1),
                         first_last("truncation_rate", _pct),
                         anchor_updates_cell(ok)])
        L += [f"### {task}", "", md(["recipe", "clip low %", "clip high %", "clip total % (per seed)",
                                     "token KL to anchor, first -> last", "entropy first -> last",
                                     "response tokens first -> last", "truncated % first -> last",
                                     "anchor updates"], rows), ""]

    return L


def _table4(res: dict) -> list[str]:
    """Table 4: per-run status, wall times, generated tokens and rewards (a failed run's last error line)."""
    st, md = res["settings"], bu.md_table
    L: list[str] = []
    L += ["## Table 4: per-run wall time and generated tokens", "",
          "train s: the training loop (rollouts and updates); eval s: the greedy held-out evaluation; KL s: "
          "sampling and the two full-vocabulary passes. generated tokens: all tokens sampled during training "
          "(DAPO's refills included); rounds: generation rounds (steps, plus DAPO's refills); reward: mean "
          "training reward of the first and the last step; anchor updates: EMA updates / resets of the KL "
          "anchor during the run (0 for a fixed anchor, and for an EMA anchor whose period exceeds the steps; "
          "'every step (sampler)' for the iterative anchor, which is the sampler itself and so moves with every "
          "step without an update of its own).", ""]
    rows = []
    for task in st["tasks"]:
        for recipe in st["recipes"]:
            for s in st["seeds"]:
                r = res["runs"].get(run_key(task, recipe, s))
                if r is None:
                    rows.append([task, recipe, str(s), "not run"] + ["-"] * 8)
                    continue
                if r.get("status") != "ok":
                    err = (r.get("error") or "").strip().splitlines()
                    msg = err[-1] if err else "unknown error"
                    rows.append([task, recipe, str(s), f"failed: `{msg[:150].replace('|', '/')}`"] + ["-"] * 8)
                    continue
                stp = r.get("steps", [])
                rew = f"{_f3(_num(stp[0].get('reward_mean')))} -> {_f3(_num(stp[-1].get('reward_mean')))}" if stp \
                    else "-"
                rows.append([task, recipe, str(s), "ok", f"{r['train_wall_s']:.0f}", f"{r['eval_wall_s']:.0f}",
                             f"{r['kl_wall_s']:.0f}", str(r["gen_tokens"]), str(r["gen_rounds"]),
                             str(r["train_tokens"]), rew, anchor_updates_cell([r]) if stp else "-"])
    L += [md(["task", "recipe", "seed", "status", "train s", "eval s", "KL s", "generated tokens", "rounds",
              "train tokens", "reward first -> last", "anchor updates"], rows), ""]
    bt = [f"{t} {_dur(b.get('wall_s'))}" for t, b in res.get("before", {}).items()]
    if bt:
        L += [f"Initial-model measurements (evaluation + KL/entropy), once per task: {', '.join(bt)}.", ""]
    return L


def anchor_kind(run: dict) -> str | None:
    """The run's anchor kind (fixed / ema / reset / iterative): stored since session 8; older records only
    keep the algorithm description (`tether.algo.describe`), whose ``anchor=<kind>`` field says the same."""
    if run.get("anchor_kind"):
        return run["anchor_kind"]
    m = re.search(r"\banchor=(\w+)", run.get("algo") or "")
    return m.group(1) if m else None


def anchor_updates_cell(runs: list[dict]) -> str:
    """Tables 3-4's 'anchor updates': the EMA updates / resets of the last step (mean over the runs), or
    'every step (sampler)' for the iterative anchor, which *is* the sampler and has no update count."""
    if runs and all(anchor_kind(r) == "iterative" for r in runs):
        return "every step (sampler)"
    return str(int(_mean([_num(r["steps"][-1].get("anchor_updates")) for r in runs]) or 0))



def write_report(res: dict, out: Path) -> None:
    res = reported(res)
    js, png = paths_of(out)
    make_plot(res, png)
    text = render(res, out, png)
    head = "### Reading these numbers"
    if out.exists():  # a hand-written reading survives a re-render (--resume, --report-only) of the tables
        old = out.read_text()
        reading = old.split(head, 1)[1].strip() if head in old else ""
        if reading and reading != PLACEHOLDER:
            text = text.replace(PLACEHOLDER, reading, 1)
            print(f"[compare] {out}: kept its hand-written '{head}'; check it against the new tables", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"[compare] wrote {out}, {png} and {js}", flush=True)
