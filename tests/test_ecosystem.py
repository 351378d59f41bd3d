"""Tasks and environments of the ecosystem (docs/ecosystem.md): reasoning-gym datasets as tether tasks
(``data.task=reasoning_gym:<name>``, their own verifier as the reward) and SkyRL's skyrl-gym environments through
tether's environment interface (``rollout.agent.env.name=skyrl_gym:<name>``): token-exact episodes, per-step
rewards, `tether train` for 2 steps and `tether eval` on the tiny model, and one clear error for each bad input."""

from __future__ import annotations

import json
import sys

import pytest

from helpers import rows, run_module
from test_search_agent import LogpEngine, ScriptedEngine, segments
from tether.agents import MultiTurnAgent, env_from_config
from tether.errors import ConfigError, EnvError
from tether.resolve import load_config
from tether.rollout import SamplingParams
from tether.tasks.base import DataError, Example
from tether.tasks.rewards import load_reward

rg = pytest.importorskip("reasoning_gym", reason="the optional extra tether[reasoning-gym]")
skyrl_gym = pytest.importorskip("skyrl_gym", reason="the optional extra tether[skyrl-gym]")

RG = {"data.task": "reasoning_gym:basic_arithmetic", "data.options": {"size": 40, "min_terms": 2, "max_terms": 3}}
SKYRL = {"rollout.agent.kind": "multi_turn", "rollout.agent.env.name": "skyrl_gym:gsm8k_multi_turn",
         "rollout.agent.env.observation_format": "chat", "rollout.agent.env.observation_role": "user",
         "rollout.agent.env.options": {"stop": ["\n\n"], "extras": {"max_turns": 2}}}
TINY_RUN = {"rollout.max_new_tokens": 8, "rollout.prompts_per_step": 2, "rollout.n": 2, "run.progress": False,
            "run.plot": False, "run.save_every": 0, "run.exact_kl_samples": 0, "eval.limit": 4,
            "eval.max_new_tokens": 8}


