"""Running an evaluation: sample responses to benchmark problems through an agent, score them.

:func:`evaluate` takes an already-built agent (`tether.agents`): the caller decides how the
episodes run and which engine samples them. ``tether eval`` builds one per run with
:func:`tether.rollout.make_engine` and :func:`tether.agents.make_agent` from the loaded model;
the trainer's held-out evaluation (`tether.eval.held_out.HeldOut`) passes the trainer's own agent, so it
encodes prompts, runs episodes and samples (transformers or vLLM, ``rollout.engine``) exactly as
training does. Each response is scored with the benchmark's reward by
:func:`tether.tasks.rewards.call_reward` (`tether.tasks.rewards.score_one`, the normalisation the
trainer's scorer applies; in this process, without the trainer's worker process and time limit
for user rewards), failures score 0 and are counted, and the rows go to
:func:`tether.eval.metrics.summarize`. :func:`evaluate_during_training` is the trainer's flat
``eval/<bench>/<metric>`` view over several benchmarks.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

from ..agents import env_correct, reward_parts
from ..errors import EvalError
from ..rollout import SamplingParams
from ..tasks.base import Example, RewardFn
from ..tasks.rewards import call_reward, load_reward
from .metrics import check_ks, majority_vote, summarize

__all__ = ["EvalResult", "EvalSettings", "evaluate", "evaluate_during_training"]


@dataclass
class EvalResult:
    """The result of :func:`evaluate` on one benchmark.

    Attributes:
        metrics: ``avg@n``, ``pass@k`` for each k, ``maj@n`` (fractions in [0, 1]),
            ``mean_response_tokens``, ``truncation_rate``, ``no_answer_rate``,
            ``reward_mean``, ``reward_errors``, ``n_problems``, ``n_samples`` (per problem),
            ``n_responses``, ``gen_tokens``, ``gen_time_s``, ``wall_time_s``, ``tokens_per_s``
            (see :func:`tether.eval.metrics.summarize`), and ``agent/<name>`` counters if the
            agent keeps any.
        per_problem: One dict per problem, in the order of the examples: ``id``, ``prompt``,
            ``answer``, ``responses``, ``preds``, ``correct``, ``rewards``, ``lengths``,
            ``finish_reasons``, ``n_correct``, ``maj_answer``, ``maj_correct`` (and ``info``, the
            agent's record of each episode, when it keeps one).
        settings: The settings used, normalised (:class:`EvalSettings`' fields), with the agent's
            ``system_prompt`` and the class names of the ``agent`` and its ``engine``.
        first_reward_error: The first traceback a reward raised (None if none did).
    """

    metrics: dict[str, float]
    per_problem: list[dict]
    settings: dict = field(default_factory=dict)
    first_reward_error: Optional[str] = None
    stopped: bool = False  # should_stop() ended it early: per_problem and metrics cover the finished problems only
    n_total: int = 0  # problems asked for (len(examples))


@dataclass
class EvalSettings:
    """How :func:`evaluate` samples (defaults: temperature 0, i.e. greedy, one sample).

    ``greedy`` (or ``temperature`` 0) is argmax decoding and needs ``n`` = 1. ``batch_size`` is the
    number of sequences per ``agent.rollout`` call (the engine splits further by its own batch size).
    ``ks``: the k of pass@k (default :func:`tether.eval.metrics.default_ks`); ``stop``: stop strings.
    How prompts are encoded (system prompt, overflow) is the agent's.
    """

    n: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 512
    greedy: bool = False
    batch_size: int = 64
    seed: int = 0
    ks: Optional[list] = None
    stop: list = field(default_factory=list)


def check_sampling(n: int, temperature: float, top_p: float, greedy: bool,
                    flag: str = "") -> tuple[int, float]:
    """Validate the sampling knobs; greedy means temperature 0 and exactly one sample. ``flag``: how the
    errors name them (``"--"``: as the CLI's options, ``--n``, ``--temperature``, ``--top-p``)."""
    n = int(n)
    if n < 1:
        raise EvalError(f"{flag}n must be >= 1, got {n}")
    if greedy or temperature == 0:
        if n > 1:
            what = "--greedy" if greedy else "temperature 0"
            raise EvalError(f"{what} is deterministic decoding: the n = {n} samples would be identical; "
                            f"use n = 1 with greedy, or sample with temperature > 0")
        return 1, 0.0
    if temperature < 0:
        raise EvalError(f"{flag}temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise EvalError(f"{flag}{'top-p' if flag else 'top_p'} must be in (0, 1], got {top_p}")
    return n, float(temperature)


def _settings(settings: EvalSettings | Mapping[str, Any] | None) -> EvalSettings:
    """``settings`` checked and normalised: greedy <=> temperature 0 and n = 1, ks validated."""
    if settings is None:
        s = EvalSettings()
    elif isinstance(settings, EvalSettings):
        s = settings
    else:
        known = {f.name for f in dataclasses.fields(EvalSettings)}
        bad = sorted(set(settings) - known)
        if bad:
            raise EvalError(f"unknown eval setting(s) {bad}; valid: {sorted(known)}")
        s = EvalSettings(**dict(settings))
    n, temperature = check_sampling(s.n, s.temperature, s.top_p, s.greedy)
    if int(s.max_new_tokens) < 1:
        raise EvalError(f"max_new_tokens must be >= 1, got {s.max_new_tokens}")
    if int(s.batch_size) < 1:
        raise EvalError(f"batch_size must be >= 1, got {s.batch_size}")
    return EvalSettings(n=n, temperature=temperature, top_p=float(s.top_p), top_k=int(s.top_k),
                        max_new_tokens=int(s.max_new_tokens), greedy=bool(s.greedy) or temperature == 0,
                        batch_size=int(s.batch_size), seed=int(s.seed), ks=check_ks(s.ks, n), stop=list(s.stop or []))


def _chunks(agent, examples: list[Example], s: EvalSettings) -> list[list[int]]:
    """The examples' indices, longest prompt first, cut into ``agent.rollout`` calls of about
    ``batch_size`` sequences (``max(1, batch_size // n)`` problems each). The lengths come from the
    agent's PromptEncoder (``agent.prompts``), so a prompt too long for the model fails here, before
    generating; an agent without one keeps the examples' order."""
    prompts = getattr(agent, "prompts", None)
    lengths = [len(p) for p in prompts.encode(examples, s.max_new_tokens)] if prompts is not None else \
        [0] * len(examples)
    order = sorted(range(len(examples)), key=lambda i: -lengths[i])
    per_chunk = max(1, s.batch_size // s.n)
    return [order[i:i + per_chunk] for i in range(0, len(order), per_chunk)]


def _sampling(s: EvalSettings, j: int):
    """Chunk ``j``'s SamplingParams: seed ``seed * 1000003 + j``, so the same inputs, settings and
    ``batch_size`` give the same responses (the engine samples in a forked RNG)."""
    return SamplingParams(n=s.n, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                          max_new_tokens=s.max_new_tokens, stop=list(s.stop),
                          seed=(s.seed * 1_000_003 + j) % (2**31), greedy=s.greedy)


@dataclass
class _Tally:
    """What the chunks add up: generation time and tokens, reward failures, the running avg@n."""

    gen_time: float = 0.0
    gen_tokens: int = 0
    errors: int = 0
    first_error: Optional[str] = None
    n_correct: int = 0
    n_scored: int = 0


def _score_chunk(rb, chunk: list[int], examples: list[Example], reward: RewardFn, n: int,
                 tally: _Tally) -> list[dict]:
    """One row per problem of ``chunk`` from its rollout batch ``rb`` (``n`` rows per problem, in order)."""
    tally.gen_time += rb.gen_time_s
    tally.gen_tokens += rb.num_response_tokens
    lengths = rb.response_lengths.tolist()
    rows = []
    for g, i in enumerate(chunk):
        ex = examples[i]
        lo, hi = g * n, (g + 1) * n
        texts = rb.texts[lo:hi]
        preds, correct, rewards = [], [], []
        parts, verdicts = reward_parts(rb)[lo:hi], env_correct(rb)[lo:hi]  # an environment's reward and verdict
        for text, part, verdict in zip(texts, parts, verdicts):
            res, err = call_reward(reward, text, ex)
            if err is not None:
                tally.errors += 1
                tally.first_error = tally.first_error or err
            preds.append(res.pred)
            correct.append(bool(res.correct) or verdict)
            rewards.append(float(res.reward) + part)
        maj = majority_vote(preds, correct=correct)
        row = {
            "id": ex.id, "prompt": ex.prompt, "answer": ex.answer, "responses": list(texts),
            "preds": preds, "correct": correct, "rewards": rewards,
            "lengths": [int(x) for x in lengths[lo:hi]], "finish_reasons": list(rb.finish_reason[lo:hi]),
            "n_correct": int(sum(correct)), "maj_answer": maj.answer, "maj_correct": maj.correct,
        }
        if rb.info is not None:  # the agent's record of each episode (e.g. searches, passages shown)
            row["info"] = list(rb.info[lo:hi])
        tally.n_correct += sum(correct)
        tally.n_scored += n
        rows.append(row)
    return rows


def _metrics(rows: list[dict], s: EvalSettings, tally: _Tally, agent, t_start: float) -> dict:
    """:func:`~tether.eval.metrics.summarize` of the rows, the generation totals and the agent's counters."""
    metrics = summarize(rows, s.n, s.ks)
    metrics["reward_errors"] = tally.errors
    metrics["gen_tokens"] = tally.gen_tokens
    metrics["gen_time_s"] = tally.gen_time
    metrics["wall_time_s"] = time.perf_counter() - t_start
    metrics["tokens_per_s"] = tally.gen_tokens / max(tally.gen_time, 1e-9)
    for k, v in agent.metrics().items():
        metrics[f"agent/{k}"] = float(v)
    return metrics


def evaluate(
    agent,
    examples: Sequence[Example],
    reward: RewardFn | str,
    settings: EvalSettings | Mapping[str, Any] | None = None,
    *,
    show_progress: bool = True,
    desc: str = "eval",
    should_stop: Optional[Callable[[], bool]] = None,
    on_rows: Optional[Callable[[list[dict]], None]] = None,
) -> EvalResult:
    """Sample ``settings.n`` responses per example through ``agent``, score them, and compute
    avg@n, pass@k and maj@n.

    The problems (longest prompt first) are cut into chunks of ``max(1, batch_size // n)``
    problems, i.e. about ``batch_size`` sequences, and each chunk is one ``agent.rollout`` call;
    chunk ``j`` samples with seed ``seed * 1000003 + j`` (the engine forks the RNG, so the global
    RNG is untouched, and restores the model's train/eval mode): the same agent, inputs, settings
    and ``batch_size`` give the same responses. A tqdm bar counts problems. Each response is scored
    by :func:`~tether.tasks.rewards.call_reward`: ``RewardResult.correct`` is the verdict and
    ``RewardResult.pred`` the extracted answer the majority vote uses (a reward that raises or
    returns something invalid scores 0 and is counted in ``reward_errors``).

    Args:
        agent: a `tether.agents.Agent` (``make_agent(...)``, or a trainer's ``agent``): it encodes
            the prompts (its system prompt, its overflow rule) and drives its engine.
        examples: the problems.
        reward: a reward function, or a spec for :func:`~tether.tasks.rewards.load_reward`.
        settings: an :class:`EvalSettings`, or a mapping of its fields (unknown keys are an error);
            default: greedy, n = 1, 512 new tokens.
        should_stop: polled before every chunk; when it returns true the evaluation ends there
            (a graceful stop: ``tether eval`` passes its SIGINT / SIGTERM flag), and the result
            covers the finished problems only (``stopped=True``).
        on_rows: called after every chunk with that chunk's finished rows (``tether eval``
            appends them to its output file, so a killed evaluation keeps them).

    Returns:
        :class:`EvalResult`. The agent's own counters (``agent.metrics()``, which returns those since
        its last call: any left from before are dropped first) are added as ``agent/<name>``.
    """
    from tqdm.auto import tqdm

    t_start = time.perf_counter()
    s = _settings(settings)
    examples = list(examples)
    if not examples:
        raise EvalError("no examples to evaluate")
    reward = load_reward(reward) if isinstance(reward, str) else reward
    chunks = _chunks(agent, examples, s)
    agent.metrics()  # counters from before this evaluation (e.g. a training step's) are not its own
    rows: list[Optional[dict]] = [None] * len(examples)
    tally, stopped = _Tally(), False
    bar = tqdm(total=len(examples), desc=desc, unit="problem", disable=not show_progress, dynamic_ncols=True)
    try:
        for j, chunk in enumerate(chunks):
            if should_stop is not None and should_stop():
                stopped = True
                break
            rb = agent.rollout([examples[i] for i in chunk], _sampling(s, j))
            done = _score_chunk(rb, chunk, examples, reward, s.n, tally)
            for i, row in zip(chunk, done):
                rows[i] = row
            if on_rows is not None:
                on_rows(done)
            bar.update(len(chunk))
            bar.set_postfix({f"avg@{s.n}": f"{tally.n_correct / max(tally.n_scored, 1):.3f}"})
    finally:
        bar.close()
    rows = [r for r in rows if r is not None]  # all of them unless stopped
    engine = getattr(agent, "engine", None)
    settings_used = dataclasses.asdict(s) | {"system_prompt": getattr(agent, "system_prompt", ""),
                                             "agent": type(agent).__name__,
                                             "engine": None if engine is None else type(engine).__name__}
    return EvalResult(metrics=_metrics(rows, s, tally, agent, t_start), per_problem=rows, settings=settings_used,
                      first_reward_error=tally.first_error, stopped=stopped, n_total=len(examples))


def evaluate_during_training(
    agent,
    examples_by_bench: Mapping[str, Sequence[Example]],
    reward_fns: Mapping[str, RewardFn | str] | RewardFn | str,
    settings: EvalSettings | Mapping[str, Any] | None = None,
) -> dict[str, float]:
    """Evaluate the current policy on several benchmarks; return flat metrics for metrics.jsonl.

    A thin wrapper over :func:`evaluate` (no progress bar) with the trainer's ``agent`` (and so its
    engine): for every benchmark ``b`` and every numeric metric ``m`` of its :class:`EvalResult`
    the result holds ``"eval/<b>/<m>"`` (e.g. ``eval/gsm8k/avg@1``, ``eval/gsm8k/pass@4``,
    ``eval/gsm8k/maj@4``, ``eval/gsm8k/mean_response_tokens``). Sampling is seeded by
    ``settings.seed`` in a forked RNG, so calling this does not change the training RNG stream.

    Args:
        examples_by_bench: benchmark name -> examples (e.g. from
            :func:`tether.tasks.benchmarks.load_benchmark`).
        reward_fns: benchmark name -> reward function (or reward spec), or one reward for all.
        settings: an :class:`EvalSettings`, or a mapping of its fields (unknown keys are an
            error). Default: greedy, n = 1, 512 new tokens.
    """
    s = _settings(settings)
    out: dict[str, float] = {}
    for bench, examples in examples_by_bench.items():
        if isinstance(reward_fns, Mapping):
            if bench not in reward_fns:
                raise EvalError(f"no reward function given for benchmark {bench!r}")
            fn = reward_fns[bench]
        else:
            fn = reward_fns
        res = evaluate(agent, examples, fn, s, show_progress=False)
        for k, v in res.metrics.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[f"eval/{bench}/{k}"] = float(v)
    return out
