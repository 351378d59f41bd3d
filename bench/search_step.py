"""Seconds per trainer step: the multi-turn search agent against single-turn training, same samples,
and the search agent with each token encoded once (``rollout.reuse_kv``) against re-encoding.

The runs train SmolLM2-135M-Instruct with the same recipe (ema_pg), the same number of samples
per step (``--prompts`` x ``--n``) and the same cap on each policy turn (``--max-new-tokens``):

* ``single_turn``: the synthetic arithmetic task, one response per prompt;
* ``search_reencode``: the closed-pool multi-hop questions with the search agent and BM25 over the
  shared corpus (up to ``--max-searches`` searches, then a final turn), ``rollout.reuse_kv=false``:
  every turn re-encodes the episode's whole context (tether before the KV reuse);
* ``search_reuse``: the same with ``rollout.reuse_kv=true`` (the default): the engine keeps each
  episode's KV cache between turns and encodes only the new tokens. With the same seeds both search
  runs sample the same trajectories (the bench checks the generated-token counts agree).

The first step of each run is a warm-up and is not timed; the runs alternate step by step
(each keeps its own model), so machine drift hits all alike. Prints the median step time and
its phases per run, generated tokens, searches, the ratios search / single-turn (re-encoding and
reusing) and the rollout-time ratio reuse / re-encode.

Usage::

    python bench/search_step.py                  # 4 prompts x 5 samples, 128 tokens per turn, 3 timed steps
    python bench/search_step.py --quick          # 2 x 2, 32 tokens, 1 timed step (smoke run)
    python bench/search_step.py --runs search_reencode,search_reuse   # only the two search runs
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _benchutil import machine_info  # noqa: E402

RUNS = ("single_turn", "search_reencode", "search_reuse")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="model (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step (default 4)")
    p.add_argument("--n", type=int, default=5, help="samples per prompt (default 5, the paper's)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="cap of each policy turn (default 128)")
    p.add_argument("--max-searches", type=int, default=4, help="search budget (default 4)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per run, after one warm-up (default 3)")
    p.add_argument("--quick", action="store_true", help="2 x 2 samples, 32 tokens, 1 timed step")
    p.add_argument("--runs", default=",".join(RUNS),
                   help=f"comma-separated runs among {', '.join(RUNS)} (default: all)")
    a = p.parse_args(argv)
    a.runs = [r.strip() for r in a.runs.split(",") if r.strip()]
    if not a.runs or any(r not in RUNS for r in a.runs):
        p.error(f"--runs: choose among {', '.join(RUNS)}, got {a.runs}")
    if a.quick:
        a.prompts, a.n, a.max_new_tokens, a.steps = 2, 2, 32, 1
    return a


def trainer(a, task: str, out: Path, model=None, tokenizer=None):
    from tether.resolve import load_config
    from tether.train import build_trainer

    over = {"model.name": a.model, "rollout.prompts_per_step": a.prompts, "rollout.n": a.n,
            "rollout.max_new_tokens": a.max_new_tokens, "train.steps": a.steps + 1, "run.progress": False,
            "run.plot": False, "run.save_every": 0, "run.exact_kl_samples": 0}
    search = task.startswith("search")
    if search:
        over.update({"rollout.agent.env.max_turns": a.max_searches + 1, "rollout.agent.env.max_context": 2048,
                     "rollout.reuse_kv": task == "search_reuse"})
    cfg = load_config(None, over, recipe_name="ema_pg", task="search" if search else None)
    return build_trainer(cfg, out / task, model=model, tokenizer=tokenizer, log=lambda *x: None)


def main(argv=None) -> int:
    a = parse_args(argv)
    print(machine_info())
    with tempfile.TemporaryDirectory() as tmp:
        runs = {t: trainer(a, t, Path(tmp)) for t in a.runs}
        rows = {t: [] for t in runs}
        for step in range(a.steps + 1):
            for t, tr in runs.items():
                m = tr.train_step()
                print(f"[search_step] {t} step {step}{' (warm-up)' if step == 0 else ''}: {m['time_step_s']:.1f} s, "
                      f"{m['gen_tokens']} tokens generated" + (f", {m['search/searches']:.2f} searches/response"
                                                               if "search/searches" in m else ""), flush=True)
                if step:
                    rows[t].append(m)
    med = {t: {k: statistics.median(r[k] for r in rows[t]) for k in
               ("time_step_s", "time_rollout_s", "time_update_s", "gen_tokens", "train_tokens")} for t in rows}
    print(f"\n{a.prompts} prompts x {a.n} samples, {a.max_new_tokens} tokens per turn, median of {a.steps} steps")
    print(f"{'run':12s} {'step s':>8s} {'rollout s':>10s} {'update s':>9s} {'gen tok':>8s} {'train tok':>10s}")
    for t, m in med.items():
        print(f"{t:12s} {m['time_step_s']:8.1f} {m['time_rollout_s']:10.1f} {m['time_update_s']:9.1f} "
              f"{m['gen_tokens']:8.0f} {m['train_tokens']:10.0f}")
    for t in (t for t in med if t.startswith("search")):
        s = rows[t]
        print(f"{t}: {statistics.mean(r['search/searches'] for r in s):.2f} searches/response, "
              f"{statistics.mean(r['search/turns'] for r in s):.2f} turns, "
              f"{statistics.mean(r['search/retrieval_s'] for r in s):.2f} s retrieval per step")
        if "single_turn" in med:
            print(f"ratio step time {t}/single_turn = {med[t]['time_step_s'] / med['single_turn']['time_step_s']:.2f}")
    if "search_reuse" in med and "search_reencode" in med:
        same = [r["gen_tokens"] for r in rows["search_reuse"]] == [r["gen_tokens"] for r in rows["search_reencode"]]
        print(f"same trajectories (generated tokens per step equal): {same}")
        print(f"ratio rollout time search_reuse/search_reencode = "
              f"{med['search_reuse']['time_rollout_s'] / med['search_reencode']['time_rollout_s']:.2f}")
        print(f"ratio step time search_reuse/search_reencode = "
              f"{med['search_reuse']['time_step_s'] / med['search_reencode']['time_step_s']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
