"""Running an evaluation: sample responses to benchmark problems through an agent, score them.

:func:`evaluate` builds the engine with :func:`tether.rollout.make_engine` and the agent
with :func:`tether.agents.make_agent` (default ``single_turn``; the agent encodes the
prompts), so evaluation samples exactly as training does; it scores every response with the
benchmark's reward and hands the rows to :func:`tether.eval.metrics.summarize`.
:func:`evaluate_during_training` is the trainer's flat ``eval/<bench>/<metric>`` view.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

from ..errors import EvalError
from ..tasks.base import Example, RewardFn
from .metrics import _check_ks, majority_vote, summarize

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
            ``finish_reasons``, ``n_correct``, ``maj_answer``, ``maj_correct``.
        settings: The generation settings used (n, temperature, top_p, ...).
        first_reward_error: The first traceback a reward raised (None if none did).
    """

    metrics: dict[str, float]
    per_problem: list[dict]
    settings: dict = field(default_factory=dict)
    first_reward_error: Optional[str] = None
    stopped: bool = False  # should_stop() ended it early: per_problem and metrics cover the finished problems only
    n_total: int = 0  # problems asked for (len(examples))


def _check_sampling(n: int, temperature: float, top_p: float, greedy: bool) -> tuple[int, float]:
    """Validate the sampling knobs; greedy means temperature 0 and exactly one sample."""
    n = int(n)
    if n < 1:
        raise EvalError(f"n must be >= 1, got {n}")
    if greedy or temperature == 0:
        if n > 1:
            what = "--greedy" if greedy else "temperature 0"
            raise EvalError(f"{what} is deterministic decoding: the n = {n} samples would be identical; "
                            f"use n = 1 with greedy, or sample with temperature > 0")
        return 1, 0.0
    if temperature < 0:
        raise EvalError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise EvalError(f"top_p must be in (0, 1], got {top_p}")
    return n, float(temperature)


