"""tether against TRL's GRPOTrainer on the same GRPO job, plus tether's ema_pg and rpg_reinforce_urkl.

The job (identical for both frameworks): SmolLM2-135M-Instruct in fp32 on the CPU, the first
``P * steps`` GSM8K train questions in order (P per step, as one user message through the
model's chat template), G samples per prompt at temperature 1 (no top-p/top-k), at most
``--max-new-tokens`` new tokens, a 0/1 GSM8K-correctness reward (tether's ``gsm8k_reward``; TRL
calls it through a small wrapper), group-normalized advantages, the PPO ratio clip 0.2,
per-sequence token-mean aggregation (TRL ``loss_type="grpo"``), the k3 KL with coefficient
``--beta`` to a frozen copy of the initial policy, AdamW with a constant learning rate, gradient
clipping at 1.0, and exactly one optimizer step per generation batch of ``P * G`` completions
(micro-batches of at most 8 sequences on both sides). TRL runs with ``use_cpu=True``,
``bf16=False`` and ``gradient_checkpointing=False`` (TRL's default is True; tether's is off).

Every run happens in its own fresh Python process, one after the other, so that its peak
resident memory is its own: the child reports VmHWM from /proc/self/status (all of its memory:
imports, model, reference/anchor, optimizer state, activations). Step times:

* tether: ``Trainer.train_step()``'s own ``time_step_s`` (rollout + sampler pass + anchor
  pass + update + anchor update), and its per-phase times;
* TRL: wall time from ``on_step_begin`` to ``on_step_end`` of a ``TrainerCallback``, which in
  GRPOTrainer covers generation, rewards, the reference pass, the loss, backward and the
  optimizer step (logging comes after ``on_step_end``).

The first step is treated as warm-up: "median step" is the median over steps 2..N, "mean
step" is over all steps. Response lengths are random and differ between the runs; the table
lists the generated tokens per step so that the step times can be read against them
(``--full-length`` bans EOS on both sides so every response has exactly the maximum length).

Usage (from the repository root)::

    .venv/bin/python bench/vs_trl.py --quick                  # a few minutes; prints the table
    .venv/bin/python bench/vs_trl.py --out docs/benchmarks.md # the reference measurement
    .venv/bin/python bench/vs_trl.py --model /path/to/tiny --out /tmp/benchwork/b.md  # plumbing check

Memory breakdown: the ``tether_grpo`` child runs one more, untimed step after its timed ones with
bench/_memory.py's `StepMemory` (weights, anchor, optimizer state, gradients, activations at the peak,
the rollout's KV cache, per-phase resident peaks, and the rest: allocator overhead and untracked);
the table follows the ratios. Its peak RSS column is the timed steps' own (VmHWM read before that
step). ``--no-memory`` skips it.

TRL is a bench-only extra (``pip install -e .[bench]``); without it the TRL run fails, is
reported, and tether's numbers are still printed (``--skip-trl`` skips it).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _benchutil as bu  # noqa: E402

_T_START = time.perf_counter()  # process start (the imports above are stdlib only)
RUNS = ("tether_grpo", "trl_grpo", "ema_pg", "rpg_reinforce_urkl", "tether_grpo_ckpt", "tether_grpo_mb4",
        "tether_grpo_lean", "tether_grpo_lean_mmap")
#: tether runs that are tether_grpo with extra overrides, the same math with less memory at the update's peak:
#: _ckpt recomputes activations in backward (gradient checkpointing; the shared-prompt passes are then off);
#: _mb4 runs micro-batches of one group (4 sequences: half the saved activations, two more forward/backward
#: calls a step); _lean is _mb4 with the fixed reference stored in bf16 (algo.anchor.dtype; docs/benchmarks.md
#: states what that changes in the KL).
_MB4 = {"train.micro_batch_size": 4}
_LEAN = {**_MB4, "algo.anchor.dtype": "bfloat16"}
VARIANTS = {"tether_grpo": ("grpo", {}), "tether_grpo_ckpt": ("grpo", {"model.gradient_checkpointing": True}),
            "tether_grpo_mb4": ("grpo", _MB4), "tether_grpo_lean": ("grpo", _LEAN),
            "tether_grpo_lean_mmap": ("grpo", _LEAN)}
#: environment variables of a run's process: _lean_mmap is _lean under glibc's fixed mmap threshold of 1 MiB
#: (every block of 1 MiB or more is its own mapping, returned to the OS when freed, and the threshold no longer
#: rises to the largest freed block): less memory kept between the update's allocations, more page faults.
RUN_ENV = {"tether_grpo_lean_mmap": {"MALLOC_MMAP_THRESHOLD_": "1048576"}}
#: the run whose child also prints a memory breakdown, from one extra untimed step after its timed ones
MEMORY_RUN = "tether_grpo"
MICRO_BATCH = 8  # tether's train.micro_batch_size default; TRL's per_device_train_batch_size matches it


# =========================================================================== child: tether


def _tether_overrides(a, recipe: str) -> dict:
    ov = {
        "model.name": a.model,
        "model.dtype": "float32",
        "model.device": "cpu",
        "data.task": "gsm8k",
        "data.split": "train",
        "data.shuffle": False,
        "data.limit": a.prompts * a.steps,
        "rollout.prompts_per_step": a.prompts,
        "rollout.n": a.samples,
        "rollout.max_new_tokens": a.max_new_tokens,
        "rollout.temperature": 1.0,
        "train.lr": a.lr,
        "train.steps": a.steps,
        "train.micro_batch_size": MICRO_BATCH,
        "train.seed": a.seed,
        "run.exact_kl_samples": 0,
        "run.progress": False,
        "run.plot": False,
        "run.save_every": 0,
    }
    if a.data_dir:
        ov["data.data_dir"] = a.data_dir
    if recipe == "grpo":
        ov.update({"algo.kl.estimator": "k3", "algo.kl.beta": a.beta, "algo.anchor.kind": "fixed"})
    return ov


def child_tether(a, recipe: str, extra: dict | None = None, breakdown: bool = False) -> dict:
    import torch

    from _memory import rss_bytes
    from tether.resolve import load_config
    from tether.train import build_trainer

    baseline_rss = rss_bytes()  # the interpreter and libraries, before the model load
    ov = {**_tether_overrides(a, recipe), **(extra or {})}
    if breakdown:  # one more (untimed) step for the memory breakdown: the next P questions, in order
        ov["data.limit"] = a.prompts * (a.steps + 1)
    cfg = load_config(None, ov, recipe_name=recipe)
    run_dir = Path(tempfile.mkdtemp(prefix=f"tether-{recipe}-", dir=a.workdir))
    cfg.run.output_dir = str(run_dir)
    trainer = build_trainer(cfg, run_dir, log=lambda *x: print(*x, flush=True))
    if a.full_length:
        bu.force_full_length(trainer)
    load_s = time.perf_counter() - _T_START  # imports + model load + set-up, to the first step
    steps = []
    for _ in range(a.steps):
        m = trainer.train_step()
        keep = ("time_step_s", "time_rollout_s", "time_sampler_pass_s", "time_anchor_pass_s", "time_update_s",
                "gen_tokens", "response_len", "train_tokens", "reward_mean", "kl", "peak_rss_mb")
        row = {k: m[k] for k in keep if k in m}
        steps.append(row)
        print(f"[{recipe}] step {len(steps)}: " + json.dumps({k: round(v, 4) if isinstance(v, float) else v
                                                                for k, v in row.items()}), flush=True)
    memory = None
    if breakdown:
        memory = bu.memory_breakdown(trainer, baseline_rss)  # after the timed steps' peak is read
    from tether.config.recipes import describe
    return {
        "memory": memory,
        "framework": "tether", "recipe": recipe, "algo": describe(cfg.algo),
        "settings": {"mini_batches": cfg.train.mini_batches, "micro_batch_size": cfg.train.micro_batch_size,
                     "kl": cfg.algo.kl.estimator, "beta": cfg.algo.kl.beta, "anchor": cfg.algo.anchor.kind},
        "load_s": load_s, "step_s": [s["time_step_s"] for s in steps], "steps": steps,
        "threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads(),
    }


# =========================================================================== child: TRL


def _micro_batch(total: int) -> int:
    """The largest divisor of ``total`` that is at most MICRO_BATCH."""
    return max(d for d in range(1, min(MICRO_BATCH, total) + 1) if total % d == 0)


def _gsm8k_reward_for_trl():
    from tether.tasks.base import Example
    from tether.tasks.rewards import call_reward, gsm8k_reward

    def gsm8k_correct(prompts, completions, answer, **kwargs):
        out = []
        for comp, ans in zip(completions, answer):
            text = comp[-1]["content"] if isinstance(comp, list) else comp  # conversational: [{"role", "content"}]
            res, _err = call_reward(gsm8k_reward, text, Example(prompt="", answer=str(ans), id=""))
            out.append(float(res.reward))
        return out

    return gsm8k_correct


def build_trl_trainer(a):
    """TRL's GRPOTrainer for the job, with a step-timing callback; returns (trainer, timer, dropped fields)."""
    import dataclasses

    import torch
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from tether.tasks.data import load_examples

    examples = load_examples("gsm8k", split="train", data_dir=a.data_dir, limit=a.prompts * a.steps)
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": ex.prompt}], "answer": ex.answer}
                            for ex in examples])
    total = a.prompts * a.samples
    mb = _micro_batch(total)
    want = dict(
        output_dir=str(Path(tempfile.mkdtemp(prefix="trl-grpo-", dir=a.workdir))),
        # one optimizer step = one generation batch of P*G completions, in micro-batches of mb
        per_device_train_batch_size=mb, gradient_accumulation_steps=total // mb, num_generations=a.samples,
        num_iterations=1, max_steps=a.steps, max_completion_length=a.max_new_tokens,
        temperature=1.0, top_p=1.0, top_k=0, shuffle_dataset=False, seed=a.seed,
        # the GRPO objective as tether's recipe: group std scaling, clip 0.2, seq-mean-token-mean, k3 to a fixed ref
        beta=a.beta, epsilon=0.2, loss_type="grpo", scale_rewards="group",
        learning_rate=a.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        adam_beta1=0.9, adam_beta2=0.999,
        use_cpu=True, bf16=False, fp16=False, model_init_kwargs={"dtype": "float32"},
        logging_steps=1, report_to="none", save_strategy="no", log_completions=False, dataloader_num_workers=0,
    )
    if a.full_length:
        want["generation_kwargs"] = {"min_new_tokens": a.max_new_tokens}
    fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    # TRL turns gradient checkpointing on by default; tether does not use it. transformers >= 5.x
    # renamed the option to activation_checkpointing (gradient_checkpointing is a deprecated alias).
    want["activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"] = False
    dropped = sorted(k for k in want if k not in fields)
    if dropped:
        print(f"[trl] GRPOConfig of trl {trl.__version__} has no field(s) {dropped}; left at their defaults",
              flush=True)
    args = GRPOConfig(**{k: v for k, v in want.items() if k in fields})

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.t = self.first = None
            self.times, self.logs, self.threads = [], [], None

        def on_step_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()
            if self.first is None:
                self.first = self.t - _T_START  # imports + model/ref load + set-up, to the first step

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self.t)
            self.threads = torch.get_num_threads()
            print(f"[trl] step {len(self.times)}: {self.times[-1]:.3f} s", flush=True)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs:
                self.logs.append({k: v for k, v in logs.items() if isinstance(v, (int, float))})

    timer = StepTimer()
    trainer = GRPOTrainer(model=a.model, reward_funcs=_gsm8k_reward_for_trl(), args=args, train_dataset=ds,
                          callbacks=[timer])
    return trainer, timer, dropped


