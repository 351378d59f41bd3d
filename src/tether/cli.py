"""The ``tether`` command: train, sft, demos, eval, export, plot, config, recipes, retrieve, sweep."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# positive_int: the integer >= 1 argparse type (tether sweep's options use it too)
from .sweep.cli import add_sweep_parser, positive_int


def _train(args) -> int:
    from .resolve import load_config  # deferred: pulls in torch
    from .train import resume, train  # deferred: pulls in torch and transformers

    overrides = _overrides(args, _TRAIN_FLAGS)
    from . import distributed  # deferred: pulls in torch

    if args.resume:
        if args.config or args.recipe or args.task:
            from .errors import ConfigError  # deferred: loads json (tether.cli stays light)
            raise ConfigError("tether train --resume RUN_DIR continues with the run's saved config; drop "
                              "--config/--recipe/--task (key=value overrides such as train.steps=60 are allowed)")
        try:
            resume(Path(args.resume), overrides)  # a missing run dir or config.yaml: a RunError (tether.rundir.guard)
        finally:
            distributed.teardown()  # under torchrun: leave the process group (no-op otherwise)
        return _stop_status()
    cfg = load_config(args.config, overrides, recipe_name=args.recipe, task=args.task)
    try:
        train(cfg)
    finally:
        distributed.teardown()
    return _stop_status()


#: the options of `tether train` (and `tether config`) that set a key: (attribute, key)
_TRAIN_FLAGS = (("model", "model.name"), ("data", "data.task"), ("steps", "train.steps"),
                ("output_dir", "run.output_dir"))


def _sft(args) -> int:
    from .resolve.sft import load_sft_config  # deferred: pulls in torch
    from .sft import resume_sft, sft  # deferred: pulls in torch and transformers

    overrides = _overrides(args, (("data", "data.path"), ("model", "model.name"), ("steps", "train.steps"),
                                  ("output_dir", "run.output_dir")))
    if args.resume:
        if args.config:
            from .errors import ConfigError  # deferred: loads json (tether.cli stays light)
            raise ConfigError("tether sft --resume RUN_DIR continues with the run's saved config; drop --config "
                              "(key=value overrides such as train.epochs=3 are allowed)")
        resume_sft(Path(args.resume), overrides)
    else:
        sft(load_sft_config(args.config, overrides))
    return _stop_status()


def _overrides(args, flags) -> dict:
    """The command line's key=value overrides, plus the options (``flags``: (attribute, key) pairs) it
    gave and ``--overwrite`` (``run.overwrite``). An option and an override of the same key with different
    values is a ConfigError (which one was meant?)."""
    from .config import parse_overrides  # deferred: pulls in torch
    from .errors import ConfigError  # deferred: loads json (tether.cli stays light)

    overrides = parse_overrides(args.overrides)
    for flag, key in flags:
        v = getattr(args, flag)
        if v is not None:
            if key in overrides and overrides[key] != v:
                raise ConfigError(f"--{flag.replace('_', '-')} {v} and {key}={overrides[key]} set the same key to "
                                  f"different values; give one")
            overrides[key] = v
    if getattr(args, "overwrite", False):  # tether config has no --overwrite
        overrides["run.overwrite"] = True
    return overrides


def _stop_status() -> int:
    """0 when the run finished; 128 + the signal's number (SIGINT 130, SIGTERM 143) when it stopped
    early on that signal (tether.rundir.stop: the trainer wrote a checkpoint and printed how to resume)."""
    from .rundir import stop  # deferred: pulls in torch

    stopped = stop.last_stop()
    return stop.exit_code(stopped) if stopped else 0


def _interrupted(e: KeyboardInterrupt) -> int:
    """A second SIGINT / SIGTERM aborted a run (tether.rundir.stop.Aborted), or Ctrl-C came outside a run
    (while loading, evaluating, exporting): one line, and the signal's exit status instead of a traceback."""
    from .rundir import stop  # deferred: pulls in torch

    if isinstance(e, stop.Interrupted):
        if e.announce:  # rank 0 under torchrun
            print(f"tether: {e}", file=sys.stderr)
        return stop.exit_code(e.signal_name)
    print("tether: interrupted (SIGINT)", file=sys.stderr)
    return stop.exit_code("SIGINT")


def _plot(args) -> int:
    """Write the plot and print the path of the file written: ``--out`` (default `tether.plot.default_plot_out`) as
    `tether.plot.plot_path` resolves it (an existing directory gets curves.png inside it, a name without an image suffix
    gets .png); a path that cannot be written is an OutputError naming it (exit 2)."""
    from .plot import default_plot_out, plot_runs  # deferred: pulls in torch

    out = args.out or default_plot_out(args.runs)  # a string: a trailing slash means a directory
    print(plot_runs([Path(r) for r in args.runs], out, smooth=args.smooth))
    return 0


