"""Faults of a probe (issue #37) in a user's environment (``env.name=FILE.py:Class``, ``rollout.agent=multi_turn``)
through the real CLI: an ``act`` that returns a string, an observation that is an int, a ``Start.prompt`` that is an
int, a NaN reward part, a ``start`` that raises, a ``step`` that returns fewer results than actions (it hung the
trainer) or never ends an episode.

Each is one ``tether: error:`` line naming the environment's class, the method, the example and what was wrong,
exit code 2; a fresh run it stops before its first step leaves no run directory, and one it stops later keeps its
checkpoints (as any error does)."""

from __future__ import annotations

import json
import subprocess

import pytest

from helpers import DIGITS, assert_clean_error, cli_args, run_module
from tether.cli import main

pytestmark = pytest.mark.faults

BAD_ENVS = '''
from tether.envs import FinalTurn, Start, StepResult, TextEnv


class Fine(TextEnv):
    name, stop, max_turns, final_turn = "fine", (".",), 2, FinalTurn()

    def start(self, example):
        return Start(prompt=example.prompt)

    def act(self, episode, action):
        return StepResult(observation=" ok.", reward=1.0)


class StrAct(Fine):
    def act(self, episode, action):
        return "ok"


class IntObservation(Fine):
    def act(self, episode, action):
        return StepResult(observation=5)


class IntPrompt(Fine):
    def start(self, example):
        return Start(prompt=5)


class NanReward(Fine):
    def act(self, episode, action):
        return StepResult(observation=" ok.", reward=float("nan"))


class RaisesInStart(Fine):
    def start(self, example):
        return {}["no_such_key"]


class DropsTheLast(Fine):
    """Overrides step, without TextEnv's checks: a result for every action but the last, never done."""
    def step(self, actions):
        return [StepResult(observation=" ok.") for _ in actions[:-1]]


class NeverDone(Fine):
    """Overrides step: an observation for every action, never done, whatever max_turns says."""
    def step(self, actions):
        return [StepResult(observation=" ok.") for _ in actions]


class FailsAtStep2(Fine):
    """Fine for the first step's 4 episodes of 2 turns; its 9th act returns a string."""
    def act(self, episode, action):
        self.calls = getattr(self, "calls", 0) + 1
        return "late" if self.calls > 8 else StepResult(observation=" ok.", reward=1.0)
'''

#: class -> (method named, what the error says)
CASES = {
    "StrAct": ("StrAct.act", "returned a str ('ok'), not a StepResult"),
    "IntObservation": ("IntObservation.act", "the observation is an int (5), not text or None"),
    "IntPrompt": ("IntPrompt.start", "Start.prompt is an int (5), not text"),
    "NanReward": ("NanReward.act", "a non-finite reward part nan"),
    "RaisesInStart": ("RaisesInStart.start", "raised KeyError: 'no_such_key' (at envs.py:"),
    "NeverDone": ("NeverDone.step", "kept 4 episode(s) going after 2 turns, its max_turns"),
}


@pytest.fixture(scope="module")
def work(make_workdir):
    d = make_workdir("faults_envs", DIGITS, n_rows=8)
    (d / "envs.py").write_text(BAD_ENVS)
    return d


def env_args(work, model, out, env: str, steps: int = 1, **over) -> list[str]:
    """`tether train` of the tiny model with the multi-turn agent in environment ``env`` of work/envs.py."""
    return cli_args(work, model, out, steps, **{"rollout.agent": "multi_turn",
                                                "rollout.agent.env.name": f"{work / 'envs.py'}:{env}",
                                                "rollout.max_new_tokens": 6, "rollout.prompts_per_step": 2,
                                                "rollout.n": 2, "eval.before": False, "eval.after": False, **over})


@pytest.mark.parametrize("env", list(CASES))
def test_a_broken_environment_is_one_error_line_and_leaves_no_run(env, work, tiny_model_dir, tmp_path, capsys):
    """Each was a raw traceback (AttributeError in envs/base.py, a tokenizer ValueError, a TypeError, tether's own
    uncaught "non-finite reward part", the user's KeyError) or, for NeverDone, a run that generated past the
    model's context; the first four left a half-made run directory (marker, config, empty logs, no checkpoint)."""
    method, what = CASES[env]
    run = tmp_path / "run"
    rc = main(env_args(work, tiny_model_dir, run, env))
    err = capsys.readouterr().err
    error = assert_clean_error(rc, err, f"environment {method} on example", what, line_only=True)
    assert "'prompts:" in error  # the example's id (prompts.jsonl's rows are prompts:N)
    assert not run.exists()


def test_a_step_with_fewer_results_than_actions_is_an_error_not_a_hang(work, tiny_model_dir, tmp_path):
    """The agent zipped the results with the episodes, so the last episode was never answered nor ended, and the
    `itertools.count()` loop went on forever, past the model's context (and a SIGTERM waited for the step).
    The subprocess's own time limit fails the test if it hangs again."""
    run = tmp_path / "run"
    try:
        r = run_module(*env_args(work, tiny_model_dir, run, "DropsTheLast"), timeout=150)
    except subprocess.TimeoutExpired:
        pytest.fail("tether train hung on an environment whose step returns fewer results than actions")
    assert_clean_error(r.returncode, r.stderr, "environment DropsTheLast.step on examples",
                       "returned 3 results for 4 actions", line_only=True)
    assert not run.exists()


def test_eval_with_a_broken_environment_is_one_error_line(work, tiny_model_dir, tmp_path, capsys):
    """`tether eval --agent multi_turn --env` did the same: a traceback."""
    for env, (method, what) in [("StrAct", CASES["StrAct"]), ("RaisesInStart", CASES["RaisesInStart"])]:
        out = tmp_path / f"ev_{env}"
        rc = main(["eval", "--model", str(tiny_model_dir), "--benchmarks", str(work / "prompts.jsonl"),
                   "--prompt-key", "question", "--answer-key", "answer", "--reward", f"{work / 'rew.py'}:digits",
                   "--agent", "multi_turn", "--env", f"{work / 'envs.py'}:{env}", "--max-new-tokens", "4",
                   "--no-progress", "--out", str(out)])
        assert_clean_error(rc, capsys.readouterr().err, f"environment {method} on example", what, line_only=True)
        assert not out.exists()


def test_a_later_failure_keeps_the_run_and_its_checkpoint(work, tiny_model_dir, tmp_path, capsys):
    """An environment that breaks at step 2, after step 1 was checkpointed: the same one line, and the run stays
    (its checkpoint and metrics row), as after any other error."""
    run = tmp_path / "run"
    rc = main(env_args(work, tiny_model_dir, run, "FailsAtStep2", steps=3, **{"run.save_every": 1}))
    assert_clean_error(rc, capsys.readouterr().err, "environment FailsAtStep2.act on example",
                       "returned a str ('late')", line_only=True)
    assert [json.loads(ln)["step"] for ln in (run / "metrics.jsonl").read_text().splitlines()] == [1]
    assert [p.name for p in (run / "checkpoints").glob("step-*")] == ["step-000001"]
    assert not (run / ".lock").exists()
