"""tether.envs: the text environment interface (batch, turn budget, final-turn rule), the ENVS registry, and
docs/environments.md's example environment, loaded by its module:Class spec and run on two examples."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tether.envs import ENVS, Env, FinalTurn, Start, StepResult, TextEnv, make_env
from tether.errors import ConfigError, EnvError
from tether.tasks import Example

DOC = Path(__file__).resolve().parents[1] / "docs" / "environments.md"
SPEC = "my_env:GuessEnv"


def blocks(lang: str) -> list[str]:
    """The page's fenced code blocks in ``lang``, in order."""
    return re.findall(rf"^```{lang}\n(.*?)^```", DOC.read_text(), flags=re.MULTILINE | re.DOTALL)


@pytest.fixture()
def user_dir(tmp_path, monkeypatch):
    """A directory on sys.path holding the page's module, my_env.py (forgotten again afterwards)."""
    (tmp_path / "my_env.py").write_text(blocks("python")[0])
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_env", raising=False)
    yield tmp_path
    sys.modules.pop("my_env", None)


EXAMPLES = [Example("I think of a number between 1 and 10.", "7", "a"),
            Example("I think of a number between 1 and 5.", "3", "b")]


def test_the_pages_environment_loads_by_spec_and_runs_on_two_examples(user_dir):
    assert SPEC in DOC.read_text()
    cls, meta = ENVS.resolve(SPEC)
    assert cls.__name__ == "GuessEnv" and meta == {}
    env = cls()
    assert isinstance(env, Env) and env.name == "guess" and env.max_turns == 5 and env.reward is None
    starts = [env.reset(ex) for ex in EXAMPLES]
    assert all(isinstance(s, Start) for s in starts)
    assert [s.info for s in starts] == [{"id": "a"}, {"id": "b"}]
    assert starts[1].prompt.startswith(EXAMPLES[1].prompt) and "<guess>N</guess>" in starts[1].prompt
    assert env.active() == [0, 1] and env.stop_strings() == ["</guess>"]

    r = env.step(["Maybe <guess>5</guess>", "<guess>3</guess>"])
    assert [(x.observation, x.reward, x.done) for x in r] == [(" <hint>higher</hint>", 0.0, False), (None, 1.0, True)]
    assert [x.info for x in r] == [{"guess": 5}, {"guess": 3}]
    assert env.active() == [0]
    [r] = env.step(["no idea"])
    assert r.observation == " Write your guess as <guess>N</guess>." and not r.done
    [r] = env.step(["<guess>9</guess>"])
    assert (r.observation, r.done) == (" <hint>lower</hint>", False)
    [r] = env.step(["<guess>8</guess>"])
    assert (r.observation, r.done) == (" <hint>lower</hint>" + " Last guess!", False)  # turn 4 of 5: the note
    assert env.stop_strings() == ["</guess>"]  # the final turn's
    [r] = env.step(["<guess>7</guess>"])
    assert r.done and r.reward == pytest.approx(1 / 5) and env.active() == []


def test_the_pages_usage_block_runs(user_dir, monkeypatch):
    monkeypatch.chdir(user_dir)
    scope: dict = {}
    exec(compile(blocks("python")[1], str(DOC), "exec"), scope)  # the page's own code, a test's to run
    assert scope["cls"].__name__ == "GuessEnv" and scope["env"].max_turns == 3
    assert scope["env"].active() == [0]


def test_the_pages_environment_loads_from_a_file_spec(user_dir):
    env = make_env(f"{user_dir / 'my_env.py'}:GuessEnv", max_turns=2)
    env.reset(EXAMPLES[0])
    [r] = env.step(["<guess>1</guess>"])
    assert r.observation == " <hint>higher</hint> Last guess!"
    [r] = env.step(["<guess>2</guess>"])  # the budget's last turn ends the episode, found or not
    assert r.done and r.observation is None and r.reward == 0.0


def test_specs_that_do_not_load_are_config_errors(user_dir):
    with pytest.raises(ConfigError, match="has no attribute 'Nope'"):
        make_env("my_env:Nope")
    with pytest.raises(ConfigError, match="cannot import environment module"):
        make_env("no_such_module_xyz:Env")
    with pytest.raises(ConfigError, match="unknown environment 'gues'"):
        make_env("gues")
    with pytest.raises(ConfigError, match="has no reset"):
        make_env("collections:OrderedDict")


class Batched(TextEnv):
    """Counts its act_batch calls; echoes each action; a reward part per turn."""

    name = "batched"
    stop = ("</x>",)
    max_turns = 3
    final_turn = FinalTurn(stop=("</final>",), note="[last]")

    def __init__(self, **kw):
        super().__init__(**kw)
        self.calls: list[int] = []

    def start(self, example):
        return Start(prompt=[{"role": "user", "content": example.prompt}])

    def act_batch(self, episodes, actions):
        self.calls.append(len(actions))
        return [StepResult(observation=f"<{a}>", reward=0.5, info={"final": e.final, "turn": e.turns})
                for e, a in zip(episodes, actions)]


def test_one_tool_call_per_turn_and_the_final_turn_rule():
    env = Batched()
    for ex in EXAMPLES:
        env.reset(ex)
    r1 = env.step(["p", "q"])
    assert [r.observation for r in r1] == ["<p>", "<q>"] and [r.info["turn"] for r in r1] == [1, 1]
    r2 = env.step(["p", "q"])
    assert [r.observation for r in r2] == ["<p>[last]", "<q>[last]"] and env.stop_strings() == ["</final>"]
    r3 = env.step(["p", "q"])
    assert all(r.done and r.observation is None and r.info["final"] and r.reward == 0.5 for r in r3)
    assert env.calls == [2, 2, 2] and env.active() == [] and env.stop_strings() == ["</x>"]  # a new batch's


def test_step_checks_its_actions_and_results():
    env = Batched(max_turns=4, reward="gsm8k")
    assert env.reward == "gsm8k" and env.max_turns == 4
    env.reset(EXAMPLES[0])
    with pytest.raises(ValueError, match="one action per active episode"):
        env.step("p")
    with pytest.raises(ValueError, match="got 2 actions"):
        env.step(["p", "q"])
    env.act_batch = lambda eps, acts: []
    with pytest.raises(ValueError, match="returned 0 results for 1 actions"):
        env.step(["p"])
    env.act_batch = lambda eps, acts: [StepResult(reward=float("nan"))]
    with pytest.raises(ValueError, match="non-finite reward"):
        env.step(["p"])
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_turns must be an integer >= 1"):
            Batched(max_turns=bad)


def test_a_subclass_that_writes_nothing_says_so():
    env = TextEnv()  # the NotImplementedError comes back as an EnvError naming the method and the example
    with pytest.raises(EnvError, match=r"TextEnv.start on example .*NotImplementedError: TextEnv must define start"):
        env.reset(EXAMPLES[0])
    env.start = lambda ex: Start(prompt=ex.prompt)
    env.reset(EXAMPLES[0])
    with pytest.raises(EnvError, match=r"TextEnv.act on example .*must define act"):
        env.step(["x"])