def _config(args) -> int:
    from .config import to_dict
    from .resolve import load_config, reference  # deferred: pulls in torch

    if args.reference:
        print(reference())
        return 0
    import yaml

    cfg = load_config(args.config, _overrides(args, _TRAIN_FLAGS), recipe_name=args.recipe, task=args.task)
    print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
    return 0


def _recipes(args) -> int:
    from .config.recipes import RECIPES, describe, recipe  # deferred: pulls in torch

    for name in RECIPES:
        print(describe(recipe(name)))
    return 0


def _add_run_config_arguments(p) -> None:
    """The arguments that make a run's config, which ``tether train`` and ``tether config`` share (so ``tether config``
    prints what the same ``tether train`` command would run with)."""
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.steps=50")
    p.add_argument("--config", help="YAML config file")
    p.add_argument("--recipe", help="named algorithm (tether recipes lists them); default ema_pg")
    from .resolve import TASK_PRESETS  # deferred: pulls in torch (and registers every task: search's preset too)

    p.add_argument("--task", choices=list(TASK_PRESETS),
                   help="math (default: single-turn, arithmetic / GSM8K / MATH data) | search (the multi-turn search "
                   "agent on the closed-pool multi-hop set with BM25) | organism (the model organism's RL regime, "
                   "docs/organism.md): the settings the task brings (tether.resolve.TASK_PRESETS)")
    p.add_argument("--model", help="hub id, local directory, .gguf file, or 'smollm2' (the embedded default)")
    p.add_argument("--data", help="arithmetic | gsm8k | math500 | ... | a .jsonl/.json/.parquet file | a hub id")
    p.add_argument("--steps", type=int, help="trainer steps (= train.steps)")
    p.add_argument("--output-dir", dest="output_dir", help="run directory (= run.output_dir)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tether", description="RL of language models with verifiable rewards, "
                                "built around anchors, KL estimators and trust regions.")
    sub = p.add_subparsers(dest="cmd", required=True)

    t = sub.add_parser("train", help="train a policy (no arguments: SmolLM2-135M on synthetic arithmetic with ema_pg)",
                       description="Train. Settings resolve as: recipe -> --config YAML -> key=value overrides "
                       "(e.g. train.lr=1e-5 algo.kl.beta=0.01 rollout.n=8). Every key: docs/config.md or "
                       "`tether config --reference`.",
                       epilog="Stopping: SIGINT (Ctrl-C) or SIGTERM (a scheduler's stop) finishes the step in "
                       "progress, writes a checkpoint, prints how to continue (tether train --resume RUN_DIR) and "
                       "exits with 130 (SIGINT) or 143 (SIGTERM). A second signal (a second or more after the "
                       "first) aborts at once, without a new checkpoint (the previous one stays the latest and "
                       "resumes; same exit codes). Exit 0: the run finished; 2: an error in the command, config, "
                       "data, model or run directory.")
    _add_run_config_arguments(t)
    t.add_argument("--overwrite", action="store_true", help="a fresh run into a non-empty --output-dir first deletes "
                   "the old run there (= run.overwrite=true); without it such a run is refused")
    t.add_argument("--resume", metavar="RUN_DIR",
                   help="continue RUN_DIR from its latest valid checkpoint with its saved config; key=value overrides "
                   "apply, e.g. train.steps=60 extends the run. The LR never jumps on resume: a cosine or linear "
                   "decay is re-laid from the multiplier the run had reached to 0 at the new last step (a run "
                   "already decayed to 0 is refused: extend it with train.schedule=constant, which trains at "
                   "train.lr, or start a new run from an exported model)")
    t.set_defaults(fn=_train)

    _add_sft_parser(sub)


    pl = sub.add_parser("plot", help="plot the curves of one or more runs, overlaid")
    pl.add_argument("runs", nargs="+", help="run directories")
    pl.add_argument("--out", help="image path (default: RUN/curves.png for one run; for several, "
                    "curves_A_vs_B.png in the current directory, so no run's own curves.png shows another run); an "
                    "existing directory or a trailing / gets curves.png inside it, a name without an image suffix gets "
                    ".png; the path written is printed")
    pl.add_argument("--smooth", type=positive_int, default=1, help="moving-average window in steps (default 1: raw)")
    pl.set_defaults(fn=_plot)

    c = sub.add_parser("config", help="print the resolved config (recipe -> task -> YAML -> overrides) that tether "
                       "train would run with the same arguments, or the key reference")
    _add_run_config_arguments(c)
    c.add_argument("--reference", action="store_true", help="print the reference of every key (docs/config.md)")
    c.set_defaults(fn=_config)

    r = sub.add_parser("recipes", help="list the named recipes and their settings")
    r.set_defaults(fn=_recipes)

    from .eval.cli import add_eval_parser  # deferred: pulls in torch

    add_eval_parser(sub)
    from .export import add_export_parser  # deferred: pulls in torch
    from .search.server import add_retrieve_parser  # deferred: pulls in torch

    add_export_parser(sub)
    add_retrieve_parser(sub)
    from .sft.demos import add_demos_parser  # deferred: pulls in torch and transformers

    add_demos_parser(sub)
    add_sweep_parser(sub)
    return p


