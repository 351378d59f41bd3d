"""The text environment interface: ``reset(example) -> Start``, ``step(actions) -> list[StepResult]``.

An environment speaks text, never tokens: an agent (``tether.agents.MultiTurnAgent``) encodes what the
environment says, samples the policy's turns, and hands the turns' texts back. One environment
object runs one *batch* of episodes at a time, so a tool can serve a whole turn at once:

    env = ENVS["calculator"](max_turns=4)
    starts = [env.reset(ex) for ex in examples]      # one episode per reset, in order
    while env.active():                               # indices of the episodes still running
        stop = env.stop_strings()                     # the next turn's stop strings
        texts = policy(..., stop)                     # one turn per active episode
        results = env.step(texts)                     # one StepResult per active episode, same order

A ``reset`` while no episode is active begins a new batch (episode indices start again at 0);
a ``reset`` while some are active adds an episode to the running batch (an agent opens a batch's
episodes before its first step: the stop strings of a turn are those of the first active episode).
An episode leaves the batch when a step returns ``done`` for it, or when the agent ends it
(``end(i)``, e.g. its context is full). Every episode of a batch takes its turns together.

:class:`TextEnv` keeps that bookkeeping, the turn budget and the final-turn rule; an environment
subclasses it and writes :meth:`TextEnv.start` and :meth:`TextEnv.act` (or :meth:`TextEnv.act_batch`
to serve a turn's actions together). docs/environments.md shows one in about 30 lines.

What an environment's code returns is checked where it comes back (:func:`check_start`,
:func:`check_result`, :func:`call_env`; :class:`TextEnv` for ``start`` / ``act``, the agent for any
environment's ``reset`` / ``step``): a method that raises, or returns what an agent cannot use, is an
:class:`~tether.errors.EnvError` naming the environment's class, the method, the example and what was
wrong (and the line of the environment's file that raised), one ``tether: error:`` line on the command line.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Protocol, Sequence, Union, runtime_checkable

from ..errors import EnvError
from ..tasks.base import Example

__all__ = ["Prompt", "Start", "StepResult", "FinalTurn", "Episode", "Env", "TextEnv", "call_env", "check_count",
           "check_result", "check_start", "env_error"]

#: The first prompt of an episode: plain text (the agent puts it through the chat template as the
#: user message) or a list of chat messages (``{"role": ..., "content": ...}``, system message included).
Prompt = Union[str, list]


@dataclass
class Start:
    """What ``reset`` returns: how an episode opens.

    Attributes:
        prompt: the first prompt (:data:`Prompt`): text, or chat messages.
        info: anything the environment reports about the episode (never shown to the model; the agent
            keeps it in the episode's ``RolloutBatch.info`` under ``start``).
    """

    prompt: Prompt
    info: dict = field(default_factory=dict)


@dataclass
class StepResult:
    """What ``step`` returns for one episode's turn.

    Attributes:
        observation: text the environment appends after the policy's turn (tokens the policy did
            not sample: the agent masks them out of the loss); None for nothing. A done result never
            has one (:class:`TextEnv` drops it: nothing reads it after the episode).
        reward: this turn's reward part (0.0 for none); an episode's parts are added to the reward
            that scores its whole text (:attr:`TextEnv.reward`).
        done: whether the episode ended with this turn.
        truncated: set by :class:`TextEnv`, not by ``act``: the episode ended because its budget ran out
            (its last turn, or one the agent cut with ``cut``) and not on its own terms (an answer).
            Gymnasium's terminated/truncated distinction: an agent reports a truncated episode's finish
            reason as that of its last turn (``"length"`` when its context ran out).
        info: what happened in the turn, for metrics and logs. Two keys are read by the agent
            (``tether.agents.MultiTurnAgent``) and summed per episode: ``"tool_calls"`` (tool calls run in
            the turn, an int) and ``"invalid"`` (True when the turn held no valid action); anything
            else is the environment's own (the call, its error, the answer).
    """

    observation: Optional[str] = None
    reward: float = 0.0
    done: bool = False
    info: dict = field(default_factory=dict)
    truncated: bool = False


@dataclass(frozen=True)
class FinalTurn:
    """The final-turn rule: what happens at an episode's last turn (the turn budget's last one).

    That turn's text ends the episode whatever it holds: no tool runs on it (:class:`TextEnv` marks
    its result done, and the environment's ``act`` sees ``episode.final``).

    Attributes:
        stop: the stop strings of the last turn (in place of :attr:`TextEnv.stop`; usually none of
            the tool's, so the model writes on to its answer instead of stopping at a call that
            would not run).
        note: text added to the observation just before the last turn ("" for none), telling the
            model that no tool call is left.
    """

    stop: tuple[str, ...] = ()
    note: str = ""


@dataclass
class Episode:
    """One episode's state, kept by :class:`TextEnv` and handed to ``act``.

    Attributes:
        index: its place in the batch (the order of the ``reset`` calls since the batch began).
        example: the example it runs on.
        max_turns: its turn budget.
        turns: policy turns taken; inside ``act`` it counts the turn being acted on (1 = the first).
        done: whether it has ended.
        state: the environment's own per-episode state (anything; empty at the start).
    """

    index: int
    example: Example
    max_turns: int
    turns: int = 0
    done: bool = False
    state: dict = field(default_factory=dict)

    @property
    def final(self) -> bool:
        """Whether the turn being acted on is the last of the budget (inside ``act``)."""
        return self.turns >= self.max_turns


@runtime_checkable
class Env(Protocol):
    """What an agent needs of an environment (see the module docstring for the batch protocol)."""

    name: str
    stop: tuple[str, ...]
    max_turns: int
    final_turn: FinalTurn
    reward: Optional[str]

    def reset(self, example: Example) -> Start: ...

    def step(self, actions: Sequence[str]) -> list[StepResult]: ...

    def active(self) -> list[int]: ...

    def stop_strings(self) -> list[str]: ...

    def end(self, index: int) -> None: ...

    def cut(self, index: int) -> None: ...

    def finish(self, index: int, text: str) -> dict: ...

    def metrics(self) -> dict[str, float]: ...


# ------------------------------------------------------------ checking what an environment's code returns


def _examples(examples) -> str:
    ids = list(dict.fromkeys(getattr(ex, "id", ex) for ex in (examples if isinstance(examples, (list, tuple))
                                                              else [examples])))  # an example's n episodes: once
    if len(ids) == 1:
        return f"example {ids[0]!r}"
    return f"examples {', '.join(map(repr, ids[:3]))}" + (f" (+{len(ids) - 3} more)" if len(ids) > 3 else "")


def env_error(env, method: str, examples, what: str) -> EnvError:
    """The error for environment ``env``'s ``method`` on ``examples`` (an Example or id, or a list): ``what``
    was wrong."""
    return EnvError(f"environment {type(env).__name__}.{method} on {_examples(examples)}: {what}")


def _where(env, e: BaseException) -> str:
    """Where ``e`` was raised, as `` (at FILE:LINE)``: the deepest frame in the environment's own source file,
    else the deepest frame of all."""
    frames = traceback.extract_tb(e.__traceback__)
    try:
        own = str(Path(inspect.getsourcefile(type(env)) or "").resolve())
    except TypeError:  # a class without a source file
        own = ""
    mine = [f for f in frames if own and str(Path(f.filename).resolve()) == own] or frames
    return f" (at {Path(mine[-1].filename).name}:{mine[-1].lineno})" if mine else ""


def call_env(env, method: str, examples, fn: Callable[..., Any], *args):
    """``fn(*args)``: a call into environment ``env``'s code (its ``method``, on ``examples``); an exception it
    raises becomes an `EnvError` naming them, the exception and its line (chained: ``__cause__`` holds it)."""
    try:
        return fn(*args)
    except EnvError:
        raise
    except Exception as e:
        raise env_error(env, method, examples, f"raised {type(e).__name__}: {e}{_where(env, e)}") from e


def _a(v) -> str:
    """The type of ``v`` with its article: "an int", "a str"."""
    name = type(v).__name__
    return ("an " if name[:1].lower() in "aeiou" else "a ") + name


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def check_count(env, method: str, examples: list, results) -> None:
    """A turn's results as environment ``env``'s ``method`` returned them: a list of one per action (one per
    example of ``examples``, the active episodes'); else an `EnvError`."""
    if isinstance(results, (list, tuple)) and len(results) == len(examples):
        return
    n = len(results) if isinstance(results, (list, tuple)) else None
    got = _a(results) if n is None else f"{n} result" + ("" if n == 1 else "s")
    raise env_error(env, method, examples, f"returned {got} for {len(examples)} actions (one StepResult per action, "
                                           f"in order)")


def check_start(env, method: str, example, start) -> Start:
    """``start`` as environment ``env``'s ``method`` (``reset`` / ``start``) returned it for ``example``: a
    :class:`Start` whose prompt is text or a list of chat messages (``{"role", "content"}``); else an `EnvError`."""
    if not isinstance(start, Start):
        raise env_error(env, method, example, f"returned {_a(start)} ({_short(start)}), not a Start")
    p = start.prompt
    if isinstance(p, list):
        bad = next((m for m in p if not (isinstance(m, dict) and "role" in m and "content" in m)), None)
        if not p or bad is not None:
            what = "an empty list" if not p else f"a list holding {_short(bad)}"
            raise env_error(env, method, example, f"Start.prompt is {what}; a prompt is text or a non-empty list "
                                                  f"of chat messages {{\"role\": ..., \"content\": ...}}")
    elif not isinstance(p, str):
        raise env_error(env, method, example, f"Start.prompt is {_a(p)} ({_short(p)}), not text or a list of "
                                              f"chat messages")
    if not isinstance(start.info, dict):
        raise env_error(env, method, example, f"Start.info is {_a(start.info)}, not a dict")
    return start


def check_result(env, method: str, example, r) -> StepResult:
    """One result of environment ``env``'s ``method`` (``act`` / ``act_batch`` / ``step``) for ``example``: a
    :class:`StepResult` with an observation that is text or None, a finite reward part and an info dict, returned
    as a copy with its reward a float and its own info dict; anything else is an `EnvError`."""
    if not isinstance(r, StepResult):
        raise env_error(env, method, example, f"returned {_a(r)} ({_short(r)}), not a StepResult")
    if r.observation is not None and not isinstance(r.observation, str):
        raise env_error(env, method, example, f"the observation is {_a(r.observation)} ({_short(r.observation)}), "
                                              f"not text or None")
    try:
        reward = float(r.reward)
    except (TypeError, ValueError, OverflowError):
        raise env_error(env, method, example, f"the reward part is {_a(r.reward)} ({_short(r.reward)}), not a "
                                              f"number") from None
    if not math.isfinite(reward):
        raise env_error(env, method, example, f"a non-finite reward part {reward}")
    if not isinstance(r.info, dict):
        raise env_error(env, method, example, f"StepResult.info is {_a(r.info)}, not a dict")
    return dataclasses.replace(r, reward=reward, info=dict(r.info))


class TextEnv:
    """Base class of a text environment: a batch of episodes, a turn budget, a final-turn rule.

    A subclass sets the class attributes below and writes :meth:`start` and :meth:`act`.

    Attributes:
        name: the environment's name (in errors and logs).
        stop: the stop strings of a turn that may call the tool (generation stops right after one,
            so the environment can answer the call).
        max_turns: the turn budget: policy turns per episode, the last one under :attr:`final_turn`.
        final_turn: the final-turn rule (:class:`FinalTurn`).
        reward: the reward that scores an episode's whole text: a ``tether.tasks.rewards.REWARDS``
            name or a user's ``module:function``; None keeps the task's reward (``data.reward``).
            The steps' reward parts are added to it.
        observation_tail: text an observation must end with even when the agent cuts it to its
            token budget (e.g. the closing tag ``</information>``); "" = none.

    Args:
        max_turns: the turn budget (default: the class's); at least 1.
        reward: the reward spec (default: the class's; None = the task's).
    """

    name: str = "env"
    stop: tuple[str, ...] = ()
    max_turns: int = 1
    final_turn: FinalTurn = FinalTurn()
    reward: Optional[str] = None
    observation_tail: str = ""

    def __init__(self, *, max_turns: Optional[int] = None, reward: Optional[str] = None):
        if max_turns is not None:
            self.max_turns = max_turns
        if isinstance(self.max_turns, bool) or not isinstance(self.max_turns, int) or self.max_turns < 1:
            raise ValueError(f"{self.name} environment: max_turns must be an integer >= 1, got {self.max_turns!r}")
        if reward is not None:
            self.reward = reward
        self.episodes: list[Episode] = []

    # ------------------------------------------------------------ what a subclass writes

    def start(self, example: Example) -> Start:
        """The opening of an episode on ``example`` (its prompt). A subclass writes it."""
        raise NotImplementedError(f"{type(self).__name__} must define start(example)")

    def act(self, episode: Episode, action: str) -> StepResult:
        """The environment's answer to one turn's text ``action`` of ``episode`` (``episode.final``:
        whether it is the last turn). A subclass writes it, or :meth:`act_batch`."""
        raise NotImplementedError(f"{type(self).__name__} must define act(episode, action) or act_batch")

    def act_batch(self, episodes: Sequence[Episode], actions: Sequence[str]) -> list[StepResult]:
        """The answers to a turn's actions of every active episode, in order (default: :meth:`act`
        on each). Override it to serve them together (one batched tool call)."""
        return [call_env(self, "act", e.example, self.act, e, a) for e, a in zip(episodes, actions)]

    def finish(self, index: int, text: str) -> dict:
        """What the environment records of finished episode ``index`` whose whole response text is
        ``text``: :meth:`episode_info` of it (the agent calls it once per episode, after the last step)."""
        return self.episode_info(self.episodes[index], text)

    def episode_info(self, episode: Episode, text: str) -> dict:
        """What the environment records of a finished ``episode`` whose whole response text is ``text``
        (the agent puts it in ``RolloutBatch.info``; default: nothing). An environment that keeps
        counters for :meth:`metrics` can update them here."""
        return {}

    def metrics(self) -> dict[str, float]:
        """The environment's own counters since the last call, then reset (default: none). The agent
        adds the generic ones (turns, tool calls, invalid actions, observation tokens, seconds)."""
        return {}

    # ------------------------------------------------------------ the interface

    def reset(self, example: Example) -> Start:
        """Open an episode on ``example``: its first prompt and info. With no episode active, it
        begins a new batch; otherwise it adds one to the running batch (its index: ``len`` so far)."""
        if not self.active():
            self.episodes = []
        ep = Episode(index=len(self.episodes), example=example, max_turns=self.max_turns)
        start = check_start(self, "start", example, call_env(self, "start", example, self.start, example))
        self.episodes.append(ep)
        return start

    def active(self) -> list[int]:
        """Indices of the episodes still running, in order (the ones the next ``step`` takes actions for)."""
        return [e.index for e in self.episodes if not e.done]

    def stop_strings(self) -> list[str]:
        """The stop strings of the active episodes' next turn: :attr:`stop`, or the final-turn rule's
        at the budget's last turn (with none active: a new batch's first turn's)."""
        live = [e for e in self.episodes if not e.done]
        last = live[0].turns + 1 >= live[0].max_turns if live else self.max_turns <= 1
        return list(self.final_turn.stop if last else self.stop)

    def step(self, actions: Sequence[str]) -> list[StepResult]:
        """One turn: ``actions[i]`` is the text the policy wrote for the ``i``-th active episode;
        returns one :class:`StepResult` per action, in order. The last turn of the budget is done
        whatever the environment says; a done result has no observation; the result just before
        the last turn gets the final-turn rule's note."""
        live = [e for e in self.episodes if not e.done]
        if isinstance(actions, str) or len(actions) != len(live):
            n = "a string" if isinstance(actions, str) else f"{len(actions)} actions"
            raise ValueError(f"{self.name} environment: step takes one action per active episode "
                             f"({len(live)}), got {n}")
        for e in live:
            e.turns += 1
        own = getattr(self.act_batch, "__func__", None) is not TextEnv.act_batch  # a subclass's act_batch
        method = "act_batch" if own else "act"
        results = call_env(self, method, [e.example for e in live], self.act_batch, live, [str(a) for a in actions])
        check_count(self, method, [e.example for e in live], results)
        results = [check_result(self, method, e.example, r) for e, r in zip(live, results)]  # copies
        for e, r in zip(live, results):
            r.truncated = not r.done and e.final
            r.done = bool(r.done) or e.final
            if r.done:
                r.observation = None
            elif e.turns + 1 >= e.max_turns and self.final_turn.note:
                r.observation = (r.observation or "") + self.final_turn.note
            e.done = r.done
        return results

    def end(self, index: int) -> None:
        """End episode ``index`` without a step (the agent stops it, e.g. its context is full)."""
        self.episodes[index].done = True

    def cut(self, index: int) -> None:
        """Make the coming turn of episode ``index`` its last (the agent's budget for it ran out, e.g. its
        context is full): ``act`` sees ``episode.final``, so no tool runs, and the step ends it."""
        ep = self.episodes[index]
        ep.max_turns = min(ep.max_turns, ep.turns + 1)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(max_turns={self.max_turns}, reward={self.reward!r})"

