"""SkyRL's text environments (``skyrl-gym``, the optional extra ``tether[skyrl-gym]``) as tether environments:
``rollout.agent.env.name=skyrl_gym:<name>`` (docs/ecosystem.md).

A skyrl-gym environment holds one episode: ``skyrl_gym.make(name, env_config=..., extras=...)`` builds it with the
example's ground truth in ``extras["reward_spec"]``, ``init(prompt_messages) -> (messages, info)`` opens it and
``step(action_text)`` returns ``{"observations": [chat messages], "reward", "done", "metadata"}``.
:class:`SkyRLGymEnv` maps that onto tether's batch interface (`tether.envs.base.TextEnv`): one skyrl-gym
environment per episode, made at ``start``; each turn's reward is the step's reward part (summed into the
episode's reward); its observations (chat messages) become the observation text of one chat turn, so the
environment runs with ``rollout.agent.env.observation_format=chat`` and the role its messages have
(``observation_role``, ``user`` for SkyRL's). The multi-turn agent keeps the policy's ids as sampled and appends
the observation turns' tokens masked, as for every tether environment.

Its text reward is ``none`` (the step rewards are the whole reward; ``data.reward`` adds one if set). Stop
strings come from ``rollout.agent.env.options.stop`` (SkyRL's environments declare none).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

from ..algo.registry import unknown_choice
from ..config.agent import SkyRLGymEnvConfig
from ..errors import ConfigError, optional_import
from ..tasks.base import Example
from .base import Episode, FinalTurn, Start, StepResult, TextEnv

__all__ = ["PREFIX", "SkyRLGymEnv"]

#: ``rollout.agent.env.name`` prefix of a skyrl-gym environment (its section's, tether.config.agent)
PREFIX = SkyRLGymEnvConfig.choice_prefix


class SkyRLGymEnv(TextEnv):
    """A skyrl-gym environment (module docstring).

    Args:
        env_id: its registered name (``gsm8k``, ``gsm8k_multi_turn``, ``text2sql``, ...).
        env_config: its ``env_config`` (the environment's settings).
        extras: its ``extras`` besides the per-example ones (``reward_spec.ground_truth``: the example's answer;
            ``extra_info``: ``example.meta["extra_info"]``); ``example.meta["extras"]`` adds to them.
        stop: the stop strings of a turn.
        max_turns: tether's turn budget (the environment ends episodes itself with ``done``; at the budget's last
            turn tether ends it).
        role: the role every observation message must have (``rollout.agent.env.observation_role``).
        reward: the text reward (default ``none``: the step rewards are the whole reward).
    """

    name = "skyrl_gym"
    max_turns = 8

    def __init__(self, env_id: str, *, env_config: Optional[dict] = None, extras: Optional[dict] = None,
                 stop: Sequence[str] = (), max_turns: Optional[int] = None, role: str = "user",
                 reward: Optional[str] = "none"):
        gym = optional_import("skyrl_gym", "skyrl-gym environments", "skyrl-gym")  # an optional extra
        known = list(gym.registry)
        if env_id not in known:
            raise ConfigError(unknown_choice("skyrl-gym environment", env_id, known))
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise ConfigError(f"skyrl_gym:{env_id}: rollout.agent.env.options.stop must be a list of non-empty "
                              f"strings, got {stop!r}")
        for key, value in (("env_config", env_config), ("extras", extras)):
            if value is not None and not isinstance(value, dict):
                raise ConfigError(f"skyrl_gym:{env_id}: rollout.agent.env.options.{key} must be a mapping, got "
                                  f"{value!r}")
        super().__init__(max_turns=max_turns, reward=reward)
        self.env_id, self.env_config, self.extras, self.role = env_id, dict(env_config or {}), dict(extras or {}), role
        self.stop = tuple(stop)
        self.final_turn = FinalTurn(stop=self.stop)
        self._gym = gym
        self._counters: dict[str, float] = {}

    def start(self, example: Example) -> Start:
        """A new skyrl-gym environment for ``example`` and its ``init`` on the example's prompt as a user message
        (or ``example.meta["messages"]``)."""
        extras = {**self.extras, "reward_spec": {"method": "rule", "ground_truth": example.answer},
                  "extra_info": dict(example.meta.get("extra_info") or {}), **dict(example.meta.get("extras") or {})}
        env = self._gym.make(self.env_id, env_config=self.env_config, extras=extras)
        messages = example.meta.get("messages") or [{"role": "user", "content": example.prompt}]
        out = env.init(messages)
        if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], list)):
            raise TypeError(f"init returned {type(out).__name__}, not (messages, info)")
        prompt, info = out
        self._pending = env  # the episode TextEnv.reset appends next takes it (act reads episode.state)
        return Start(prompt=list(prompt), info=dict(info or {}))

    def reset(self, example: Example) -> Start:
        start = super().reset(example)
        self.episodes[-1].state["env"] = self._pending
        return start

    def act(self, episode: Episode, action: str) -> StepResult:
        """One ``step`` of the episode's skyrl-gym environment: its reward part, done, and its observation messages
        as the text of one observation turn."""
        out = episode.state["env"].step(action)
        if not isinstance(out, dict) or not {"observations", "reward", "done"} <= set(out):
            raise TypeError(f"step returned {type(out).__name__} {str(out)[:80]!r}, not a dict with observations, "
                            f"reward and done")
        msgs = out["observations"] or []
        if not isinstance(msgs, list) or any(not isinstance(m, dict) or "content" not in m for m in msgs):
            raise TypeError(f"step's observations are {str(msgs)[:80]!r}, not a list of chat messages")
        roles = {m.get("role") for m in msgs}
        if msgs and roles != {self.role}:
            raise TypeError(f"step's observations have role(s) {sorted(map(str, roles))}; this run shows observations "
                            f"as {self.role!r} turns (set rollout.agent.env.observation_role to theirs)")
        reward = float(out["reward"] or 0.0)
        if not math.isfinite(reward):
            raise TypeError(f"step returned a non-finite reward {reward}")
        self._counters["reward"] = self._counters.get("reward", 0.0) + reward
        self._counters["steps"] = self._counters.get("steps", 0.0) + 1
        text = "\n".join(str(m["content"]) for m in msgs)
        done = bool(out["done"])
        return StepResult(observation=None if done or not msgs else text, reward=reward, done=done,
                          info={"metadata": dict(out.get("metadata") or {})})

    def episode_info(self, episode: Episode, text: str) -> dict:
        env = episode.state.pop("env", None)
        if env is not None:
            env.close()
        return {}

    def metrics(self) -> dict[str, float]:
        """The mean step reward since the last call (``skyrl_gym/step_reward``)."""
        c, self._counters = self._counters, {}
        return {"step_reward": c["reward"] / c["steps"]} if c.get("steps") else {}