def child_trl(a) -> dict:
    import torch
    import trl

    trainer, timer, dropped = build_trl_trainer(a)
    args, total = trainer.args, a.prompts * a.samples
    trainer.train()
    step_logs = [lg for lg in timer.logs if "reward" in lg][: len(timer.times)]  # not the end-of-train summary
    gen_tokens = [lg.get("completions/mean_length", float("nan")) * total for lg in step_logs]
    return {
        "framework": "trl", "recipe": "grpo", "trl_version": trl.__version__,
        "settings": {"per_device_train_batch_size": args.per_device_train_batch_size,
                     "gradient_accumulation_steps": args.gradient_accumulation_steps,
                     "generation_batch_size": args.generation_batch_size,
                     "steps_per_generation": args.steps_per_generation, "num_generations": args.num_generations,
                     "beta": args.beta, "loss_type": args.loss_type, "ref_model": trainer.ref_model is not None,
                     "gradient_checkpointing": bool(getattr(args, "activation_checkpointing", None)
                                                    or args.gradient_checkpointing),
                     "dropped_fields": dropped},
        "load_s": timer.first, "step_s": timer.times,
        "steps": [{"time_step_s": t, "gen_tokens": g, "trl_step_time": lg.get("step_time"),
                   "reward_mean": lg.get("reward"), "kl": lg.get("kl")}
                  for t, g, lg in zip(timer.times, gen_tokens + [float("nan")] * len(timer.times),
                                      step_logs + [{}] * len(timer.times))],
        "threads": timer.threads, "interop_threads": torch.get_num_interop_threads(),
    }


