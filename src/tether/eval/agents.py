"""``tether eval``'s agents: their command-line options and what each needs before the model loads.

* :func:`add_agent_arguments` -- ``--agent`` and the options of the multi-turn (``--env``) and search agents;
* :func:`agent_setup` -- the benchmarks, and the flags as the ``rollout.agent`` section of a config (with its
  ``env`` and the search environment's ``retriever``: the same keys ``tether train`` reads) with the agent's
  tools built from it (the environment, with the search environment's retriever), all checked before any model
  is touched (a `tether.agents.build.RolloutPlan`); the model's engine and agent are then assembled from that
  plan, as training assembles them;
* :func:`format_search_table` -- the search agent's table (EM, F1, answered rate, searches, gold recall).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

from ..agents import AGENTS
from ..agents.build import RolloutPlan
from ..config import Config
from ..config.agent import SEARCH_MAX_TURNS
from ..config.flags import EVAL_FLAGS, EVAL_PRESET, Flag, add_flags, given, value
from ..errors import EvalError
from ..resolve import load_config
from ..search.data import load_search_examples
from ..search.retrievers import RETRIEVERS
from ..sections import as_dict
from ..tasks.benchmarks import Benchmark, load_benchmarks
from ..tasks.rewards import load_reward
from ..userio import loads_yaml, slug
from .model import resolve_eval_spec

__all__ = ["add_agent_arguments", "agent_setup", "format_search_table", "search_setup", "env_setup"]


def add_agent_arguments(e) -> None:
    """``--agent`` and the agents' own options, on the ``eval`` parser ``e``."""
    e.add_argument("--agent", default="single_turn", choices=[*AGENTS.names(), "search"],
                   help="how an episode runs (rollout.agent.kind): single_turn (default: prompt -> one response) | "
                   "multi_turn (the environment --env, e.g. calculator on gsm8k) | search (short for multi_turn in "
                   "the search environment, rollout.agent.env.name=search, on QA benchmarks)")
    m = e.add_argument_group("multi-turn agent", "--agent multi_turn runs an environment (docs/environments.md) on the "
                             "benchmarks; the task's reward scores the episodes' text")
    m.add_argument("--env", default=None, help="multi_turn (rollout.agent.env.name): calculator | skyrl_gym:<name> | "
                   "verifiers:<env_id> | module:Class | path.py:Class (default: the rollout.agent.env settings a "
                   "--model run trained with, when it ran an environment other than search; else calculator; a flag "
                   "given here overrides the run's value). skyrl_gym and verifiers environments run in the chat "
                   "observation format (skyrl_gym: user observation turns) unless the run says otherwise")
    m.add_argument("--env-options", dest="env_options", default=None, metavar="YAML",
                   help="multi_turn: the environment's options as a YAML/JSON mapping (rollout.agent.env.options), "
                   "e.g. '{args: {num_eval_examples: 200}}' for a verifiers environment's load_environment")
    add_flags(m, EVAL_FLAGS["multi_turn"], EVAL_PRESET)
    g = e.add_argument_group("search environment", "--agent search runs the search environment "
                             "(docs/search_agents.md; its flags are rollout.agent.env.retriever.* keys) "
                             "on QA benchmarks: multihop_dev, multihop, nq, triviaqa, popqa, hotpotqa, "
                             "2wikimultihopqa, musique, bamboogle, or .jsonl files with question/golden_answers")
    add_flags(g, EVAL_FLAGS["search"], EVAL_PRESET, choices={"rollout.agent.env.retriever.kind": RETRIEVERS.names()})
    g.add_argument("--max-searches", dest="max_searches", type=int, default=None,
                   help=f"search: searches per episode, then a final turn without search (rollout.agent.env.max_turns "
                   f"= this + 1; default {SEARCH_MAX_TURNS - 1})")
    add_flags(g, EVAL_FLAGS["budgets"], EVAL_PRESET)


#: --retriever (rollout.agent.env.retriever.kind)
RETRIEVER_FLAG = next(f for f in EVAL_FLAGS["search"] if f.key == "rollout.agent.env.retriever.kind")
#: the flags only the search agent reads (the budgets are multi_turn's too)
SEARCH_ONLY = [*EVAL_FLAGS["search"], Flag("rollout.agent.env.max_turns", "--max-searches")]


