"""The driver: the "before" measurements, one training run per (task, recipe, seed), the results
JSON rewritten after each, and --resume, which merges an earlier JSON (its runs, recipes, seeds and
variants) into this command's."""

from __future__ import annotations

import copy
import gc
import json
import shutil
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

import _benchutil as bu

from .args import (
    BUDGET_KEYS,
    base_recipe,
    command_of,
    git_commit,
    parse_args,
    settings_of,
    variant_text,
)
from .measure import check_data_dir, content_of, eval_set, kl_and_entropy, run_eval
from .report import _dur, _pct, write_report
from .results import merged_lists, paths_of, run_key

# =========================================================================== one run


def overrides_for(a, task: str, seed: int, run_dir: Path) -> dict:
    ov = {
        "model.name": a.model, "model.dtype": "float32", "model.device": "cpu",
        "data.task": task,
        "rollout.prompts_per_step": a.prompts_per_step, "rollout.n": a.samples,
        "rollout.max_new_tokens": a.max_new_tokens[task], "rollout.temperature": a.temperature,
        "data.format_weight": a.format_weight, "train.mini_batches": a.mini_batches,
        "train.steps": a.steps[task], "train.lr": a.lr, "train.seed": seed,
        "run.output_dir": str(run_dir), "run.save_every": 0, "run.final_checkpoint": bool(a.keep_checkpoints),
        "run.exact_kl_samples": 0,
        "run.progress": bool(a.progress), "run.plot": False,
        "eval.before": False, "eval.after": False,  # evaluated here, before and after, on the same set for all
    }
    if task == "arithmetic":
        ov["data.difficulty"] = a.difficulty
    else:
        ov.update({"data.split": "train", "data.data_dir": str(a.data_dir)})
    return ov


_RUN_FILES = {"config.yaml", "metrics.jsonl", "samples.jsonl", "checkpoints", "curves.png", "reward_errors.log"}


def fresh_run_dir(path: Path) -> None:
    """Empty a run directory of an earlier run (only if it holds nothing but run files)."""
    if path.exists():
        extra = {p.name for p in path.iterdir()} - _RUN_FILES
        if extra:
            raise RuntimeError(f"{path} exists and holds files that are not a tether run's ({sorted(extra)}); "
                               f"refusing to delete it. Choose another --work-dir")
        shutil.rmtree(path)
    path.mkdir(parents=True)


