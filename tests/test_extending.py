"""docs/extending.md runs: its user module (a task and a reward) and its command go through the real CLI
(``python -m tether train`` in a fresh interpreter) on the tiny random model, so the page cannot rot."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from helpers import run_module

DOC = Path(__file__).resolve().parents[1] / "docs" / "extending.md"

#: the tiny run's settings, appended to the page's command (model, sizes, no plot or progress bar)
TINY = ["rollout.max_new_tokens=8", "rollout.prompts_per_step=2", "rollout.n=2", "train.lr=1e-2", "data.limit=4",
        "run.progress=false", "run.plot=false", "run.exact_kl_samples=0", "run.save_every=0"]


def blocks(lang: str) -> list[str]:
    """The page's fenced code blocks in ``lang``, in order."""
    return re.findall(rf"^```{lang}\n(.*?)^```", DOC.read_text(), flags=re.MULTILINE | re.DOTALL)


@pytest.fixture()
def user_dir(tmp_path):
    """A working directory holding the page's user module, my_ext.py."""
    (tmp_path / "my_ext.py").write_text(blocks("python")[0])
    return tmp_path


def page_command() -> list[str]:
    """The page's ``python -m tether train ...`` command, without ``python -m tether``."""
    cmd = shlex.split(blocks("bash")[0].strip())
    assert cmd[:3] == ["python", "-m", "tether"] and cmd[3] == "train", cmd
    return cmd[3:]


def test_the_pages_task_and_reward_train_through_the_cli(user_dir, tiny_model_dir):
    out = user_dir / "run"
    r = run_module(*page_command(), "--model", tiny_model_dir, "--output-dir", out, *TINY, cwd=user_dir, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in rows if m.get("step", 0) >= 1]
    assert [m["step"] for m in steps] == [1, 2, 3] and steps[-1]["reward_errors"] == 0, steps
    cfg = (out / "config.yaml").read_text()
    assert "my_ext:countdown" in cfg


def test_the_pages_module_as_a_file_spec_and_its_reward_named(user_dir, tiny_model_dir, tmp_path_factory):
    """data.task=path/to/my_ext.py:countdown needs no PYTHONPATH; data.reward names the reward directly."""
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    out = elsewhere / "run"
    r = run_module("train", "--steps", "1", f"data.task={user_dir / 'my_ext.py'}:countdown",
                   f"data.reward={user_dir / 'my_ext.py'}:counted_down", "--model", tiny_model_dir,
                   "--output-dir", out, *TINY, cwd=elsewhere, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


def test_a_spec_that_does_not_load_is_one_error_line(user_dir, tiny_model_dir):
    r = run_module("train", "--steps", "1", "data.task=my_ext:no_such_task", "--model", tiny_model_dir,
                   "--output-dir", user_dir / "run", *TINY, cwd=user_dir, timeout=600)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "tether: error:" in r.stderr and "no_such_task" in r.stderr


def test_the_user_module_is_importable_python():
    src = blocks("python")[0]
    compile(src, "my_ext.py", "exec")
    ns: dict = {}
    exec(src, ns)
    from tether.config.data import OtherDataConfig

    ex = ns["countdown"](OtherDataConfig(task="my_ext:countdown", limit=2))  # given its data section
    assert [e.answer for e in ex] == ["3, 2, 1, 0", "4, 3, 2, 1, 0"]
    assert ns["counted_down"]("3, 2, 1, 0", ex[0]) == 1.0 and ns["counted_down"]("", ex[0]) == 0.0


def test_a_user_agent_by_spec_gets_the_default_options(tmp_path, monkeypatch):
    """rollout.agent=module:name builds the user's agent with system_prompt and prompt_overflow (its
    ``options`` attribute replaces them); one that does not load is a ConfigError (one error line)."""
    from tether.agents.build import RolloutPlan
    from tether.config import ConfigError
    from tether.resolve import load_config

    (tmp_path / "my_agent_mod.py").write_text(
        "class Echo:\n"
        "    def __init__(self, engine, tokenizer, **options):\n        self.options = options\n"
        "    def rollout(self, examples, params):\n        raise NotImplementedError\n"
        "    def metrics(self):\n        return {}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(None, {"rollout.agent": "my_agent_mod:Echo", "data.system_prompt": "Be brief."})
    agent = RolloutPlan(cfg).agent(engine=None, tokenizer=None)
    assert agent.options == {"system_prompt": "Be brief.", "prompt_overflow": "error"}
    with pytest.raises(ConfigError, match="my_agent_mod:Nope"):
        RolloutPlan(load_config(None, {"rollout.agent": "my_agent_mod:Nope"}))