def agent_setup(args) -> tuple[list, RolloutPlan]:
    """The benchmarks (each fully loaded and checked) and the rollout plan of the config the flags make
    (``rollout.agent`` and its ``env`` section; ``plan.cfg``), with the agent's tools built here, before the model
    (`tether.agents.build.RolloutPlan`: its ``assemble`` then builds the engine and agent on the model)."""
    agent = getattr(args, "agent", "single_turn")
    env_keys = [f"--{k.replace('_', '-')}" for k in ("env", "max_turns", "env_options")
                if getattr(args, k, None) not in (None, "")]
    if agent != "multi_turn" and env_keys:
        raise EvalError(" and ".join(env_keys) + " only apply with --agent multi_turn")
    wasted = []
    if agent != "search":  # the search agent's flags given (the budgets are multi_turn's too)
        unread = SEARCH_ONLY + (EVAL_FLAGS["budgets"] if agent != "multi_turn" else [])
        wasted = [f.name for f in unread if getattr(args, f.dest, None) is not None]
    if wasted:
        raise EvalError(", ".join(wasted) + f" {'has' if len(wasted) == 1 else 'have'} no effect with --agent {agent}")
    if agent == "search":
        if args.reward or args.split or args.data_dir:
            raise EvalError("--agent search scores with the search reward (EM) on the search data dir; "
                            "drop --reward/--split/--data-dir (use --search-data-dir)")
        return search_setup(args)
    cfg = env_setup(args, run_env(args)) if agent == "multi_turn" else load_config(None, {"rollout.agent.kind": agent})
    plan = RolloutPlan(cfg)  # first: an environment that holds its benchmark (verifiers:<env_id>) is loaded here
    benches = load_benchmarks(args.benchmarks, limit=args.limit, data_dir=args.data_dir,
                              prompt_key=args.prompt_key, answer_key=args.answer_key, split=args.split,
                              reward=args.reward)
    return benches, plan


def run_env(args) -> dict[str, Any]:
    """The ``rollout.agent.env`` section of the run ``--model`` names (a run directory or one of its checkpoints)
    when that run trained with ``rollout.agent.kind=multi_turn`` in an environment other than search; else ``{}``.
    A problem with the run is left to the model loading,
    which names it; nothing is loaded here. The resolved spec is kept in ``args.eval_spec`` for the model
    loading (a checkpoint is verified once)."""

    try:
        args.eval_spec = resolve_eval_spec(args.model)
    except EvalError:
        return {}
    run = args.eval_spec.run
    if run is None or run.kind != "run":  # a plain model, or an SFT run (no environment)
        return {}
    cfg = run.config
    if isinstance(cfg, dict):  # a saved config that no longer validates here: its raw sections
        agent = (cfg.get("rollout") or {}).get("agent")
        env = agent.get("env") if isinstance(agent, dict) else cfg.get("env") if agent == "multi_turn" else None
    else:
        env = as_dict(cfg.rollout.agent.env) if cfg.rollout.agent.kind == "multi_turn" else None
    if not isinstance(env, dict) or env.get("name") == "search":
        return {}
    return {k: v for k, v in env.items() if k != "retriever"}


def env_setup(args, trained: Mapping[str, Any] | None = None) -> Config:
    """--agent multi_turn: the config of the environment (``--env``, ``--max-turns``) and the agent's budgets,
    ``rollout.agent.kind=multi_turn`` with ``rollout.agent.env.*`` as in training. ``trained``: the ``env``
    settings of the run being evaluated (`run_env`), the defaults of every flag not given; the section's defaults
    after them."""
    import sys

    p = "rollout.agent.env."
    over = {"rollout.agent.kind": "multi_turn", **{p + k: v for k, v in (trained or {}).items()}}
    if trained:
        print("[tether] using the run's environment: " + ", ".join(f"{p}{k}={v}" for k, v in trained.items())
              + " (flags given here override it)", file=sys.stderr)
    flags = {"name": args.env, "options": _options(getattr(args, "env_options", None))}
    over.update({p + k: v for k, v in flags.items() if v is not None and v != ""})
    over.update(given(args, EVAL_FLAGS["multi_turn"] + EVAL_FLAGS["budgets"]))
    cfg = load_config(None, over)  # skyrl_gym / verifiers: chat turns, their sections' defaults
    args.env_used = as_dict(cfg.rollout.agent.env)  # what results.json records
    return cfg


