"""How tether's step time scales with the samples per group G and with the response length.

Two series on one warm trainer (one process, one model load):

* samples: G in ``--samples-list`` at a fixed length ``--fixed-length``;
* length: ``max_new_tokens`` in ``--lengths`` at a fixed ``--fixed-samples``.

Each point runs ``--repeats`` trainer steps and keeps their median (``--stat min``: their
minimum); one untimed warm-up step comes first, then the points take turns (round-robin), so
that a slow spell on a shared machine does not fall on one point only. Every step uses the
same ``--prompts`` GSM8K train questions (``data.limit=P``, no shuffling), so prompt lengths do
not vary between points. By default EOS is banned until ``max_new_tokens`` (``rollout.min_new_tokens``
set to each point's ``max_new_tokens`` by ``_benchutil.force_full_length``; the trainer passes
it on in its ``SamplingParams``), so every response has exactly the length of its point and
step time is not at the mercy of where sampling stopped (``--natural-length`` turns this off).
Between points the trainer's ``cfg.rollout.n`` and ``cfg.rollout.max_new_tokens`` (and with it
``min_new_tokens``) are changed in place; the trainer reads them afresh every step.

Each series is fitted to a line by least squares (numpy): step time against the series
variable, and against the tokens actually generated per step; all points together are also
fitted against the tokens trained per step (prompt + response tokens through the update).
The table lists time per generated token (rollout) and per trained token (update).

Usage (from the repository root)::

    .venv/bin/python bench/scaling.py --quick                    # a few minutes
    .venv/bin/python bench/scaling.py --out docs/benchmarks.md   # the reference measurement
    .venv/bin/python bench/scaling.py --recipe ema_pg --quick
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _benchutil as bu  # noqa: E402

R2_TARGET = 0.95


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="P=2 (default 4), G in {2,4,8} at length 32 (default 64), length in {16,32,64} at G=4, "
                        "2 repeats (default 3)")
    p.add_argument("--recipe", default="grpo", help="tether recipe (default grpo)")
    p.add_argument("--model", default="smollm2", help="model name or local directory (default: embedded SmolLM2)")
    p.add_argument("--prompts", type=int, default=None, help="prompts per step P (default 4; quick 2)")
    p.add_argument("--samples-list", default=None, help="G values of the samples series (default 2,4,8)")
    p.add_argument("--lengths", default=None, help="max_new_tokens values of the length series (default 16,32,64)")
    p.add_argument("--fixed-samples", type=int, default=4, help="G of the length series (default 4)")
    p.add_argument("--fixed-length", type=int, default=None, help="max_new_tokens of the samples series (64; quick 32)")
    p.add_argument("--repeats", type=int, default=None, help="timed steps per point (default 3; quick 2)")
    p.add_argument("--stat", choices=("median", "min"), default="median",
                   help="statistic of the repeats per point (min resists interference from other work on the CPU)")
    p.add_argument("--natural-length", action="store_true", help="let responses stop at EOS (no forced full length)")
    p.add_argument("--data-dir", default=None, help="directory with gsm8k_train.jsonl (default $TETHER_DATA_DIR)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="markdown file whose '## Scaling' section is written/replaced")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="extra tether config overrides")
    a = p.parse_args(argv)
    q = a.quick
    a.prompts = a.prompts or (2 if q else 4)
    a.samples_list = [int(x) for x in (a.samples_list or "2,4,8").split(",")]
    a.lengths = [int(x) for x in (a.lengths or "16,32,64").split(",")]
    a.fixed_length = a.fixed_length or (32 if q else 64)
    a.repeats = a.repeats or (2 if q else 3)
    a.data_dir = a.data_dir or bu.default_data_dir()
    if min(a.samples_list + [a.fixed_samples]) < 1 or min(a.lengths + [a.fixed_length]) < 1 or a.repeats < 1:
        p.error("G, lengths and --repeats must be >= 1")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    import torch

    from tether.config import parse_overrides
    from tether.resolve import load_config
    from tether.train import build_trainer

    ov = {
        "model.name": a.model, "model.dtype": "float32", "model.device": "cpu",
        "data.task": "gsm8k", "data.split": "train", "data.shuffle": False, "data.limit": a.prompts,
        "rollout.prompts_per_step": a.prompts, "rollout.n": a.fixed_samples, "rollout.max_new_tokens": a.fixed_length,
        "train.seed": a.seed, "run.exact_kl_samples": 0, "run.progress": False, "run.plot": False,
        "run.save_every": 0,
    }
    if a.data_dir:
        ov["data.data_dir"] = a.data_dir
    ov.update(parse_overrides(a.set))
    cfg = load_config(None, ov, recipe_name=a.recipe)
    info = bu.machine_info()
    info["threads"] = (f"torch.get_num_threads()={torch.get_num_threads()}, "
                       f"interop={torch.get_num_interop_threads()}, env {info['thread_env'] or 'unset'}")
    print(f"[scaling] recipe {a.recipe}, model {a.model}, P={a.prompts}, samples {a.samples_list} at length "
          f"{a.fixed_length}, lengths {a.lengths} at G={a.fixed_samples}, {a.repeats} repeats, "
          f"{'natural' if a.natural_length else 'forced full'} length", flush=True)
    print(f"[scaling] {info['nproc']} CPUs, {info['cpu']}; torch {info['torch']}, transformers "
          f"{info['transformers']}; threads {info['threads']}", flush=True)

    run_dir = Path(tempfile.mkdtemp(prefix=f"scaling-{a.recipe}-"))
    cfg.run.output_dir = str(run_dir)
    trainer = build_trainer(cfg, run_dir, log=lambda *x: print(*x, flush=True))

    def run_point(G: int, T: int, repeats: int) -> list[dict]:
        trainer.cfg.rollout.n = G  # read afresh by every train_step
        trainer.cfg.rollout.max_new_tokens = T
        if not a.natural_length:  # min_new_tokens follows T (a floor above the cap is an error)
            bu.force_full_length(trainer)
        rows = []
        for _ in range(repeats):
            m = trainer.train_step()
            rows.append(m)
            print(f"[scaling] G={G} T={T}: step {m['time_step_s']:.2f} s (rollout {m['time_rollout_s']:.2f}, "
                  f"update {m['time_update_s']:.2f}), {m['gen_tokens']} tokens generated, "
                  f"mean length {m['response_len']:.1f}", flush=True)
        return rows

    t0 = time.perf_counter()
    print("[scaling] warm-up step (untimed)", flush=True)
    run_point(a.fixed_samples, a.fixed_length, 1)
    points = [("samples", G, a.fixed_length) for G in a.samples_list] + \
             [("length", a.fixed_samples, T) for T in a.lengths]
    configs = list(dict.fromkeys((G, T) for _, G, T in points))  # unique, in order
    raw: dict[tuple[int, int], list[dict]] = {c: [] for c in configs}
    for _ in range(a.repeats):  # round-robin, so a slow spell on a shared machine hits every point alike
        for G, T in configs:
            raw[(G, T)] += run_point(G, T, 1)
    cache: dict[tuple[int, int], dict] = {}
    for (G, T), rows in raw.items():
        agg = min if a.stat == "min" else bu.median
        med = lambda k: agg([r[k] for r in rows])  # noqa: E731
        cache[(G, T)] = {
            "step_s": med("time_step_s"), "all": [r["time_step_s"] for r in rows],
            "rollout_s": med("time_rollout_s"), "sampler_s": med("time_sampler_pass_s"),
            "anchor_s": med("time_anchor_pass_s"), "update_s": med("time_update_s"),
            "gen_tokens": med("gen_tokens"), "train_tokens": med("train_tokens"),
            "response_len": bu.mean([r["response_len"] for r in rows]),
            "s_per_gen_token": agg([r["time_rollout_s"] / max(r["gen_tokens"], 1) for r in rows]),
            "s_per_train_token": agg([r["time_update_s"] / max(r["train_tokens"], 1) for r in rows]),
            "peak_rss_mb": rows[-1].get("peak_rss_mb"),
        }
    total_s = time.perf_counter() - t0

    # ------------------------------------------------------------------ fits
    ser = {name: [(G, T, cache[(G, T)]) for n, G, T in points if n == name] for name in ("samples", "length")}
    fits = {
        "samples": bu.linfit([G for G, _, _ in ser["samples"]], [c["step_s"] for _, _, c in ser["samples"]]),
        "length": bu.linfit([T for _, T, _ in ser["length"]], [c["step_s"] for _, _, c in ser["length"]]),
        "samples_tok": bu.linfit([c["gen_tokens"] for *_, c in ser["samples"]],
                                 [c["step_s"] for *_, c in ser["samples"]]),
        "length_tok": bu.linfit([c["gen_tokens"] for *_, c in ser["length"]],
                                [c["step_s"] for *_, c in ser["length"]]),
        "all_train_tok": bu.linfit([c["train_tokens"] for c in cache.values()],
                                   [c["step_s"] for c in cache.values()]),
    }

    def line(label, f, unit="s"):
        ok = "" if f["r2"] != f["r2"] else ("  ok" if f["r2"] >= R2_TARGET else "  BELOW TARGET")
        return (f"slope step_s per {label} = {f['slope']:.4g} {unit}, intercept = {f['intercept']:.3g} s, "
                f"R^2 = {f['r2']:.3f} (target R^2 >= {R2_TARGET}; {f['n']} points){ok}")

    fit_lines = [
        line("sample", fits["samples"]),
        line("token of length", fits["length"]),
        line("generated token (samples series)", fits["samples_tok"]),
        line("generated token (length series)", fits["length_tok"]),
        line("trained token (all points)", fits["all_train_tok"]),
    ]

    header = ["series", "G", "max new tokens", f"step s ({a.stat})", "steps s", "rollout s", "sampler pass s",
              "anchor pass s", "update s", "gen tokens", "mean response len", "train tokens",
              "ms / gen token (rollout)", "ms / train token (update)"]
    rows = []
    for name in ("samples", "length"):
        for G, T, c in ser[name]:
            rows.append([name, str(G), str(T), bu.fmt(c["step_s"]), ", ".join(f"{x:.2f}" for x in c["all"]),
                         bu.fmt(c["rollout_s"]), bu.fmt(c["sampler_s"]), bu.fmt(c["anchor_s"]), bu.fmt(c["update_s"]),
                         bu.fmt(c["gen_tokens"], 0), bu.fmt(c["response_len"], 1), bu.fmt(c["train_tokens"], 0),
                         bu.fmt(1e3 * c["s_per_gen_token"], 2), bu.fmt(1e3 * c["s_per_train_token"], 3)])
    table = bu.md_table(header, rows)
    print()
    print(table)
    print()
    print("\n".join(fit_lines))
    lengths_ok = all(abs(c["response_len"] - T) < 1e-6 for (G, T), c in cache.items())
    if not a.natural_length and not lengths_ok:
        print("[scaling] WARNING: some responses were shorter than max_new_tokens despite the EOS ban "
              "(stop strings?)", file=sys.stderr)
    print(f"\n[scaling] {len(cache)} points, {total_s:.0f} s; peak RSS {bu.peak_rss()['peak_rss_mb']:.0f} MB")

    if a.out:
        model_label = "SmolLM2-135M-Instruct (embedded, fp32)" if a.model == "smollm2" else f"`{a.model}`"
        body = "\n".join([
            f"Step time of tether's `{a.recipe}` recipe against the samples per group G and the response length. "
            f"Written by `bench/scaling.py`.",
            "",
            *bu.machine_lines(info, bu.command_line()),
            f"- job: model {model_label}, CPU, P={a.prompts} GSM8K train questions (the same every step), "
            + ("natural lengths (EOS allowed)" if a.natural_length
               else "EOS banned so every response has exactly max new tokens") +
            f", {a.repeats} timed steps per point ({a.stat}; points run round-robin) after one untimed warm-up "
            f"step, one warm trainer "
            f"(cfg.rollout.n / max_new_tokens changed between points)",
            f"- samples series: G in {a.samples_list} at {a.fixed_length} new tokens; length series: "
            f"max new tokens in {a.lengths} at G={a.fixed_samples}",
            "",
            table,
            "",
            "```",
            *fit_lines,
            "```",
            "",
            f"- fits: least squares (numpy) of the {a.stat} step time against G, against max new tokens, and "
            "against the tokens generated per step within each series; all points against the tokens through "
            "the update (prompt + response).",
            f"- total time {total_s:.0f} s for {len(cache)} points.",
        ])
        bu.write_section(a.out, "## Scaling", body)
        print(f"[scaling] wrote section '## Scaling' of {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