def child_main(a) -> int:
    out = Path(a._result)
    try:
        if a._child == "trl_grpo":
            res = child_trl(a)
        else:
            recipe, extra = VARIANTS.get(a._child, (a._child, {}))
            res = child_tether(a, recipe, extra, breakdown=a._child == MEMORY_RUN and not a.no_memory)
        if res.get("memory"):  # VmHWM was reset per phase in the breakdown step: the timed steps' peak was read before
            res.update(ok=True, name=a._child, peak_rss_mb=res["memory"]["timed_peak_rss_mb"])
        else:
            res.update(bu.peak_rss(), ok=True, name=a._child)
        out.write_text(json.dumps(res))
        return 0
    except BaseException as e:  # report, never hang the parent
        tb = traceback.format_exc()
        print(tb, file=sys.stderr, flush=True)
        out.write_text(json.dumps({"ok": False, "name": a._child, "error": f"{type(e).__name__}: {e}\n{tb}"}))
        return 1


# =========================================================================== parent


def summarize(res: dict) -> dict:
    st = res["step_s"]
    s = {"median": bu.median(bu.after_warmup(st)), "mean": bu.mean(st), "all": st,
         "peak_rss_mb": res["peak_rss_mb"], "load_s": res["load_s"]}
    steps = bu.after_warmup(res["steps"])
    for k in ("time_rollout_s", "time_sampler_pass_s", "time_anchor_pass_s", "time_update_s"):
        vals = [x[k] for x in steps if k in x]
        s[k] = bu.median(vals) if vals else None
    g = [x.get("gen_tokens") for x in res["steps"] if x.get("gen_tokens") is not None]
    s["gen_tokens"] = bu.mean([float(v) for v in g]) if g else None
    # step time per generated token over steps 2..N: reads step times independently of the random lengths
    pairs = [(x["time_step_s"], x.get("gen_tokens")) for x in steps]
    tok = sum(float(t or 0) for _, t in pairs)
    s["s_per_gen_token"] = sum(t for t, _ in pairs) / tok if tok > 0 else None
    return s