def _options(text: Optional[str]) -> Optional[dict]:
    """--env-options: a YAML / JSON mapping (None when not given)."""
    if text in (None, ""):
        return None
    value = loads_yaml(text, "--env-options", EvalError)
    if not isinstance(value, dict):
        raise EvalError(f"--env-options must be a mapping (the environment's options), got {text!r}")
    return value


def search_setup(args) -> tuple[list, RolloutPlan]:
    """--agent search: the QA benchmarks (search reward) and the rollout plan of the search environment's config
    (``rollout.agent.env.*`` and its ``retriever`` from the flags), with its tools (the environment over the
    retriever, built and checked here)."""
    http = {k: v for k in ("url", "timeout", "retries") if (v := getattr(args, k, None)) not in (None, "")}
    retriever = value(args, RETRIEVER_FLAG, EVAL_PRESET)
    if http and retriever != "http":
        raise EvalError(" and ".join(f"--{k}" for k in http) + f" need{'s' * (len(http) == 1)} --retriever http")
    max_searches = SEARCH_MAX_TURNS - 1 if args.max_searches is None else args.max_searches
    if max_searches < 0:
        raise EvalError(f"--max-searches must be >= 0, got {max_searches}")
    if retriever == "http" and not args.url:
        raise EvalError("--retriever http needs --url (the retrieval server's base URL)")
    over = {"rollout.agent.kind": "multi_turn", "rollout.agent.env.name": "search",
            "rollout.agent.env.max_turns": max_searches + 1,
            **given(args, EVAL_FLAGS["search"] + EVAL_FLAGS["budgets"])}
    cfg = load_config(None, over)
    env = cfg.rollout.agent.env  # what results.json and the banner record, as used
    args.max_searches, args.max_obs_tokens, args.max_context = max_searches, env.max_obs_tokens, env.max_context
    args.retriever, args.topk = env.retriever.kind, env.retriever.topk
    benches = []
    for src in args.benchmarks:
        ex = load_search_examples(src, data_dir=args.search_data_dir, max_searches=max_searches,
                                  limit=args.limit, question_key=args.prompt_key or "question",
                                  answers_key=args.answer_key)
        benches.append(Benchmark(name=slug(Path(src).stem if src.endswith(".jsonl") else src), source=src,
                                 split=None, examples=ex, reward="search", reward_fn=load_reward("search")))
    return benches, RolloutPlan(cfg)


def format_search_table(results: Mapping[str, Mapping[str, float]]) -> str:
    """EM, F1, answered rate, searches and gold recall per benchmark and data source (search agent); when some
    recall is unknown (passages without ids), a ``gold_recall_unknown`` column counts those responses."""
    cols = ["em", "f1", "answered_rate", "searches", "gold_recall"]
    cols += ["gold_recall_unknown"] * any(k.endswith("/gold_recall_unknown") for m in results.values() for k in m)
    cell = {"searches": "{:.2f}".format, "gold_recall_unknown": "{:.0f}".format}
    lines = [f"{'benchmark / source':32s} " + " ".join(f"{c:>{max(13, len(c))}s}" for c in cols)]
    for name, m in results.items():
        sources = sorted({k.split("/")[1] for k in m if k.startswith("search/") and k.count("/") == 2})
        for src, pre in [(name, "search/")] + [(f"  {src}", f"search/{src}/") for src in sources]:
            cells = [m.get(pre + c, 0.0 if c == "gold_recall_unknown" else None) for c in cols]
            text = ["-" if v is None else cell.get(c, lambda x: f"{100 * x:.1f}")(v) for c, v in zip(cols, cells)]
            lines.append(f"{src:32s} " + " ".join(f"{t:>{max(13, len(c))}s}" for c, t in zip(cols, text)))
    return "\n".join(lines)