def evaluate(
    model,
    tokenizer,
    examples: Sequence[Example],
    reward_fn: RewardFn | str,
    *,
    n: int = 1,
    temperature: float = 1.0,
    top_p: float = 1.0,
    max_new_tokens: int = 512,
    greedy: bool = False,
    batch_size: int = 64,
    system_prompt: str = "",
    seed: int = 0,
    show_progress: bool = True,
    ks: Optional[Iterable[int]] = None,
    top_k: int = 0,
    stop: Optional[Sequence[str]] = None,
    desc: str = "eval",
    agent: str = "single_turn",
    agent_options: Optional[Mapping[str, Any]] = None,
    engine: str = "hf",
    should_stop: Optional[Callable[[], bool]] = None,
    on_rows: Optional[Callable[[list[dict]], None]] = None,
) -> EvalResult:
    """Sample ``n`` responses per example, score them, and compute avg@n, pass@k and maj@n.

    Generation is batched across problems and samples: the problems (longest prompt first)
    are cut into chunks of ``max(1, batch_size // n)`` problems, i.e. about ``batch_size``
    sequences, and each chunk is one ``agent.rollout`` call (whose engine splits further
    into sub-batches of ``batch_size`` sequences). Chunk ``j`` samples with seed
    ``seed * 1000003 + j`` (in a forked RNG, so the global RNG is untouched): the same
    inputs, settings and ``batch_size`` give the same responses. A tqdm bar counts problems.

    The engine is ``tether.rollout.make_engine(RolloutConfig(engine=engine,
    batch_size=batch_size), model, tokenizer)`` and the episodes are run by
    ``tether.agents.make_agent(agent, engine, tokenizer, system_prompt=system_prompt,
    **agent_options)``: with the default ``single_turn`` agent the prompts go through the
    model's chat template with ``system_prompt`` (:func:`tether.tasks.prompts.encode_prompts`,
    as in training). Each response is scored by
    :func:`~tether.tasks.rewards.call_reward`: ``RewardResult.correct`` is the verdict and
    ``RewardResult.pred`` the extracted answer used by the majority vote (a reward that
    raises scores 0 and is counted in ``reward_errors``). Metrics: see
    :mod:`tether.eval.metrics`.

    Args:
        model, tokenizer: a causal LM (or a peft wrapper) and its (left-padding) tokenizer.
        examples: the problems.
        reward_fn: a reward function, or a spec for :func:`~tether.tasks.rewards.load_reward`.
        n: samples per problem; must be 1 with ``greedy`` (or temperature 0).
        temperature, top_p, top_k: the sampling distribution (``greedy``: argmax).
        max_new_tokens: response length cap (responses reaching it count as truncated).
        batch_size: sequences per generate call.
        ks: the k of pass@k (default :func:`tether.eval.metrics.default_ks`).
        stop: optional stop strings.
        agent, agent_options: the agent that runs an episode (a name in
            ``tether.agents.AGENTS``) and extra options for its constructor.
        engine: the rollout engine (a name in ``tether.rollout.ENGINES``).
        should_stop: polled before every chunk; when it returns true the evaluation ends there
            (a graceful stop: ``tether eval`` passes its SIGINT / SIGTERM flag), and the result
            covers the finished problems only (``stopped=True``).
        on_rows: called after every chunk with that chunk's finished rows (``tether eval``
            appends them to its output file, so a killed evaluation keeps them).

    Returns:
        :class:`EvalResult`; the model's train/eval mode is restored. The agent's own
        counters (``agent.metrics()``), if any, are added to ``metrics`` as ``agent/<name>``.
    """
    from tqdm.auto import tqdm

    from ..agents import make_agent
    from ..config import RolloutConfig
    from ..rollout import SamplingParams, make_engine
    from ..tasks.prompts import encode_prompts
    from ..tasks.rewards import call_reward, load_reward

    t_start = time.perf_counter()
    n, temperature = _check_sampling(n, temperature, top_p, greedy)
    greedy = greedy or temperature == 0
    ks = _check_ks(ks, n)
    if int(max_new_tokens) < 1:
        raise EvalError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if int(batch_size) < 1:
        raise EvalError(f"batch_size must be >= 1, got {batch_size}")
    examples = list(examples)
    if not examples:
        raise EvalError("no examples to evaluate")
    if isinstance(reward_fn, str):
        reward_fn = load_reward(reward_fn)
    settings = dict(n=n, temperature=temperature, top_p=float(top_p), top_k=int(top_k),
                    max_new_tokens=int(max_new_tokens), greedy=bool(greedy), batch_size=int(batch_size),
                    system_prompt=system_prompt, seed=int(seed), ks=ks, stop=list(stop or []), agent=agent,
                    engine=engine)

    eng = make_engine(RolloutConfig(engine=engine, batch_size=int(batch_size)), model, tokenizer,
                      show_progress=False)
    runner = make_agent(agent, eng, tokenizer, system_prompt=system_prompt, **dict(agent_options or {}))
    # batching order only (longest chat-encoded prompt first); the agent encodes what it generates from.
    # Through the agent's PromptEncoder when it has one: a prompt too long for the model fails here, before generating.
    prompts = getattr(runner, "prompts", None)
    encoded = prompts.encode(examples, int(max_new_tokens)) if prompts is not None else \
        encode_prompts(tokenizer, examples, system_prompt)
    prompt_len = [len(p) for p in encoded]
    per_chunk = max(1, int(batch_size) // n)
    order = sorted(range(len(examples)), key=lambda i: -prompt_len[i])
    chunks = [order[i:i + per_chunk] for i in range(0, len(order), per_chunk)]

    rows: list[Optional[dict]] = [None] * len(examples)
    gen_time, gen_tokens, errors, first_error = 0.0, 0, 0, None
    n_done_correct, n_done = 0, 0
    bar = tqdm(total=len(examples), desc=desc, unit="problem", disable=not show_progress, dynamic_ncols=True)
    stopped = False
    try:
        for j, chunk in enumerate(chunks):
            if should_stop is not None and should_stop():
                stopped = True
                break
            params = SamplingParams(n=n, temperature=temperature, top_p=float(top_p), top_k=int(top_k),
                                    max_new_tokens=int(max_new_tokens), stop=list(stop or []),
                                    seed=(int(seed) * 1_000_003 + j) % (2**31), greedy=bool(greedy))
            rb = runner.rollout([examples[i] for i in chunk], params)
            gen_time += rb.gen_time_s
            gen_tokens += rb.num_response_tokens
            lengths = rb.response_lengths.tolist()
            for g, i in enumerate(chunk):
                ex = examples[i]
                lo, hi = g * n, (g + 1) * n
                texts = rb.texts[lo:hi]
                preds, correct, rewards = [], [], []
                for text in texts:
                    res, err = call_reward(reward_fn, text, ex)
                    if err is not None:
                        errors += 1
                        first_error = first_error or err
                    preds.append(res.pred)
                    correct.append(bool(res.correct))
                    rewards.append(float(res.reward))
                maj = majority_vote(preds, correct=correct)
                rows[i] = {
                    "id": ex.id, "prompt": ex.prompt, "answer": ex.answer, "responses": list(texts),
                    "preds": preds, "correct": correct, "rewards": rewards,
                    "lengths": [int(x) for x in lengths[lo:hi]], "finish_reasons": list(rb.finish_reason[lo:hi]),
                    "n_correct": int(sum(correct)), "maj_answer": maj.answer, "maj_correct": maj.correct,
                }
                if rb.info is not None:  # the agent's record of each episode (e.g. searches, passages shown)
                    rows[i]["info"] = list(rb.info[lo:hi])
                n_done_correct += sum(correct)
                n_done += n
            if on_rows is not None:
                on_rows([rows[i] for i in chunk])
            bar.update(len(chunk))
            bar.set_postfix({f"avg@{n}": f"{n_done_correct / max(n_done, 1):.3f}"})
    finally:
        bar.close()

    if stopped:
        rows = [r for r in rows if r is not None]
    metrics = summarize(rows, n, ks)
    metrics["reward_errors"] = errors
    metrics["gen_tokens"] = gen_tokens
    metrics["gen_time_s"] = gen_time
    metrics["wall_time_s"] = time.perf_counter() - t_start
    metrics["tokens_per_s"] = gen_tokens / max(gen_time, 1e-9)
    for k, v in runner.metrics().items():
        metrics[f"agent/{k}"] = float(v)
    return EvalResult(metrics=metrics, per_problem=rows, settings=settings, first_reward_error=first_error,
                      stopped=stopped, n_total=len(examples))


@dataclass
class EvalSettings:
    """Generation settings for :func:`evaluate_during_training` (defaults: greedy, one sample)."""

    n: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 512
    greedy: bool = True
    batch_size: int = 64
    system_prompt: str = ""
    seed: int = 0
    ks: Optional[list] = None
    stop: list = field(default_factory=list)
    agent: str = "single_turn"  # a name in tether.agents.AGENTS
    engine: str = "hf"  # a name in tether.rollout.ENGINES


def evaluate_during_training(
    model,
    tokenizer,
    examples_by_bench: Mapping[str, Sequence[Example]],
    reward_fns: Mapping[str, RewardFn | str] | RewardFn | str,
    settings: EvalSettings | Mapping[str, Any] | None = None,
) -> dict[str, float]:
    """Evaluate the current policy on several benchmarks; return flat metrics for metrics.jsonl.

    A thin wrapper over :func:`evaluate` (no progress bar): for every benchmark ``b`` and
    every numeric metric ``m`` of its :class:`EvalResult` the result holds
    ``"eval/<b>/<m>"`` (e.g. ``eval/gsm8k/avg@1``, ``eval/gsm8k/pass@4``,
    ``eval/gsm8k/maj@4``, ``eval/gsm8k/mean_response_tokens``). Sampling runs in a forked
    RNG seeded by ``settings.seed``, so calling this does not change the training RNG
    stream; the model's train/eval mode is restored.

    Args:
        examples_by_bench: benchmark name -> examples (e.g. from
            :func:`tether.tasks.benchmarks.load_benchmark`).
        reward_fns: benchmark name -> reward function (or reward spec), or one reward for all.
        settings: an :class:`EvalSettings`, or a mapping of its fields (unknown keys are an
            error). Default: greedy, n = 1, 512 new tokens.
    """
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
    greedy = bool(s.greedy) or s.temperature == 0
    out: dict[str, float] = {}
    for bench, examples in examples_by_bench.items():
        if isinstance(reward_fns, Mapping):
            if bench not in reward_fns:
                raise EvalError(f"no reward function given for benchmark {bench!r}")
            fn = reward_fns[bench]
        else:
            fn = reward_fns
        res = evaluate(model, tokenizer, examples, fn, n=s.n, temperature=0.0 if greedy else s.temperature,
                       top_p=s.top_p, top_k=s.top_k, max_new_tokens=s.max_new_tokens, greedy=greedy,
                       batch_size=s.batch_size, system_prompt=s.system_prompt, seed=s.seed,
                       show_progress=False, ks=s.ks, stop=s.stop, agent=s.agent, engine=s.engine)
        for k, v in res.metrics.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[f"eval/{bench}/{k}"] = float(v)
    return out