def ratio_line(label: str, num, den, target: str | None) -> str:
    r = f"{num / den:.2f}" if num is not None and den else "n/a"
    return f"ratio {label} = {r}" + (f" (target {target})" if target else "")


def report(a, results: dict, errors: dict, info: dict) -> tuple[str, list[str]]:
    header = ["run", "median step s (2..N)", "mean step s (all)", "steps s", "rollout s", "sampler pass s",
              "anchor pass s", "update s", "gen tokens/step", "peak RSS MB", "start s"]
    rows = []
    sums = {}
    for name in RUNS:
        if name in results:
            s = sums[name] = summarize(results[name])
            rows.append([name, bu.fmt(s["median"]), bu.fmt(s["mean"]), ", ".join(f"{x:.2f}" for x in s["all"]),
                         bu.fmt(s["time_rollout_s"]), bu.fmt(s["time_sampler_pass_s"]),
                         bu.fmt(s["time_anchor_pass_s"]), bu.fmt(s["time_update_s"]), bu.fmt(s["gen_tokens"], 0),
                         bu.fmt(s["peak_rss_mb"], 0), bu.fmt(s["load_s"], 1)])
        elif name in errors:
            rows.append([name, "failed"] + ["-"] * (len(header) - 2))
    g = lambda n, k: sums[n][k] if n in sums else None  # noqa: E731
    ratios = [
        ratio_line("step time tether_grpo/trl_grpo", g("tether_grpo", "median"), g("trl_grpo", "median"), "<= 0.45"),
        ratio_line("peak RSS tether_grpo/trl_grpo", g("tether_grpo", "peak_rss_mb"), g("trl_grpo", "peak_rss_mb"),
                   "<= 0.5"),
        ratio_line("step time ema_pg/tether_grpo", g("ema_pg", "median"), g("tether_grpo", "median"), "<= 1.25"),
        ratio_line("step time rpg_reinforce_urkl/tether_grpo", g("rpg_reinforce_urkl", "median"),
                   g("tether_grpo", "median"), None),
        ratio_line("peak RSS tether_grpo_ckpt/trl_grpo", g("tether_grpo_ckpt", "peak_rss_mb"),
                   g("trl_grpo", "peak_rss_mb"), "<= 0.5"),
        ratio_line("step time tether_grpo_ckpt/trl_grpo", g("tether_grpo_ckpt", "median"), g("trl_grpo", "median"),
                   None),
        *[line for v in ("tether_grpo_mb4", "tether_grpo_lean", "tether_grpo_lean_mmap") for line in (
            ratio_line(f"peak RSS {v}/trl_grpo", g(v, "peak_rss_mb"), g("trl_grpo", "peak_rss_mb"), "<= 0.5"),
            ratio_line(f"step time {v}/trl_grpo", g(v, "median"), g("trl_grpo", "median"), "<= 0.45"))],
        ratio_line("step time per generated token tether_grpo/trl_grpo", g("tether_grpo", "s_per_gen_token"),
                   g("trl_grpo", "s_per_gen_token"), None) + "  (informative: corrects for random lengths)",
    ]
    table = bu.md_table(header, rows)
    settings = (f"P={a.prompts} prompts x G={a.samples} samples per step, max {a.max_new_tokens} new tokens"
                f"{' (EOS banned: every response has full length)' if a.full_length else ''}, temperature 1.0, "
                f"k3 KL beta={a.beta:g} to a fixed reference (tether_grpo, trl_grpo), lr={a.lr:g}, {a.steps} steps, "
                f"one optimizer step per generation batch (rpg_reinforce_urkl: 2 mini-batches, its recipe), "
                f"micro-batches of <= {MICRO_BATCH} sequences (_mb4, _lean: 4), model {a.model_label}, fp32, CPU")
    notes = [
        "- step times: tether `Trainer.train_step()` (`time_step_s`); TRL: `on_step_begin` -> `on_step_end` of a "
        "`TrainerCallback` (generation, reward, reference pass, loss, backward, optimizer step). "
        "Median over steps 2..N (step 1 = warm-up); mean over all steps.",
        "- phase columns (tether only): median of rollout (generation + reward), sampler pass, anchor pass, "
        "update (forward + backward + optimizer).",
        "- peak RSS: VmHWM of the run's own fresh process (imports, model, reference/anchor copy, optimizer "
        "state, activations); each run is a separate process, run one after another.",
        "- start s: process start to the first step (imports, model and reference load, set-up).",
        "- gen tokens/step: mean over all steps of the tokens generated per step (TRL: "
        "`completions/mean_length` x P x G); step times scale with it, and it is random.",
    ]
    notes += [f"- {name}'s process environment adds " + ", ".join(f"`{k}={v}`" for k, v in RUN_ENV[name].items())
              for name in results if name in RUN_ENV]
    for name, res in results.items():
        if name == "trl_grpo":
            notes.append(f"- TRL {res['trl_version']} GRPOConfig: " + ", ".join(
                f"{k}={v}" for k, v in res["settings"].items() if k != "dropped_fields"))
            if res["settings"].get("dropped_fields"):
                notes.append(f"- TRL: fields not in this version's GRPOConfig (left at defaults): "
                             f"{res['settings']['dropped_fields']}")
    for name, err in errors.items():
        notes.append(f"- {name} failed: `{err.strip().splitlines()[0] if err.strip() else 'unknown error'}`")
    mem_lines = []
    if results.get(MEMORY_RUN, {}).get("memory"):
        mem_lines = ["", f"### Memory breakdown ({MEMORY_RUN}, one step)", "",
                     *bu.memory_table(results[MEMORY_RUN]["memory"])]
    body = "\n".join([
        "tether against TRL's `GRPOTrainer` on the same GRPO job, and tether's `ema_pg` (top-k KL, k=32, EMA "
        "anchor) and `rpg_reinforce_urkl` at the same budget. Written by `bench/vs_trl.py`.",
        "",
        *bu.machine_lines(info, bu.command_line()),
        f"- job: {settings}",
        "",
        table,
        "",
        "```",
        *ratios,
        "```",
        "",
        *notes,
        *mem_lines,
    ])
    return body, [table, "", *ratios, *mem_lines]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smallest meaningful run: 2 steps, P=2, G=4, 32 new tokens")
    p.add_argument("--steps", type=int, default=None, help="trainer steps per run (default 3; quick 2)")
    p.add_argument("--prompts", type=int, default=None, help="prompts per step P (default 4; quick 2)")
    p.add_argument("--samples", type=int, default=None, help="samples per prompt G (default 4)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="response length cap (default 64; quick 32)")
    p.add_argument("--beta", type=float, default=0.04, help="k3 KL coefficient of tether_grpo and trl_grpo")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="local model directory (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--data-dir", default=None, help="directory with gsm8k_train.jsonl (default $TETHER_DATA_DIR)")
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma list from {','.join(RUNS)}")
    p.add_argument("--skip-trl", action="store_true", help="do not run TRL")
    p.add_argument("--full-length", action="store_true", help="ban EOS on both sides: every response is max length")
    p.add_argument("--no-memory", action="store_true",
                   help=f"no memory breakdown (by default {MEMORY_RUN} runs one extra untimed step that records it)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per run before it is killed (default none)")
    p.add_argument("--out", default=None, help="markdown file whose '## vs TRL' section is written/replaced")
    p.add_argument("--workdir", default=None, help="scratch directory (default: a fresh temporary directory)")
    p.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_result", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    q = a.quick
    a.steps = a.steps or (2 if q else 3)
    a.prompts = a.prompts or (2 if q else 4)
    a.samples = a.samples or 4
    a.max_new_tokens = a.max_new_tokens or (32 if q else 64)
    if a.steps < 1 or a.prompts < 1 or a.samples < 2 or a.max_new_tokens < 1:
        p.error("need --steps >= 1, --prompts >= 1, --samples >= 2 (TRL's minimum), --max-new-tokens >= 1")
    a.data_dir = a.data_dir or bu.default_data_dir()
    return a


