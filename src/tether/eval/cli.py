"""``tether eval``: the command line, its run directory and the results table.

* :func:`resolve_eval_spec` / :class:`EvalModelSpec` / :func:`load_eval_model` -- what ``--model`` names and
  loading it (`tether.eval.model`, re-exported here);
* :func:`add_eval_parser` / :func:`run_eval_cli` -- the command line: writes
  ``OUT/results.json``, ``OUT/<bench>.jsonl`` and prints :func:`format_table`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import sys
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from .. import __version__
from ..agents.build import RolloutPlan
from ..config import apply_keys
from ..config.flags import EVAL_FLAGS, EVAL_PRESET, add_flags, flag_problems, value
from ..errors import ConfigError, EvalError, GenerationError, OutputError
from ..metrics import json_safe, write_json_atomic, write_text_atomic
from ..models import DTYPES
from ..resolve import check, check_device
from ..rundir.owned import MARKER, check_replaceable, write_marker
from ..rundir.stop import GracefulStop, Interrupted, exit_code
from ..tasks.rewards import REWARDS
from ..userio import loads_yaml
from .agents import add_agent_arguments, agent_setup, format_search_table
from .metrics import default_ks
from .model import EvalModelSpec, check_run_anchor, load_eval_model, resolve_eval_spec
from .runner import EvalSettings, check_sampling, evaluate
from .search import search_metrics

__all__ = ["EvalError", "EvalModelSpec", "add_eval_parser", "format_table", "load_eval_model", "resolve_eval_spec",
           "run_eval_cli"]


def _table_columns(n: int, ks: Sequence[int]) -> list[tuple[str, str, Callable[[dict], str]]]:
    pct = lambda key: (lambda m: f"{100 * m[key]:.1f}" if key in m else "-")  # noqa: E731
    cols = [("problems", "problems", lambda m: str(int(m["n_problems"]))), (f"avg@{n}", "", pct(f"avg@{n}"))]
    cols += [(f"pass@{k}", "", pct(f"pass@{k}")) for k in ks]
    cols += [(f"maj@{n}", "", pct(f"maj@{n}")),
             ("len", "", lambda m: f"{m['mean_response_tokens']:.1f}"),
             ("trunc%", "", lambda m: f"{100 * m['truncation_rate']:.1f}"),
             ("time_s", "", lambda m: f"{m['wall_time_s']:.1f}")]
    return cols


def format_table(results: Mapping[str, Mapping[str, float]], n: int, ks: Sequence[int]) -> str:
    """A plain-text table, one row per benchmark: problems, avg@n, pass@k..., maj@n (percent),
    mean response length (tokens), truncation rate (percent), wall time (s)."""
    cols = _table_columns(n, ks)
    header = ["benchmark"] + [c[0] for c in cols]
    body = [[name] + [c[2](m) for c in cols] for name, m in results.items()]
    widths = [max(len(r[i]) for r in [header] + body) for i in range(len(header))]
    fmt = lambda r: "  ".join(x.ljust(w) if i == 0 else x.rjust(w) for i, (x, w) in enumerate(zip(r, widths)))  # noqa: E731
    lines = [fmt(header), "  ".join("-" * w for w in widths)] + [fmt(r) for r in body]
    return "\n".join(lines)




def add_eval_parser(sub) -> None:
    """Register the ``eval`` subcommand on an ``argparse`` subparsers object."""
    e = sub.add_parser(
        "eval", help="evaluate a model, a run's policy or its anchor on benchmarks (avg@n, pass@k, maj@n)",
        description="Sample --n responses per problem and report avg@n (mean accuracy), pass@k (unbiased) and "
        "maj@n (majority vote) per benchmark. Writes OUT/results.json, OUT/<benchmark>.jsonl and prints a table.")
    e.add_argument("--model", required=True, help="hub id, local directory, .gguf, 'smollm2', a run directory "
                   "(its latest checkpoint) or a checkpoint directory RUN/checkpoints/step-N")
    e.add_argument("--anchor", action="store_true",
                   help="evaluate the run's anchor (EMA/fixed/reset) instead of its policy")
    e.add_argument("--benchmarks", nargs="+", required=True, metavar="BENCH",
                   help="gsm8k math500 aime24 amc minerva olympiadbench, arithmetic-dN (the synthetic task's "
                        "test split at difficulty N, seed 0), or .jsonl/.json/.parquet files")
    add_flags(e.add_argument_group("sampling", "the in-run evaluation's keys (eval.*), with tether eval's preset "
                                   "(tether.config.flags.EVAL_PRESET)"), EVAL_FLAGS["sampling"], EVAL_PRESET)
    e.add_argument("--system-prompt", help="system message (default: the run's data.system_prompt for runs, else none)")
    e.add_argument("--data-dir", help="directory of named benchmarks' files (before $TETHER_DATA_DIR and the hub)")
    e.add_argument("--split", default=None, help="split to load (default: test for named benchmarks)")
    e.add_argument("--prompt-key", dest="prompt_key", default=None, help="field holding the prompt (files)")
    e.add_argument("--answer-key", dest="answer_key", default=None, help="field holding the answer (files)")
    e.add_argument("--reward", default=None, help=" | ".join(REWARDS) + " | module:function | file.py:function "
                   "(default: gsm8k for GSM8K, math otherwise)")
    e.add_argument("--out", default=None, help="output directory, absent or empty (default "
                   "evals/<model>-<timestamp>); checked and created before the model loads")
    e.add_argument("--overwrite", action="store_true", help="--out may be an earlier evaluation's output: its "
                   "files are replaced. Only an evaluation tether wrote, with nothing else added, is replaced "
                   "(never a run directory, an export or a directory of yours)")
    e.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 (default float32)")
    e.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N | auto (default cpu)")
    e.add_argument("--engine", default=None, metavar="YAML",
                   help="the engine that samples (rollout.engine, a kind or a YAML mapping; default hf, transformers "
                   "generate), e.g. '{kind: vllm_server, launch: 1}' (vLLM servers; docs/async.md) or vllm; needs "
                   "the vLLM environment for the vLLM kinds")
    e.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    add_agent_arguments(e)
    e.set_defaults(fn=run_eval_cli)


def _open_out(out: Path, files: Sequence[str], overwrite: bool) -> bool:
    """Check and create ``--out`` before the model loads; True if this call created the directory.

    It must be absent or empty; ``--overwrite`` also takes an earlier evaluation's output, and only
    one tether wrote with nothing added (`tether.rundir.owned.check_replaceable`: a run directory, an
    export or a directory of yours is never written into). The marker lists ``files``.
    """
    old = check_replaceable(out, "eval")
    if old and old != [".lock"] and not overwrite:
        shown = ", ".join(old[:5]) + (", ..." if len(old) > 5 else "")
        raise OutputError(f"--out {out} is not empty ({shown}); pass --overwrite to replace an earlier evaluation "
                          f"there, or choose another --out")
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name in old:  # an earlier evaluation's files (check_replaceable found them all to be tether's)
            (out / name).unlink()
        write_marker(out, "eval", files)
    except OSError as e:
        raise OutputError(f"cannot write to --out {out}: {e.strerror or e} ({e.filename or out}); choose a "
                          f"writable directory") from None
    return created


def _drop_out(out: Path, created: bool, files: Sequence[str]) -> None:
    """Nothing finished: remove ``--out`` again (its marker and empty ``files``) if this run created it."""
    if created:
        with contextlib.suppress(OSError):
            for name in [*files, MARKER]:
                (out / name).unlink(missing_ok=True)
            out.rmdir()


def _evaluate_bench(b, agent, out: Path, report: dict, table: dict, stopper, *, search: bool,
                    settings: EvalSettings, args) -> bool:
    """Evaluate one benchmark with the run's ``agent``; rows go to ``OUT/<bench>.jsonl`` as each batch
    finishes (a kill keeps them), then in problem order with ``results.json``. Without ``--max-new-tokens``, a
    benchmark with its own response cap (``organism-dN``) is answered within it. Returns True if a stop signal ended
    it early."""
    if args.max_new_tokens is None and b.max_new_tokens is not None:
        settings = dataclasses.replace(settings, max_new_tokens=b.max_new_tokens)
    path = out / f"{b.name}.jsonl"
    path.write_text("")

    def append(rows: list[dict]) -> None:
        with open(path, "a", encoding="utf-8") as f:
            f.writelines(json.dumps(json_safe(r), ensure_ascii=False) + "\n" for r in rows)

    try:
        res = evaluate(agent, b.examples, b.reward_fn, settings, show_progress=args.progress, desc=f"eval {b.name}",
                       should_stop=lambda: bool(stopper.signum), on_rows=append)
    except GenerationError as e:  # a prompt too long for max_new_tokens, non-finite logits: say which benchmark
        raise GenerationError(f"benchmark {b.name}: {e}") from None
    if search:
        res.metrics.update({f"search/{k}": v for k, v in search_metrics(res.per_problem, b.examples).items()})
    write_text_atomic(path, "".join(json.dumps(json_safe(r), ensure_ascii=False) + "\n" for r in res.per_problem))
    if res.first_reward_error:
        print(f"[tether] {b.name}: the reward raised {int(res.metrics['reward_errors'])} time(s) "
              f"(scored 0); first traceback:\n{res.first_reward_error}", file=sys.stderr)
    entry = {"source": b.source, "split": b.split, "reward": b.reward, "max_new_tokens": settings.max_new_tokens,
             "file": path.name, "metrics": res.metrics}
    if res.stopped:
        entry.update(complete=False, n_problems_total=res.n_total)
        report["stopped"] = signal.Signals(stopper.signum).name
    report["benchmarks"][b.name] = entry
    table[b.name] = res.metrics
    table["_caps"][b.name] = settings.max_new_tokens
    write_json_atomic(out / "results.json", report)
    return res.stopped


def engine_setup(args, cfg) -> None:
    """``--engine``: ``rollout.engine`` of the evaluation's config, set and checked as ``tether train`` checks it
    (before the model loads)."""
    if not getattr(args, "engine", None):
        return
    value = loads_yaml(args.engine, "--engine", EvalError)
    try:
        cfg.rollout = apply_keys(cfg, {"rollout.engine": value}, "--engine").rollout
        check(cfg)
    except ConfigError as e:
        raise EvalError(str(e)) from None


def _eval_settings(args) -> EvalSettings:
    """The sampling settings of the command line (the flags given, else `EVAL_PRESET`'s and the keys' defaults),
    checked (and the other numeric / device options) before anything is loaded."""
    flag = {f.dest: f for f in EVAL_FLAGS["sampling"]}
    for problem in flag_problems(args, EVAL_FLAGS["sampling"]):  # each flag's range, declared with its key
        raise EvalError(problem)
    v = {k: value(args, f, EVAL_PRESET) for k, f in flag.items()}
    greedy = bool(v["greedy"])
    if greedy and args.n is not None and args.n > 1:
        raise EvalError(f"--greedy decodes one deterministic response per problem; drop --n {args.n} "
                        f"(or sample with --temperature > 0)")
    n = 1 if greedy else int(v["n"])
    temperature = 0.0 if greedy else float(v["temperature"])
    n, temperature = check_sampling(n, temperature, v["top_p"], greedy, flag="--")
    greedy = greedy or temperature == 0
    args.limit = v["limit"]
    if str(args.dtype).lower() not in DTYPES:
        raise EvalError(f"--dtype {args.dtype!r} is not one of {', '.join(DTYPES)}")
    for problem in check_device(args.device, "--device"):
        raise EvalError(problem)
    return EvalSettings(n=n, temperature=temperature, top_p=float(v["top_p"]), max_new_tokens=int(v["max_new_tokens"]),
                        greedy=greedy, batch_size=int(v["batch_size"]), seed=int(v["seed"]), ks=default_ks(n))


def run_eval_cli(args) -> int:
    """``tether eval``: load and validate every benchmark, then the model, then evaluate each
    benchmark, writing ``OUT/<bench>.jsonl`` and (after every benchmark) ``OUT/results.json``,
    and print the table. Errors in the inputs raise :class:`EvalError` / ``DataError``."""
    settings = _eval_settings(args)

    # 1. every benchmark, fully validated (and the agent's tools: the search corpus, the environment), before any
    # model is touched
    search = getattr(args, "agent", "single_turn") == "search"
    benches, plan = agent_setup(args)
    engine_setup(args, plan.cfg)
    # 2. the model (cheap checks first: run without checkpoint, anchor without tensors)
    info = getattr(args, "eval_spec", None) or resolve_eval_spec(args.model)  # --agent multi_turn resolved it
    if args.anchor:
        check_run_anchor(info)
    system_prompt = args.system_prompt
    if system_prompt is None:
        system_prompt = info.system_prompt if info.kind == "run" else ""
        if system_prompt:
            print(f"[tether] using the run's system prompt: {system_prompt!r}", file=sys.stderr)
    if args.out:
        out = Path(args.out)
    else:
        name = info.name + ("-anchor" if args.anchor else "")
        out = Path("evals") / f"{name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    files = [f"{b.name}.jsonl" for b in benches] + ["results.json"]
    created = _open_out(out, files, overwrite=bool(getattr(args, "overwrite", False)))  # before the model loads
    # SIGINT / SIGTERM from here on: the batch in progress finishes, the finished problems are kept
    stopper = GracefulStop(out, doing="stopping after the batch in progress and saving the finished problems",
                           abort=lambda name: Interrupted(name, f"aborted by a second stop signal ({name}); the "
                                                          f"problems finished so far are in {out}"))
    try:
        with stopper:
            plan.cfg.data.system_prompt = system_prompt
            plan.cfg.rollout.batch_size = settings.batch_size
            table = _run_benches(args, benches, info, out, stopper, search=search, plan=plan, settings=settings)
    except BaseException:
        if not any((out / f).is_file() and (out / f).stat().st_size for f in files):
            _drop_out(out, created, files)  # nothing finished: leave no empty --out behind
        raise
    return _finish(table, stopper, out, created, files, settings, search)


def _finish(table: dict, stopper, out: Path, created: bool, files: Sequence[str], settings: EvalSettings,
            search: bool) -> int:
    """Print the table (and say what a stop signal kept); returns the exit code."""
    desc, caps = table.pop("_desc"), table.pop("_caps")
    s = settings
    if stopper.signum:
        name = signal.Signals(stopper.signum).name
        done = sum(int(m.get("n_problems", 0)) for m in table.values())
        if done == 0:
            _drop_out(out, created, files)
            print(f"tether: stopped by {name} before any problem finished; nothing was written", file=sys.stderr)
        else:
            print(format_table(table, s.n, s.ks))
            print(f"tether: stopped by {name}: {done} finished problem(s) kept in {out / 'results.json'} "
                  f"(marked incomplete)", file=sys.stderr)
        return exit_code(name)
    shared = set(caps.values()) or {s.max_new_tokens}  # one cap, or each benchmark's (organism-dN has its own)
    tokens = str(shared.pop()) if len(shared) == 1 else ", ".join(f"{k}: {v}" for k, v in caps.items())
    print(f"{desc}\n{'greedy' if s.greedy else f'n={s.n} T={s.temperature:g} top_p={s.top_p:g}'}, "
          f"max_new_tokens={tokens}; accuracies in %, len in tokens")
    print(format_table(table, s.n, s.ks))
    if search:
        print(format_search_table(table))
    print(f"results: {out / 'results.json'}")
    return 0


def _run_benches(args, benches, info, out: Path, stopper, *, search: bool, plan: RolloutPlan,
                 settings: EvalSettings) -> dict:
    """Load the model, build its engine (``--engine``, default transformers, ``--batch-size`` sequences per generate
    call) and the
    agent (``--agent`` with the system prompt and the sections `tether.eval.agents.agent_setup` made of the flags,
    its tools already built) once from ``plan`` (`tether.agents.build.RolloutPlan.assemble`), as training does, then
    evaluate every benchmark until the end or a stop signal. Returns the table (benchmark -> metrics) with the
    model's description under ``"_desc"``."""
    print(f"[tether] loading {args.model!r}{' (anchor)' if args.anchor else ''}", file=sys.stderr)
    model, tok, desc = load_eval_model(info, anchor=args.anchor, dtype=args.dtype, device=args.device)
    hf = plan.cfg.rollout.engine.kind == "hf"
    parts = plan.assemble(model, tok, engine_options={"show_progress": False} if hf else None)
    try:
        return _evaluate_all(args, benches, info, out, stopper, search=search, plan=plan, settings=settings,
                             agent=parts.agent, desc=desc)
    finally:
        close = getattr(parts.engine, "close", None)  # the vLLM servers tether launched (--engine vllm_server)
        if close is not None:
            close()


