"""Cold-start demonstrations: teacher trajectories through an environment, for ``tether sft``.

A demonstration is built from a *training* example's gold answer (and, for search, its gold
paragraphs): a scripted teacher writes each policy turn, and the real environment answers it,
so every observation is exactly what the environment shows the policy in RL (the calculator's
``<result>`` values, the real retriever's passages in ``search.observation_format``). They are
teacher demonstrations built from gold answers, not samples of any model.

* :func:`calculator_demos` (arithmetic, GSM8K):

  - arithmetic (``meta["start"]``, ``meta["ops"]``): one call with the problem's exact expression,
    ``<calc>((10 + 5) * 3 - 7) / 2</calc>``, its result, then ``#### answer``;
  - GSM8K (the solution's ``<<expr=value>>`` annotations): the solution's text with each
    annotation turned into a call, ``... 48/2 = <calc>48/2</calc><result>24</result> clips ...``
    (the value the solution repeats after the annotation is dropped: the result shows it), then
    ``#### answer``. A solution with more calls than the turn budget allows, or one whose
    annotation the calculator computes differently (GSM8K rounds), is skipped and counted.

* :func:`search_demos` (the closed-pool ``multihop`` train split): a first search with the
  question; while no observation so far holds a gold answer, a search for the title of a gold
  paragraph not yet shown (at most 3 searches in all); then ``<answer> gold </answer>``. An example whose observations
  never hold a gold answer is skipped and counted (a demonstration should not teach answering
  without evidence).

Each demonstration is one SFT row (docs/sft.md): the environment's opening prompt as the user
turn (and the system prompt, if any), and one assistant turn of segments whose observations are
marked ``"train": false``, so only the teacher's tokens are trained.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

from ..agents.build import build_env
from ..config.flags import DEMOS_FLAGS, DEMOS_PRESET, add_flags, value
from ..envs.base import Env
from ..envs.calculator import calculate
from ..errors import ConfigError, OutputError
from ..resolve import load_config
from ..search.corpus import load_corpus
from ..search.data import SEARCH_DATASETS, corpus_path, load_search_examples
from ..search.reward import golden_answers
from ..tasks.arithmetic import ArithmeticTask
from ..tasks.base import DataError, Example
from ..tasks.data import NAMED_DATASETS, load_examples
from ..tasks.qa_reward import normalize_answer
from ..userio import MARK_KEY, claim_output_file, output_writer

__all__ = ["DemoStats", "run_teacher", "sft_row", "calculator_demos", "search_demos", "arithmetic_expression",
           "gsm8k_turns"]

#: A teacher: (example, the observations so far) -> the next turn's text, or None to give up on the example.
Teacher = Callable[[Example, list], Optional[str]]


@dataclass
class DemoStats:
    """What a builder did: demonstrations written, examples skipped (by reason)."""

    written: int = 0
    skipped: dict = field(default_factory=dict)

    def skip(self, why: str) -> None:
        self.skipped[why] = self.skipped.get(why, 0) + 1

    def __str__(self) -> str:
        why = ", ".join(f"{n} {w}" for w, n in sorted(self.skipped.items())) or "none"
        return f"{self.written} demonstrations; skipped: {why}"


def run_teacher(env: Env, example: Example, teacher: Teacher):
    """One episode of ``env`` on ``example`` with ``teacher`` as the policy: ``(start, segments)``, segments
    being ``(text, trained)`` pairs in order (the teacher's turns True, observations False), or None
    when the teacher gives up or the episode ends before the teacher's last turn."""
    start = env.reset(example)
    segments: list[tuple[str, bool]] = []
    observations: list[Optional[str]] = []
    while env.active():
        turn = teacher(example, observations)
        if turn is None:
            env.end(env.active()[0])
            return None
        [r] = env.step([turn])
        segments.append((turn, True))
        if r.done:
            return (start, segments) if not r.truncated and not r.info.get("invalid") else None
        observations.append(r.observation)
        if r.observation:
            segments.append((r.observation, False))
    return None


def sft_row(start, segments: list[tuple[str, bool]], system_prompt: str = "", source: str = "") -> dict:
    """The SFT row (docs/sft.md) of a demonstration: the opening prompt, then one assistant turn of segments."""
    messages = list(start.prompt) if isinstance(start.prompt, list) else (
        ([{"role": "system", "content": system_prompt}] if system_prompt else [])
        + [{"role": "user", "content": start.prompt}])
    content = [{"text": t, "train": bool(tr)} for t, tr in segments]
    return {"messages": messages + [{"role": "assistant", "content": content}], "source": source}


# ------------------------------------------------------------------ calculator


def arithmetic_expression(start: int, ops) -> str:
    """The arithmetic task's problem as one expression: ``((10 + 5) * 3 - 7) / 2``."""
    expr = str(start)
    for i, (op, n) in enumerate(ops):
        if op in "*/" and i > 0 and ops[i - 1][0] in "+-":
            expr = f"({expr})"
        expr = f"{expr} {op} {n}"
    return expr


_ANNOTATION = re.compile(r"<<([^<>=]+)=([^<>]+)>>")


def gsm8k_turns(solution: str) -> Optional[list[tuple[str, str]]]:
    """A GSM8K solution as teacher turns: ``(turn text, the value the solution states)`` per call, the last
    turn (the final answer) with value "". None when the solution has no ``#### answer``."""
    body, sep, final = solution.rpartition("####")
    if not sep or not final.strip():
        return None
    turns, pos = [], 0
    for m in _ANNOTATION.finditer(body):
        expr, value = m.group(1).strip(), m.group(2).strip()
        turns.append((body[pos:m.start()] + f"<calc>{expr}</calc>", value))
        pos = m.end()
        nxt = body[pos + len(value):pos + len(value) + 1]
        if body.startswith(value, pos) and not (nxt.isdigit() or nxt == "."):  # "<<48/2=24>>24 clips": shown
            pos += len(value)
    rest = body[pos:].rstrip()
    turns.append(((rest + "\n" if rest else "") + f"#### {final.strip()}", ""))
    return turns


def calculator_demos(examples: Iterable[Example], env, stats: Optional[DemoStats] = None,
                     system_prompt: str = "") -> Iterable[dict]:
    """SFT rows for the calculator environment ``env`` from arithmetic (``meta["ops"]``) or GSM8K
    (``meta["solution"]``, the full answer field) examples (module docstring)."""
    stats = stats if stats is not None else DemoStats()
    for ex in examples:
        meta = ex.meta if isinstance(ex.meta, dict) else {}
        if "ops" in meta:
            expr = arithmetic_expression(meta["start"], meta["ops"])
            turns = [(f"The problem is {expr}, so I calculate <calc>{expr}</calc>", ""), (f"\n#### {ex.answer}", "")]
        else:
            turns = gsm8k_turns(str(meta.get("solution", "")))
            if turns is None:
                stats.skip("without a '#### answer' solution")
                continue
        if len(turns) > env.max_turns:
            stats.skip(f"with more than {env.max_turns - 1} calculations")
            continue
        if any(v and calculate(t.rsplit("<calc>", 1)[1][:-len("</calc>")])[0] != _number(v) for t, v in turns):
            stats.skip("whose annotated value the calculator computes differently")
            continue
        texts = iter(t for t, _ in turns)
        out = run_teacher(env, ex, lambda _e, _o: next(texts, None))
        if out is None:
            stats.skip("that the environment did not end on the answer")
            continue
        stats.written += 1
        yield sft_row(*out, system_prompt=system_prompt, source=ex.id)


def _number(v: str) -> Optional[str]:
    """A stated value as the calculator would print it (``"24.00"`` -> ``"24"``), None if not a number."""
    return calculate(v.replace(",", "").rstrip("."))[0]


# ------------------------------------------------------------------ search


def _holds(observations: list, answers: list[str]) -> bool:
    seen = normalize_answer(re.sub(r"<[^<>]*>", " ", " ".join(o or "" for o in observations)))  # tags are not words
    return any(normalize_answer(a) and f" {normalize_answer(a)} " in f" {seen} " for a in answers)


def search_demos(examples: Iterable[Example], env, corpus, stats: Optional[DemoStats] = None,
                 system_prompt: str = "") -> Iterable[dict]:
    """SFT rows for the search environment ``env`` (its real retriever) from QA examples with gold
    paragraphs (``meta["supporting_ids"]``, looked up in ``corpus`` for their titles; module docstring)."""
    stats = stats if stats is not None else DemoStats()
    for ex in examples:
        answers = golden_answers(ex)
        question = (ex.meta or {}).get("question", ex.prompt)
        titles = []
        for pid in (ex.meta or {}).get("supporting_ids", []):
            try:
                titles.append(corpus.titles[corpus.index_of(str(pid))])
            except KeyError:
                continue

        def teacher(_ex, observations, titles=titles, answers=answers, question=question):
            if _holds(observations, answers):
                return f"<think>The documents say the answer is {answers[0]}.</think>\n<answer> {answers[0]} </answer>"
            if not observations:
                return f"<think>I need to find what the question asks about.</think>\n<search> {question} </search>"
            if len(observations) >= min(3, env.max_searches):
                return None
            shown = " ".join(o or "" for o in observations)
            title = next((t for t in titles if t and t not in shown), None)
            return None if title is None else \
                f"<think>I need more information about {title}.</think>\n<search> {title} </search>"

        out = run_teacher(env, ex, teacher)
        if out is None:
            stats.skip("whose searches never showed a gold answer")
            continue
        stats.written += 1
        yield sft_row(*out, system_prompt=system_prompt, source=ex.id)


# ------------------------------------------------------------------ tether demos


def _examples(args) -> list[Example]:
    """The training examples the command reads (``--data``; never a dev or test split)."""
    if args.env == "calculator":
        if args.data == "arithmetic":
            task = ArithmeticTask(seed=args.seed, difficulty=args.difficulty)
            return [task.example(i) for i in range(args.limit or 1000)]
        return load_examples(args.data, split="train", data_dir=args.data_dir, limit=args.limit or None)
    return load_search_examples(args.data, data_dir=args.data_dir, limit=args.limit or None,
                                max_searches=args.max_searches)


def _demos(args) -> int:
    """``tether demos``: write the demonstrations of ``args.env`` to ``args.out`` (JSONL, one SFT row per line)."""
    import json
    import sys
    from pathlib import Path

    out = Path(args.out)
    if out.exists() and not out.is_dir() and not args.overwrite:
        raise OutputError(f"{out} exists; pass --overwrite to replace it")
    claim_output_file(out, "demos")  # --overwrite replaces only a file tether demos wrote; the directory writable
    examples = _examples(args)
    stats = DemoStats()
    env = build_env(load_config(None, _env_keys(args)))  # the environment training builds from the same keys
    if args.env == "calculator":
        rows = calculator_demos(examples, env, stats, args.system_prompt)
    else:
        rows = search_demos(examples, env, load_corpus(args.corpus or str(corpus_path(args.data_dir))), stats,
                            args.system_prompt)
    with output_writer(out, note="nothing was written") as f:
        for row in rows:
            f.write(json.dumps({**row, MARK_KEY: "demos"}) + "\n")  # the mark of a row tether wrote
        if not stats.written:
            raise DataError(f"no demonstration could be built from {len(examples)} examples of {args.data} ({stats}); "
                            f"nothing was written")
    print(f"[tether] {args.env}: {stats} (from {len(examples)} training examples)", file=sys.stderr)
    print(out)
    return 0


def _env_keys(args) -> dict:
    """The flags as the config keys a training run with that environment sets (`tether.agents.build.build_env`
    builds the environment from them, as training does)."""
    if args.env == "calculator":
        return {"rollout.agent.kind": "multi_turn", "rollout.agent.env.name": "calculator",
                "rollout.agent.env.max_turns": args.max_turns}
    r = "rollout.agent.env.retriever."
    return {"rollout.agent.kind": "multi_turn", "rollout.agent.env.name": "search",
            "rollout.agent.env.max_turns": args.max_searches + 1,
            r + "corpus": args.corpus or str(corpus_path(args.data_dir)),
            r + "data_dir": args.data_dir or "", r + "topk": args.topk, r + "passage_format": args.observation_format}


def add_demos_parser(sub) -> None:
    """The ``tether demos`` subcommand."""
    d = sub.add_parser("demos", help="write cold-start demonstrations (teacher trajectories through an environment, "
                       "from a training split's gold answers) for tether sft",
                       description="Write cold-start demonstrations for tether sft (docs/sft.md): a scripted teacher "
                       "writes each turn from a training example's gold answer, and the real environment answers it. "
                       "They are teacher demonstrations, not model samples; build them from training splits only.")
    d.add_argument("env", choices=["calculator", "search"], help="the environment")
    d.add_argument("--out", required=True, help="the JSONL file to write (one SFT row per line)")
    d.add_argument("--overwrite", action="store_true", help="replace --out if it exists and tether demos wrote it "
                   "(every row marked \"tether\": \"demos\"); a file of yours is never replaced")
    d.add_argument("--data", help="training examples: calculator: arithmetic (default; the synthetic task's train "
                   "split) | gsm8k (its train split) | a train file; search: multihop (default; the closed-pool "
                   "train split) | a train .jsonl")
    d.add_argument("--data-dir", dest="data_dir", default=None, help="the data directory (as data.data_dir / "
                   "rollout.agent.env.retriever.data_dir)")
    d.add_argument("--limit", type=int, default=0, help="use the first N examples (0 = all; arithmetic: 1000)")
    d.add_argument("--difficulty", type=int, default=3, help="arithmetic: steps per problem, 1-4 (default 3)")
    d.add_argument("--seed", type=int, default=0, help="arithmetic: the task's seed (default 0)")
    d.add_argument("--max-searches", dest="max_searches", type=int, default=4,
                   help="search: searches allowed, as rollout.agent.env.max_turns - 1 in training (the prompt "
                   "states it; default 4)")
    add_flags(d, DEMOS_FLAGS, DEMOS_PRESET)  # the config keys' own flags: type, choices and help from the keys
    d.set_defaults(fn=_demos_main)


def _named_sets(env: str) -> set[str]:
    """The named datasets of ``env``'s kind (the training ones among them: arithmetic, gsm8k, multihop)."""
    if env == "calculator":
        return {"arithmetic", *NAMED_DATASETS}
    return set(SEARCH_DATASETS)


def flag_values(args) -> None:
    """Each config key's flag not given takes the preset's value, else the key's default (what its help states)."""
    for f in DEMOS_FLAGS:
        setattr(args, f.dest, value(args, f, DEMOS_PRESET))


def _demos_main(args) -> int:
    flag_values(args)
    args.data = args.data or ("arithmetic" if args.env == "calculator" else "multihop")
    if args.data.lower() in ("arithmetic", "gsm8k", "multihop"):
        args.data = args.data.lower()
    if args.env == "calculator" and args.max_turns < 2:
        raise ConfigError(f"--max-turns must be >= 2 (a call and the answer), got {args.max_turns}")
    if args.env == "calculator" and args.data == "arithmetic" and args.difficulty not in (1, 2, 3, 4):
        raise ConfigError(f"--difficulty must be 1, 2, 3 or 4, got {args.difficulty}")
    named = _named_sets(args.env)
    if args.data.lower() in named and args.data.lower() not in ("arithmetic", "gsm8k", "multihop"):
        train = "arithmetic, gsm8k" if args.env == "calculator" else "multihop"
        raise ConfigError(f"--data {args.data} is an evaluation set (dev, test or benchmark): demonstrations are built "
                          f"from training splits only ({train} or your own training file)")
    if args.limit < 0 or args.topk < 1 or args.max_searches < 1:
        raise ConfigError("--limit must be >= 0, --topk and --max-searches >= 1")
    return _demos(args)