def ids_of(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


# ---------------------------------------------------------------- reasoning-gym


def test_reasoning_gym_task_its_options_and_its_verifier():
    from tether.resolve import eval_benchmarks
    from tether.tasks.stream import held_out_sets, prompt_stream

    cfg = load_config(None, RG)
    stream = prompt_stream(cfg)
    ex = stream.take(3)
    assert stream.reward_name == "reasoning_gym" and all("<answer>" in e.prompt for e in ex)
    entries = [e.meta["entry"] for e in ex]
    assert all(2 <= m["metadata"]["num_terms"] <= 3 for m in entries)  # the difficulty options reached the dataset
    # the same seed (train.seed) gives the same problems; data.options.seed another draw
    again = prompt_stream(load_config(None, RG))
    assert sorted(e.id for e in again.take(40)) == sorted(e.id for e in prompt_stream(cfg).take(40))
    other = load_config(None, {**RG, "data.options": {**RG["data.options"], "seed": 7}})
    assert {e.prompt for e in prompt_stream(other).take(40)} != {e.prompt for e in again.take(40)}
    reward = load_reward("reasoning_gym")
    right = reward(f"Let me see. <answer>{ex[0].answer}</answer>", ex[0])
    assert right.reward == 1.0 and right.correct and right.pred == ex[0].answer
    assert reward("<answer>nope</answer>", ex[0]).reward == 0.0 and reward("no tags", ex[0]).pred is None
    # the held-out set: the same dataset at seed + TEST_SEED_OFFSET, scored by the same verifier
    assert eval_benchmarks(cfg) == ["reasoning_gym:basic_arithmetic"]
    (name, (examples, fn)), = held_out_sets(cfg, eval_benchmarks(cfg)).items()
    assert len(examples) == 100 and fn is not None
    assert not {e.prompt for e in examples} >= {e.prompt for e in prompt_stream(cfg).take(40)}
    assert all(e.id.startswith("rg:basic_arithmetic:test:") for e in examples)


def test_reasoning_gym_bad_input_is_one_clear_error(monkeypatch):
    from tether.tasks.stream import prompt_stream

    with pytest.raises(DataError, match="unknown reasoning-gym dataset 'basic_arithmetc'. Did you mean "
                                        "'basic_arithmetic'"):
        prompt_stream(load_config(None, {"data.task": "reasoning_gym:basic_arithmetc"}))
    with pytest.raises(DataError, match="refused its options .'bogus': 1. .data.options.: TypeError"):
        prompt_stream(load_config(None, {"data.task": "reasoning_gym:basic_arithmetic", "data.options": {"bogus": 1}}))
    with pytest.raises(ConfigError, match="data.options is a key of data.task=reasoning_gym:<name>, and data.task is "
                                          "'arithmetic'"):
        load_config(None, {"data.options": {"size": 3}})
    with pytest.raises(ConfigError, match="data.difficulty is a key of data.task=arithmetic or organism, and "
                                          "data.task is 'reasoning_gym:"):
        load_config(None, {**RG, "data.difficulty": 2})
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # the extra not installed
    with pytest.raises(DataError, match=r"pip install 'tether\[reasoning-gym\]'"):
        prompt_stream(load_config(None, RG))


@pytest.mark.slow
def test_reasoning_gym_trains_and_evaluates(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    args = ["train", "--output-dir", str(run), "--steps", "2", f"model.name={tiny_model_dir}",
            f"data.task={RG['data.task']}", "data.options={size: 40, min_terms: 2, max_terms: 3}",
            *[f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in TINY_RUN.items()]]
    r = run_module(*args)
    assert r.returncode == 0, r.stderr[-2000:]
    got = rows(run)
    assert [g["step"] for g in got if "reward_mean" in g] == [1, 2]
    assert any("eval/reasoning_gym_basic_arithmetic/avg@1" in g for g in got)
    out = tmp_path / "eval"
    r = run_module("eval", "--model", str(run), "--benchmarks", "reasoning_gym:basic_arithmetic", "--limit", "4",
                   "--greedy", "--max-new-tokens", "8", "--no-progress", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((out / "results.json").read_text())
    assert res["benchmarks"]["reasoning_gym_basic_arithmetic"]["metrics"]["avg@1"] >= 0.0


# ---------------------------------------------------------------- skyrl-gym


def _gsm8k_example(answer: str = "24") -> Example:
    return Example(prompt="Natalia sold 48 clips in April and half as many in May. How many in May?", answer=answer,
                   id="q0")


def test_skyrl_gym_episode_is_token_exact_with_step_rewards(tok):
    """gsm8k_multi_turn: a wrong first turn gets SkyRL's user message and a format-reward part; the right second turn
    ends it with reward 1. The policy's ids are kept as sampled (a non-canonical tokenization included), the
    observation turn is masked, and the context of turn 2 is the chat template's rendering of the conversation."""
    cfg = load_config(None, SKYRL)
    env = env_from_config(cfg.rollout.agent.env)
    t1, t2 = "I think #### 23", "#### 24"
    odd = [i for ch in t1 for i in ids_of(tok, ch)]  # one encode per character: non-canonical
    eng = ScriptedEngine(tok, [[odd + [tok.eos_token_id]], [ids_of(tok, t2) + [tok.eos_token_id]]])
    eng.eos_token_ids = [tok.eos_token_id]
    agent = MultiTurnAgent(eng, tok, env, observation_format="chat", observation_role="user")
    rb = agent.rollout([_gsm8k_example()], SamplingParams(n=1, max_new_tokens=32, seed=0))
    segs = segments(rb)
    assert [p for p, _ in segs] == [True, False, True]
    assert segs[0][1] == odd + [tok.eos_token_id]  # the sampled ids, verbatim
    assert segs[2][1] == ids_of(tok, t2) + [tok.eos_token_id]
    obs = tok.decode(segs[1][1])
    final = "Now provide only the final numeric answer in the exact format: '#### ANSWER'."  # SkyRL's, turn 2 of 2
    assert final in obs
    assert rb.info[0]["env_reward"] == pytest.approx(1.0 + 0.2 / 2)  # turn 1's format part (0.2 / 2 turns) + 1
    # turn 2's context: the prompt, the sampled ids as they were, then the template's user turn
    conv = [{"role": "user", "content": _gsm8k_example().prompt}, {"role": "assistant", "content": t1},
            {"role": "user", "content": final}]
    assert eng.calls[1][0][0] == eng.calls[0][0][0] + odd + [tok.eos_token_id] + segs[1][1]
    assert tok.decode(eng.calls[1][0][0]) == tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)


def test_skyrl_gym_single_turn_env_and_the_sampler_log_probs_aligned(tok):
    """The single-turn gsm8k env: one turn, its reward the only part. In the multi-turn env the engine's log-probs
    stay on the policy's own tokens, in order, across the masked observation."""
    cfg = load_config(None, {**SKYRL, "rollout.agent.env.name": "skyrl_gym:gsm8k", "rollout.agent.env.options": {}})
    turn = ids_of(tok, "#### 24") + [tok.eos_token_id]
    eng = ScriptedEngine(tok, [[turn]])
    eng.eos_token_ids = [tok.eos_token_id]
    rb = MultiTurnAgent(eng, tok, env_from_config(cfg.rollout.agent.env), observation_format="chat",
                        observation_role="user").rollout([_gsm8k_example()], SamplingParams(n=1, max_new_tokens=16))
    assert segments(rb) == [(True, turn)] and rb.info[0]["env_reward"] == 1.0
    t1, t2 = ids_of(tok, "#### 3") + [tok.eos_token_id], ids_of(tok, "#### 24") + [tok.eos_token_id]
    eng = LogpEngine(tok, [[t1], [t2]])
    eng.eos_token_ids = [tok.eos_token_id]
    env = env_from_config(load_config(None, SKYRL).rollout.agent.env)
    rb = MultiTurnAgent(eng, tok, env, observation_format="chat", observation_role="user").rollout(
        [_gsm8k_example()], SamplingParams(n=1, max_new_tokens=16))
    pol = rb.loss_mask[0] & rb.response_mask[0]
    want = [-(k + 1) / 100 for k in range(len(t1))] + [-(k + 1) / 100 for k in range(len(t2))]
    assert rb.sampler_logp[0][pol].tolist() == pytest.approx(want)
    assert rb.response_ids[0][pol].tolist() == t1 + t2


def test_skyrl_gym_bad_input_is_one_clear_error(tok, monkeypatch, tmp_path):
    with pytest.raises(ConfigError, match="unknown skyrl-gym environment 'gsm8': Did you mean|unknown skyrl-gym "
                                          "environment 'gsm8'. Did you mean 'gsm8k'"):
        env_from_config(load_config(None, {**SKYRL, "rollout.agent.env.name": "skyrl_gym:gsm8"}).rollout.agent.env)
    with pytest.raises(ConfigError, match="unknown rollout.agent.env.observation_format 'raw'. Valid choices: chat"):
        load_config(None, {**SKYRL, "rollout.agent.env.observation_format": "raw",
                           "rollout.agent.env.observation_role": "tool"})
    with pytest.raises(ConfigError, match="rollout.agent.env.options of skyrl_gym:gsm8k_multi_turn: .*'colour'"):
        env_from_config(load_config(None, {**SKYRL, "rollout.agent.env.options": {"colour": 1}}).rollout.agent.env)
    # an environment that raises in step, or returns what is not a step result: an EnvError naming it
    from skyrl_gym.envs.gsm8k.multi_turn_env import GSM8kMultiTurnEnv

    def episode():
        env = env_from_config(load_config(None, SKYRL).rollout.agent.env)
        eng = ScriptedEngine(tok, [[ids_of(tok, "#### 1") + [tok.eos_token_id]]])
        eng.eos_token_ids = [tok.eos_token_id]
        agent = MultiTurnAgent(eng, tok, env, observation_format="chat", observation_role="user")
        agent.rollout([_gsm8k_example()], SamplingParams(n=1, max_new_tokens=8, seed=0))

    monkeypatch.setattr(GSM8kMultiTurnEnv, "step", lambda self, a: 1 / 0)
    with pytest.raises(EnvError, match="SkyRLGymEnv.act on example 'q0': raised ZeroDivisionError"):
        episode()
    monkeypatch.setattr(GSM8kMultiTurnEnv, "step", lambda self, a: {"reward": 1.0})
    with pytest.raises(EnvError, match="not a dict with observations, reward and done"):
        episode()
    monkeypatch.setattr(GSM8kMultiTurnEnv, "step", lambda self, a: {"observations": [{"role": "tool", "content": "x"}],
                                                                    "reward": 0.0, "done": False})
    with pytest.raises(EnvError, match=r"observations have role\(s\) \['tool'\]; this run shows observations as "
                                       r"'user'"):
        episode()
    monkeypatch.setattr(GSM8kMultiTurnEnv, "init", lambda self, p: 1 / 0)
    with pytest.raises(EnvError, match="SkyRLGymEnv.start on example 'q0': raised ZeroDivisionError"):
        episode()
    monkeypatch.setitem(sys.modules, "skyrl_gym", None)  # the extra not installed
    with pytest.raises(ConfigError, match=r"pip install 'tether\[skyrl-gym\]'"):
        env_from_config(load_config(None, SKYRL).rollout.agent.env)


@pytest.mark.slow
def test_skyrl_gym_trains_and_evaluates(tiny_model_dir, tmp_path):
    """tether train for 2 steps in SkyRL's gsm8k_multi_turn on GSM8K-style rows, then tether eval with it."""
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n"
                            for i in range(8)))
    run = tmp_path / "run"
    over = {**{k: v for k, v in TINY_RUN.items() if not k.startswith("eval.")}, "model.name": str(tiny_model_dir),
            "data.task": str(data), "rollout.agent.env.max_context": 400}
    args = ["train", "--output-dir", str(run), "--steps", "2",
            *[f"{k}={json.dumps(v) if isinstance(v, dict) else (str(v).lower() if isinstance(v, bool) else v)}"
              for k, v in {**SKYRL, **over}.items()]]
    r = run_module(*args)
    assert r.returncode == 0, r.stderr[-2000:]
    got = [g for g in rows(run) if "reward_mean" in g]
    assert [g["step"] for g in got] == [1, 2] and all("skyrl_gym/turns" in g for g in got)
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert samples
    out = tmp_path / "eval"
    r = run_module("eval", "--model", str(run), "--agent", "multi_turn", "--benchmarks", str(data), "--limit", "4",
                   "--greedy", "--max-new-tokens", "8", "--no-progress", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "using the run's environment: rollout.agent.env.name=skyrl_gym:gsm8k_multi_turn" in r.stderr