def _evaluate_all(args, benches, info, out: Path, stopper, *, search: bool, plan: RolloutPlan,
                  settings: EvalSettings, agent, desc: str) -> dict:
    """Evaluate every benchmark with ``agent`` (`_run_benches`), writing the report as each one finishes."""
    system_prompt = plan.cfg.data.system_prompt
    print(f"[tether] evaluating {desc}\n[tether] writing to {out}", file=sys.stderr)
    if search:
        print(f"[tether] search agent: {args.retriever} retriever, top-{args.topk}, up to {args.max_searches} "
              f"searches", file=sys.stderr)
    s = settings
    report: dict[str, Any] = {
        "model": {"spec": str(args.model), "description": desc, "anchor": bool(args.anchor), "kind": info.kind,
                  "run_dir": str(info.run_dir) if info.run_dir else None,
                  "checkpoint": str(info.checkpoint) if info.checkpoint else None, "step": info.step,
                  "recipe": info.recipe},
        "settings": dict(n=s.n, temperature=s.temperature, top_p=s.top_p, max_new_tokens=s.max_new_tokens,
                         greedy=s.greedy, batch_size=s.batch_size, seed=s.seed, system_prompt=system_prompt,
                         limit=args.limit, ks=s.ks, dtype=args.dtype, device=args.device, data_dir=args.data_dir,
                         split=args.split, prompt_key=args.prompt_key, answer_key=args.answer_key, reward=args.reward,
                         agent=getattr(args, "agent", "single_turn"),
                         search={k: getattr(args, k) for k in ("retriever", "url", "corpus", "topk", "max_searches",
                                                                 "max_obs_tokens", "max_context")} if search else None,
                         env=getattr(args, "env_used", None) if getattr(args, "agent", "") == "multi_turn" else None),
        "benchmarks": {},
        "created": datetime.now().isoformat(timespec="seconds"),
        "tether_version": __version__,
    }
    table: dict[str, Any] = {"_desc": desc, "_caps": {}}  # _caps: each benchmark's max_new_tokens
    for b in benches:
        if _evaluate_bench(b, agent, out, report, table, stopper, search=search, settings=settings, args=args):
            break
    return table