def one_run(a, task: str, recipe: str, seed: int, base_model, tok, evals: dict) -> dict:
    """Train one (task, recipe, seed), evaluate its final policy, measure KL and entropy."""
    from tether.config.recipes import describe
    from tether.metrics import read_metrics
    from tether.resolve import RECIPE_TRAINER_DEFAULTS, load_config, save_config
    from tether.train import build_trainer

    run_dir = a.work_dir / task / f"{recipe}-seed{seed}"
    rec = {"task": task, "recipe": recipe, "seed": seed, "run_dir": str(run_dir), "status": "running"}
    base, variant_ov = base_recipe(a, recipe)
    if variant_ov:
        rec["variant"] = {"recipe": base, "overrides": variant_ov}
    ov = {**overrides_for(a, task, seed, run_dir), **variant_ov}  # a variant's own settings win
    cfg = load_config(None, ov, recipe_name=base)
    if cfg.algo.anchor.kind in ("ema", "reset") and "algo.anchor.every" not in variant_ov:
        ov["algo.anchor.every"] = a.anchor_every  # the comparison's anchor period (fixed anchors have none)
        cfg = load_config(None, ov, recipe_name=base)
    rec["algo"] = describe(cfg.algo)
    rec["anchor_kind"] = cfg.algo.anchor.kind  # what Tables 3-4 count as "anchor updates" depends on it
    rec["recipe_trainer_settings"] = dict(RECIPE_TRAINER_DEFAULTS.get(base, {}))
    fresh_run_dir(run_dir)
    save_config(cfg, run_dir / "config.yaml")
    policy = copy.deepcopy(base_model)  # a fresh copy of the initial weights for every run
    trainer = build_trainer(cfg, run_dir, model=policy, tokenizer=tok, log=lambda *x: print(*x, flush=True))
    t0 = time.perf_counter()
    trainer.run()
    rec["train_wall_s"] = time.perf_counter() - t0
    rows = read_metrics(run_dir)
    # every numeric metric of every step (reward, accuracy, clip fractions, KL to the anchor, entropy, ...)
    rec["steps"] = [{k: v for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
                    for r in rows]
    rec["gen_tokens"] = int(sum(r.get("gen_tokens", 0) for r in rows))
    rec["train_tokens"] = int(sum(r.get("train_tokens", 0) for r in rows))
    rec["gen_rounds"] = int(sum(r.get("ds_rounds", 1) for r in rows))
    del trainer
    examples, reward_fn, _ = evals[task]
    t1 = time.perf_counter()
    rec["eval"] = run_eval(policy, tok, examples, reward_fn, a, task)
    rec["eval_wall_s"] = time.perf_counter() - t1
    rec.update(kl_and_entropy(policy, base_model, tok, examples[:a.kl_prompts],
                              max_new_tokens=a.kl_max_new_tokens[task], seed=seed))
    rec["status"] = "ok"
    del policy
    gc.collect()
    return rec


# =========================================================================== driver


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    js, _ = paths_of(a.out)
    if a.report_only:
        if not js.is_file():
            raise SystemExit(f"[compare] --report-only needs {js}")
        write_report(json.loads(js.read_text()), a.out)
        return 0
    check_data_dir(a)
    from tether.metrics import write_json_atomic
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    t_start = time.perf_counter()
    res = new_results(a)
    if a.resume and js.is_file():
        merge_resumed(res, json.loads(js.read_text()), a, js)
    cmd = {"command": command_of(argv), "started": started, "commit": git_commit(), "wall_s": 0.0, "runs_run": 0,
           "interrupted": True}
    res["commands"].append(cmd)

    def save():
        cmd["wall_s"] = time.perf_counter() - t_start
        write_json_atomic(js, res)

    # seed-major within a task: if the comparison is cut short, every recipe has the same seeds done
    plan = [(t, r, s) for t in a.tasks for s in a.seeds for r in a.recipes]
    todo = [p for p in plan if run_key(*p) not in res["runs"]]
    print(f"[compare] {len(plan)} runs ({len(plan) - len(todo)} reused): recipes {' '.join(a.recipes)}; seeds "
          f"{' '.join(map(str, a.seeds))}; tasks {' '.join(a.tasks)}; {a.steps} steps x {a.prompts_per_step} "
          f"prompts x {a.samples} samples, max new tokens {a.max_new_tokens}, lr {a.lr:g}; eval greedy "
          f"{a.eval_max_new_tokens} tokens; work dir {a.work_dir}; results {js}", flush=True)
    save()

    if not todo and all(t in res["before"] for t in a.tasks):
        cmd["interrupted"] = False
        save()
        write_report(res, a.out)
        print("[compare] nothing left to run", flush=True)
        return 0
    from tether.models import ModelConfig, load_model
    print(f"[compare] loading {a.model!r} (once; every run trains a fresh copy)", flush=True)
    base_model, tok = load_model(ModelConfig(name=a.model, dtype="float32", device="cpu"))
    evals = {t: eval_set(a, t) for t in a.tasks}
    try:
        measure_before(a, res, base_model, tok, evals, save, t_start)
        run_all(a, res, todo, base_model, tok, evals, cmd, save, t_start)
        cmd["interrupted"] = False
    finally:
        save()
        write_report(res, a.out)
    failed = [k for k, r in res["runs"].items() if r.get("status") != "ok"]
    print(f"[compare] finished in {_dur(time.perf_counter() - t_start)}; "
          f"{len(plan) - len(failed)}/{len(plan)} runs ok" + (f"; failed: {', '.join(failed)}" if failed else ""),
          flush=True)
    return 1 if failed else 0


def new_results(a) -> dict:
    """The results of this command before anything runs: settings, machine, recipe trainer settings."""
    import torch

    from tether.resolve import RECIPE_TRAINER_DEFAULTS

    info = bu.machine_info()
    info["torch_threads"] = torch.get_num_threads()
    return {"settings": settings_of(a), "machine": info, "commands": [], "before": {}, "runs": {},
            "recipe_trainer_settings": {r: dict(RECIPE_TRAINER_DEFAULTS.get(base_recipe(a, r)[0], {}))
                                        for r in a.recipes}}


def merge_resumed(res: dict, old: dict, a, js: Path) -> None:
    """--resume: take the earlier commands, 'before' measurements and finished runs of ``old`` (the JSON at
    ``js``) into ``res``, after checking that the budgets match and no label changed its meaning."""
    settings = res["settings"]
    diff = [k for k in BUDGET_KEYS if old.get("settings", {}).get(k) != settings.get(k)]
    if diff:
        raise SystemExit(f"[compare] --resume: {js} was made with other settings ({', '.join(diff)}); "
                         f"rerun without --resume or with the same budgets")
    res["commands"] = old.get("commands", [])
    res["before"] = dict(old.get("before", {}))
    # a comparison run in parts (some recipes or seeds per command) reports everything run so far
    ost = old.get("settings", {})
    settings.update(merged_lists(ost, settings))
    settings["variants"] = {**ost.get("variants", {}), **a.variants}
    res["recipe_trainer_settings"] = {**old.get("recipe_trainer_settings", {}), **res["recipe_trainer_settings"]}
    res["runs"] = {k: r for k, r in old.get("runs", {}).items() if r.get("status") == "ok"}
    for k, r in res["runs"].items():  # a label must mean the same recipe and overrides as before
        if r.get("recipe") in a.recipes and r.get("variant") != a.variants.get(r.get("recipe")):
            raise SystemExit(f"[compare] --resume: run {k} in {js} was made as "
                             f"{variant_text(r.get('recipe'), r.get('variant'))}, but this command defines "
                             f"{variant_text(r.get('recipe'), a.variants.get(r.get('recipe')))}; use another "
                             f"label, or the same --variant")


def measure_before(a, res: dict, base_model, tok, evals: dict, save, t_start: float) -> None:
    """Evaluate the initial model once per task (and its KL to itself, a check, and entropy)."""
    for task in a.tasks:
        if task in res["before"]:
            continue
        t0 = time.perf_counter()
        examples, reward_fn, desc = evals[task]
        print(f"[compare] before: evaluating the initial model on {task} ({len(examples)} problems) "
              f"[elapsed {_dur(time.perf_counter() - t_start)}]", flush=True)
        b = {"description": desc, "eval": run_eval(base_model, tok, examples, reward_fn, a, task),
             "contents": [content_of(task, e) for e in examples]}
        b.update(kl_and_entropy(base_model, base_model, tok, examples[:a.kl_prompts],
                                max_new_tokens=a.kl_max_new_tokens[task], seed=0))
        b["wall_s"] = time.perf_counter() - t0
        res["before"][task] = b
        print(f"[compare] before {task}: accuracy {_pct(b['eval']['avg@1'])} %, entropy {b['entropy']:.3f}, "
              f"{_dur(b['wall_s'])}", flush=True)
        save()


def run_all(a, res: dict, todo: list, base_model, tok, evals: dict, cmd: dict, save, t_start: float) -> None:
    """Every (task, recipe, seed) of ``todo``, saved after each; a run that raises is recorded as failed
    and the others go on."""
    run_times = []
    for i, (task, recipe, seed) in enumerate(todo, 1):
        el = time.perf_counter() - t_start
        eta = f", ~{_dur(sum(run_times) / len(run_times) * (len(todo) - i + 1))} left" if run_times else ""
        print(f"[compare] run {i}/{len(todo)}: task {task}, recipe {recipe}, seed {seed} "
              f"[elapsed {_dur(el)}{eta}]", flush=True)
        t0 = time.perf_counter()
        try:
            rec = one_run(a, task, recipe, seed, base_model, tok, evals)
            print(f"[compare] run {i}/{len(todo)} done in {_dur(time.perf_counter() - t0)}: accuracy "
                  f"{_pct(res['before'][task]['eval']['avg@1'])} -> {_pct(rec['eval']['avg@1'])} %, KL to "
                  f"initial {rec['kl_to_initial']:.3e}, entropy {rec['entropy']:.3f}, generated "
                  f"{rec['gen_tokens']} tokens", flush=True)
        except Exception as e:  # record, keep going with the other runs
            tb = traceback.format_exc()
            print(f"[compare] run {i}/{len(todo)} ({task} {recipe} seed {seed}) FAILED:\n{tb}", file=sys.stderr,
                  flush=True)
            rec = {"task": task, "recipe": recipe, "seed": seed, "status": "failed",
                   "error": f"{type(e).__name__}: {e}\n{tb}"}
            gc.collect()
        rec["wall_s"] = time.perf_counter() - t0
        run_times.append(rec["wall_s"])
        res["runs"][run_key(task, recipe, seed)] = rec
        cmd["runs_run"] += 1
        save()