def child_argv(a, name: str, result: Path) -> list[str]:
    argv = [str(Path(__file__).resolve()), "--steps", str(a.steps), "--prompts", str(a.prompts),
            "--samples", str(a.samples), "--max-new-tokens", str(a.max_new_tokens), "--beta", repr(a.beta),
            "--lr", repr(a.lr), "--seed", str(a.seed), "--model", a.model, "--workdir", a.workdir,
            "--_child", name, "--_result", str(result)]
    if a.data_dir:
        argv += ["--data-dir", a.data_dir]
    if a.full_length:
        argv.append("--full-length")
    if a.no_memory:
        argv.append("--no-memory")
    return argv


def main(argv=None) -> int:
    a = parse_args(argv)
    if a._child:
        return child_main(a)
    a.workdir = a.workdir or tempfile.mkdtemp(prefix="vs_trl-")
    Path(a.workdir).mkdir(parents=True, exist_ok=True)
    if a.model is None:
        # the embedded GGUF, dequantized once into the cache; resolved in a child so that this
        # driver process never imports torch and stays small
        import subprocess
        code = "from tether.models import resolve_model_path; print(resolve_model_path('smollm2'))"
        a.model = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                 text=True).stdout.strip().splitlines()[-1]
        a.model_label = "SmolLM2-135M-Instruct (embedded, dequantized to safetensors)"
    else:
        a.model = str(Path(a.model).expanduser().resolve())
        a.model_label = f"`{a.model}`"
    runs = [r.strip() for r in a.runs.split(",") if r.strip()]
    bad = [r for r in runs if r not in RUNS]
    if bad:
        print(f"unknown run(s) {bad}; choose from {', '.join(RUNS)}", file=sys.stderr)
        return 2
    if a.skip_trl:
        runs = [r for r in runs if r != "trl_grpo"]
    info = bu.machine_info()
    print(f"[vs_trl] model {a.model}; P={a.prompts} G={a.samples} max_new_tokens={a.max_new_tokens} "
          f"steps={a.steps} beta={a.beta:g} lr={a.lr:g}; data {a.data_dir}; scratch {a.workdir}", flush=True)
    print(f"[vs_trl] {info['nproc']} CPUs, {info['cpu']}, {info['memory']}; torch {info['torch']}, "
          f"transformers {info['transformers']}, trl {info['trl']}; thread env {info['thread_env'] or 'unset'} "
          f"(torch default threads in every run)", flush=True)
    results, errors = {}, {}
    for name in runs:
        res_path = Path(a.workdir) / f"{name}.json"
        log_path = Path(a.workdir) / f"{name}.log"
        t0 = time.perf_counter()
        print(f"[vs_trl] running {name} in a fresh process (log {log_path}) ...", flush=True)
        res, err = bu.run_child(child_argv(a, name, res_path), log_path, res_path, timeout=a.timeout,
                                env=RUN_ENV.get(name))
        if res is None:
            errors[name] = err
            print(f"[vs_trl] {name} FAILED after {time.perf_counter() - t0:.0f} s:\n{err}", file=sys.stderr, flush=True)
            continue
        results[name] = res
        print(f"[vs_trl] {name}: steps {[round(x, 2) for x in res['step_s']]} s, peak RSS "
              f"{res['peak_rss_mb']:.0f} MB, torch threads {res['threads']} (interop {res['interop_threads']}), "
              f"wall {time.perf_counter() - t0:.0f} s", flush=True)
    thr = {n: r["threads"] for n, r in results.items()}
    info["threads"] = ", ".join(f"{n} {t}" for n, t in thr.items()) + " (torch.get_num_threads() in each run)"
    body, console = report(a, results, errors, info)
    print()
    print("\n".join(console))
    if len(set(thr.values())) > 1:
        print(f"[vs_trl] WARNING: thread counts differ between runs: {thr}", file=sys.stderr)
    if a.out:
        bu.write_section(a.out, "## vs TRL", body)
        print(f"\n[vs_trl] wrote section '## vs TRL' of {a.out}")
    tether_failed = [n for n in runs if n != "trl_grpo" and n in errors]
    return 1 if tether_failed else 0


if __name__ == "__main__":
    sys.exit(main())
