"""Helpers the test modules share (not a test module; ``from helpers import ...``): the tiny run's base
overrides as a dict, a config or a ``tether train`` command line, its metrics rows, and ``python -m tether``
in a subprocess importing this checkout. The run's directory (``rew.py`` + ``prompts.jsonl``) comes from
the ``make_workdir`` fixture in tests/conftest.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import tether
from tether.resolve import load_config

SRC = str(Path(tether.__file__).resolve().parents[1])
TIMING = ("time", "tokens_per_s", "peak_")  # metric names that differ between two runs of the same computation

#: the reward every tiny run scores with unless told otherwise (the ``digits`` of each test's ``rew.py``)
DIGITS = '''
def digits(completion, example):
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)
'''

#: the tiny run (tests/test_train.py's): 4 prompts x 4 samples of 8 tokens a step, no periodic checkpoint,
#: no progress bar, plot or exact-KL sample
TINY = {"train.lr": 1e-2, "rollout.max_new_tokens": 8, "rollout.prompts_per_step": 4, "rollout.n": 4,
        "run.progress": False, "run.plot": False, "run.exact_kl_samples": 0, "run.save_every": 0}

#: the fault tests' smaller one: 2 prompts x 2 samples of 6 tokens, the EMA anchor moved and a checkpoint
#: written every step
FAULTS = {"rollout.max_new_tokens": 6, "rollout.prompts_per_step": 2, "rollout.n": 2, "algo.anchor.every": 1,
          "run.save_every": 1}


def tiny_settings(workdir: Path, model_dir, steps: int, reward: str = "digits", **over) -> dict:
    """The overrides of a ``steps``-step tiny run on ``model_dir`` with ``workdir``'s prompts.jsonl, scored
    by ``reward`` of its rew.py: TINY, then ``over`` (dotted keys)."""
    return {"model.name": str(model_dir), "data.task": str(workdir / "prompts.jsonl"),
            "data.reward": f"{workdir / 'rew.py'}:{reward}", "train.steps": steps, **TINY, **over}


def tiny_config(workdir: Path, model_dir, recipe: str, steps: int, **over):
    """The Config of ``tiny_settings(workdir, model_dir, steps, **over)`` under ``recipe``."""
    return load_config(None, tiny_settings(workdir, model_dir, steps, **over), recipe_name=recipe)


def cli_args(workdir: Path, model_dir, out, steps: int, recipe: str = "ema_pg", **over) -> list[str]:
    """``tether train`` arguments for the run of ``tiny_config(workdir, model_dir, recipe, steps, **over)``
    written to ``out``."""
    vals = tiny_settings(workdir, model_dir, steps, **over)
    vals.pop("train.steps")
    return ["train", "--recipe", recipe, "--output-dir", str(out), "--steps", str(steps),
            *[f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in vals.items()]]


def rows(run) -> list[dict]:
    """The rows of ``run``'s metrics.jsonl."""
    return [json.loads(ln) for ln in (Path(run) / "metrics.jsonl").read_text().splitlines()]


def strip(m: dict) -> dict:
    """A metrics row without its timing metrics (what two runs of the same computation agree on)."""
    return {k: v for k, v in m.items() if not any(s in k for s in TIMING)}


def copy_run(src, dst):
    shutil.copytree(src, dst)
    return dst


def terminal_sigint() -> None:
    """A ``preexec_fn``: SIGINT handled as in a user's terminal. A test run started in the background by a
    non-interactive shell inherits SIGINT ignored, and tether (rightly) leaves an ignored signal alone, so a test
    that sends SIGINT to a child it started gives the child the default disposition first."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def subprocess_env(**extra) -> dict:
    """This process's environment plus ``extra``, with this checkout's tether first on PYTHONPATH."""
    e = dict(os.environ, **extra)
    e["PYTHONPATH"] = SRC + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    return e


def worker_pid(log: Path, worker: int = 0) -> int:
    """The pid of local rollout worker ``worker`` as the trainer's log last announced it (0 if not yet)."""
    lines = [ln for ln in Path(log).read_text().splitlines() if f"rollout worker {worker} started (pid" in ln]
    return int(lines[-1].split("pid ")[1].rstrip(")")) if lines else 0


def run_module(*args, cwd=None, env=None, timeout: float = 300):
    """``python -m tether ARGS`` in a fresh interpreter importing this checkout (``env``: extra variables)."""
    return subprocess.run([sys.executable, "-m", "tether", *map(str, args)], capture_output=True, text=True,
                          env=subprocess_env(**(env or {})), cwd=cwd, timeout=timeout)


def assert_clean_error(rc: int, stderr: str, *needles: str, line_only: bool = False) -> str:
    """Exit code 2, exactly one ``tether: error:`` line, no traceback; every needle in the error (the error
    line and the problems listed under it; with ``line_only``, in the error line itself)."""
    assert rc == 2, (rc, stderr)
    assert "Traceback" not in stderr, stderr
    lines = stderr.splitlines()
    starts = [i for i, ln in enumerate(lines) if ln.startswith("tether: error:")]
    assert len(starts) == 1, stderr
    error = lines[starts[0]] if line_only else "\n".join(lines[starts[0]:])
    for n in needles:
        assert n in error, (n, error)
    return error


#: the keys that run the search environment (Search-R1's protocol): the multi-turn agent with env.name=search
SEARCH_ENV = {"rollout.agent.kind": "multi_turn", "rollout.agent.env.name": "search"}

#: A user's environment in a file (`env.name=PATH:Always`): every action is answered " ok." with reward 5.
ALWAYS_ENV = (
    "from tether.envs import FinalTurn, Start, StepResult, TextEnv\n\n"
    "class Always(TextEnv):\n"
    "    name, stop, max_turns, final_turn = 'always', ('.',), 2, FinalTurn()\n"
    "    def start(self, example):\n"
    "        return Start(prompt=example.prompt)\n"
    "    def act(self, episode, action):\n"
    "        return StepResult(observation=' ok.', reward=5.0)\n")