def _add_sft_parser(sub) -> None:
    s = sub.add_parser("sft", help="supervised fine-tuning on conversations (JSONL), e.g. a cold start before RL",
                       description="Fine-tune the policy on the assistant tokens of JSONL conversations "
                       "({\"messages\": [...]} or {\"prompt\", \"completion\"} rows; docs/sft.md). Settings resolve "
                       "as: defaults -> --config YAML -> key=value overrides (e.g. train.lr=2e-5 train.epochs=3). "
                       "Then: tether train model.name=RUN_DIR (RL from its last checkpoint), tether eval --model "
                       "RUN_DIR, tether export RUN_DIR OUT_DIR.",
                       epilog="Stopping: SIGINT (Ctrl-C) or SIGTERM finishes the step in progress, writes a "
                       "checkpoint, prints how to continue (tether sft --resume RUN_DIR) and exits with 130 (SIGINT) "
                       "or 143 (SIGTERM); a second signal aborts at once without a new checkpoint. Exit 0: the run "
                       "finished; 2: an error in the command, config, data, model or run directory (one "
                       "'tether: error:' line naming the file and line of a bad row).")
    s.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.epochs=2")
    s.add_argument("--data", help="the training conversations, a JSONL file (= data.path)")
    s.add_argument("--config", help="YAML config file (the keys of docs/sft.md)")
    s.add_argument("--model", help="hub id, local directory, .gguf file, 'smollm2' (the embedded default) or a run "
                   "directory (= model.name)")
    s.add_argument("--steps", type=int, help="optimizer steps (= train.steps; default: train.epochs passes)")
    s.add_argument("--output-dir", dest="output_dir", help="run directory (= run.output_dir)")
    s.add_argument("--overwrite", action="store_true", help="a fresh run into a non-empty --output-dir first deletes "
                   "the SFT run there (= run.overwrite=true); without it such a run is refused")
    s.add_argument("--resume", metavar="RUN_DIR", help="continue RUN_DIR from its latest valid checkpoint with its "
                   "saved config; key=value overrides apply (train.epochs=3 or train.steps=N extends the run; the "
                   "model, data and batch keys cannot change)")
    s.set_defaults(fn=_sft)


def main(argv=None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.cmd == "sweep":  # its own parsers (tether.sweep.cli) take every argument after the word sweep
        raw = list(sys.argv[1:] if argv is None else argv)
        args.argv, extra = raw[raw.index("sweep") + 1:], []
    # key=value overrides may stand anywhere on the line, also after options
    if args.cmd in ("train", "sft", "config"):
        args.overrides += [e for e in extra if "=" in e and not e.startswith("-")]
        extra = [e for e in extra if not ("=" in e and not e.startswith("-"))]
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    from .errors import USER_ERRORS, ConfigError  # deferred: loads json (tether.cli stays light)
    from .export import ExportError  # deferred: pulls in torch
    from .tasks.base import DataError  # deferred: pulls in torch

    try:
        return args.fn(args)
    except (ConfigError, DataError, ExportError, *USER_ERRORS) as e:
        print(f"tether: error: {error_text(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        return _interrupted(e)
    except BrokenPipeError:  # stdout closed by its reader (`tether sweep SPEC --dry-run | head`): nothing to say
        import os  # deferred: only on this path

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes it
        return 0


def error_text(e: BaseException) -> str:
    """The message of a user error for ``tether: error: ...``: one line, except that a list of
    problems (lines starting with ``  - ``, as `tether.resolve.check` writes them) keeps one
    problem per line under it. Other line breaks (e.g. in a message transformers wrote) are
    joined with spaces, so the error is one line a script or a log search can take."""
    lines = [ln.rstrip() for ln in str(e).strip().splitlines() if ln.strip()]
    if len(lines) > 1 and all(ln.startswith("  - ") for ln in lines[1:]):
        return "\n".join(lines)
    return " ".join(ln.strip() for ln in lines) or type(e).__name__


if __name__ == "__main__":
    sys.exit(main())
