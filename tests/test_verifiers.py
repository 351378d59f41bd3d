"""verifiers' classic environments (``rollout.agent.env.name=verifiers:<env_id>``, docs/ecosystem.md) through the
in-process client backed by tether's engine (`tether.agents.verifiers`): a two-turn ToolEnv written here
(tests/vf_envs/tether_vf_add.py) and verifiers' own reasoning-gym integration (tests/vf_envs/tether_vf_rg.py), offline.
Token-exact episodes, the rubric's reward, error rows masked and counted, `tether train` for 2 steps and
`tether eval`, and one clear error for each bad input."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from helpers import rows, run_module
from test_search_agent import LogpEngine, ScriptedEngine, segments
from tether.agents import env_from_config, multi_turn_agent
from tether.agents.chat_turns import ChatTemplateError
from tether.agents.tool_calls import parse_tool_calls, template_tool_format, tools_system_text
from tether.agents.verifiers import VerifiersAgent
from tether.errors import ConfigError, EnvError
from tether.resolve import load_config
from tether.rollout import SamplingParams
from tether.tasks.stream import held_out_sets, prompt_stream

vf = pytest.importorskip("verifiers.legacy", reason="the classic API: verifiers 0.3.x, deprecated (tether[verifiers] "
                         "is 0.4); CI runs this module with it on PYTHONPATH (.ci/run, docs/ecosystem.md)")

ENVS_DIR = Path(__file__).parent / "vf_envs"
ADD = {"rollout.agent.kind": "multi_turn", "rollout.agent.env.name": "verifiers:tether_vf_add",
       "rollout.agent.env.observation_format": "chat"}
RG = {**ADD, "rollout.agent.env.name": "verifiers:tether_vf_rg"}
CALL = '<tool_call>{"name": "add", "arguments": {"a": 4, "b": 5}}</tool_call>'


@pytest.fixture(autouse=True)
def env_modules(monkeypatch):
    monkeypatch.syspath_prepend(str(ENVS_DIR))


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def ids_of(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def agent_for(tok, over: dict, script, engine=ScriptedEngine, **kw) -> tuple[VerifiersAgent, ScriptedEngine, list]:
    cfg = load_config(None, over)
    eng = engine(tok, script)
    eng.eos_token_ids = [tok.eos_token_id]
    agent = multi_turn_agent(eng, tok, env_from_config(cfg.rollout.agent.env), max_context=1024,
                             observation_format="chat", **kw)
    return agent, eng, prompt_stream(cfg).take(1)


def test_tool_env_episode_is_token_exact_with_the_rubric_reward(tok):
    """Two episodes of one example: one calls the add tool (its JSON sampled in a non-canonical tokenization) and
    then answers; the other answers at once. The policy's ids are kept verbatim, the tool message is masked, turn 2's
    context is the chat template's rendering of the conversation (the tools described in the system message, since
    the tiny template renders none), the engine's log-probs stay on the policy's own ids, and the rubric's score is
    the reward (and the verdict)."""
    eos = tok.eos_token_id
    odd = [i for ch in CALL for i in ids_of(tok, ch)] + [eos]  # one encode per character: non-canonical
    answer = ids_of(tok, "It is 9") + [eos]
    agent, eng, ex = agent_for(tok, ADD, [[odd, ids_of(tok, "no tools") + [eos]], [answer]], engine=LogpEngine)
    assert isinstance(agent, VerifiersAgent) and ex[0].answer == "9"
    rb = agent.rollout(ex, SamplingParams(n=2, max_new_tokens=128, seed=0))
    segs = segments(rb, 0)
    assert [p for p, _ in segs] == [True, False, True]
    assert segs[0][1] == odd and segs[2][1] == answer  # the sampled ids, verbatim
    # turn 2's context: the prompt ids, the sampled ids as they were, then the template's tool turn
    first, second = eng.calls[0][0][0], eng.calls[1][0][0]
    assert second == first + odd + segs[1][1]
    tools = [{"name": t.name, "description": t.description, "parameters": t.parameters}
             for t in agent.env.env.tool_defs]
    conv = [{"role": "system", "content": "You can add.\n\n" + tools_system_text(tools)},
            {"role": "user", "content": ex[0].prompt}, {"role": "assistant", "content": CALL},
            {"role": "tool", "content": "9"}]
    assert tok.decode(second) == tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    pol = rb.loss_mask[0] & rb.response_mask[0]
    want = [-(k + 1) / 100 for k in range(len(odd))] + [-(k + 1) / 100 for k in range(len(answer))]
    assert rb.sampler_logp[0][pol].tolist() == pytest.approx(want)
    assert rb.info[0]["env_reward"] == 1.0 and rb.info[0]["env_correct"] and rb.info[0]["tool_calls"] == 1
    assert rb.info[1]["env_reward"] == 0.0 and not rb.info[1]["env_correct"] and rb.group.tolist() == [0, 0]
    m = agent.metrics()
    assert m["verifiers/tool_calls"] == 0.5 and m["verifiers/reward"] == 0.5 and m["verifiers/errors"] == 0


def test_reasoning_gym_integration_single_turn(tok):
    """verifiers' ReasoningGymEnv (a SingleTurnEnv): its rubric scores the <answer> tags against the reasoning-gym
    entry; the held-out set is the environment's eval dataset."""
    cfg = load_config(None, RG)
    env = env_from_config(cfg.rollout.agent.env)
    ex = prompt_stream(cfg).take(1)
    truth = env.env.rg_dataset[int(ex[0].answer)]["answer"]
    eos = tok.eos_token_id
    script = [[ids_of(tok, f"<answer>{truth}</answer>") + [eos], ids_of(tok, "<answer>nope</answer>") + [eos]]]
    agent, eng, _ = agent_for(tok, RG, script)
    rb = agent.rollout(ex, SamplingParams(n=2, max_new_tokens=32, seed=0))
    assert [r["env_reward"] for r in rb.info] == [1.0, 0.0] and [r["env_correct"] for r in rb.info] == [True, False]
    assert len(eng.calls) == 1 and [p for p, _ in segments(rb, 0)] == [True]
    (name, (examples, _)), = held_out_sets(cfg, ["verifiers:tether_vf_rg"]).items()
    assert len(examples) == 5 and all(e.id.startswith("vf:tether_vf_rg:eval:") for e in examples)


def test_an_error_row_is_masked_and_counted(tok):
    """A tool that raises one of the environment's stop errors marks the episode with state["error"]: its row stays in
    the batch with no token trained, reward 0, and verifiers/errors counts it."""
    over = {**ADD, "rollout.agent.env.options": {"args": {"fail_on": 4}}}
    eos = tok.eos_token_id
    agent, _, ex = agent_for(tok, over, [[ids_of(tok, CALL) + [eos], ids_of(tok, "9") + [eos]]])
    rb = agent.rollout(ex, SamplingParams(n=2, max_new_tokens=64, seed=0))
    assert "ToolCallError" in rb.info[0]["error"] and not rb.loss_mask[0].any() and rb.info[0]["env_reward"] == 0.0
    assert rb.loss_mask[1].any() and "error" not in rb.info[1]
    assert agent.metrics()["verifiers/errors"] == 0.5


def test_the_engine_keeps_each_episode_between_turns(tiny_model_dir):
    """On the transformers engine (a MultiTurnEnv with a user turn after each turn, tests/vf_envs/tether_vf_echo.py)
    each episode is a session: turn 2 encodes only its new tokens, and the ids sampled are those of a run that
    re-encodes every turn (rollout.reuse_kv=false); the engine's log-probs equal the trainer's on the policy's ids."""
    from tether.logprobs import response_stats
    from tether.models import ModelConfig, load_model
    from tether.rollout import HFEngine

    model, tok = load_model(ModelConfig(name=str(tiny_model_dir)))
    eng = HFEngine(model, tok, record_logp=True)
    cfg = load_config(None, {**ADD, "rollout.agent.env.name": "verifiers:tether_vf_echo"})
    out = []
    for reuse in (True, False):
        agent = multi_turn_agent(eng, tok, env_from_config(cfg.rollout.agent.env), max_context=240,
                                 max_obs_tokens=64, observation_format="chat", reuse_kv=reuse)
        assert agent.sessions == reuse
        rb = agent.rollout(prompt_stream(cfg).take(2), SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=3))
        assert all(r["turns"] == 2 for r in rb.info) and not len(eng.session_store)  # released at the end
        out.append(rb)
    assert out[0].response_ids.tolist() == out[1].response_ids.tolist()
    rb = out[0]
    with torch.no_grad():
        st = response_stats(model, rb.prompt_ids, rb.prompt_mask, rb.response_ids, rb.response_mask, temperature=1.0,
                            entropy=False)
    assert float((st.logp.float() - rb.sampler_logp).abs()[rb.loss_mask].max()) < 1e-4
    assert torch.all(rb.sampler_logp[rb.response_mask & ~rb.loss_mask] == 0)


def test_tool_call_formats():
    content, calls = parse_tool_calls('Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
                                      '<tool_call>not json</tool_call>', "hermes", 2)
    assert content == "Let me add." and calls == [{"id": "call_2_0", "name": "add", "arguments": '{"a": 1}'},
                                                  {"id": "call_2_1", "name": "invalid", "arguments": "not json"}]
    assert parse_tool_calls('{"name": "add", "parameters": {"a": 1}}', "llama3_json")[1][0]["arguments"] == '{"a": 1}'
    assert parse_tool_calls("just text", "llama3_json") == ("just text", [])

    class Tok:  # a template that renders tools in a format tether does not parse
        chat_template = "{{ tools }}[AVAILABLE_TOOLS]"

        def apply_chat_template(self, messages, tools=None, **kw):
            return "[AVAILABLE_TOOLS]" + json.dumps(tools) if tools else "plain"

    with pytest.raises(ConfigError, match="renders tool definitions in a format tether does not parse"):
        template_tool_format(Tok())
    assert template_tool_format(Tok(), "hermes") == ("hermes", True)
    Tok.chat_template = "{{ '<|python_tag|>' }}"
    assert template_tool_format(Tok()) == ("llama3_json", True)


def test_bad_input_is_one_clear_error(tok, monkeypatch):
    with pytest.raises(ConfigError, match="unknown verifiers environment 'no-such-env': no module 'no_such_env' is "
                                          "installed"):
        env_from_config(load_config(None, {**ADD, "rollout.agent.env.name": "verifiers:no-such-env"}).rollout.agent.env)
    with pytest.raises(ConfigError, match=r"options of verifiers:tether_vf_add: unknown key\(s\) \['colour'\]"):
        load_config(None, {**ADD, "rollout.agent.env.options": {"colour": 1}})
    with pytest.raises(ConfigError, match="options.tool_format"):
        load_config(None, {**ADD, "rollout.agent.env.options": {"tool_format": "mistral"}})
    with pytest.raises(ConfigError, match="unknown rollout.agent.env.observation_format 'raw'. Valid choices: chat"):
        load_config(None, {**ADD, "rollout.agent.env.observation_format": "raw"})
    with pytest.raises(ConfigError, match="data.task has no effect with rollout.agent.env.name=verifiers"):
        load_config(None, {**ADD, "data.task": "gsm8k"})
    with pytest.raises(ConfigError, match="load_environment refused .*'bogus'"):
        env_from_config(load_config(None, {**ADD, "rollout.agent.env.options": {"args": {"bogus": 1}}})
                        .rollout.agent.env)
    eos = tok.eos_token_id
    env_cls = vf.ToolEnv

    def episode(script=None):
        agent, _, ex = agent_for(tok, ADD, script or [[ids_of(tok, CALL) + [eos]], [ids_of(tok, "9") + [eos]]])
        agent.rollout(ex, SamplingParams(n=1, max_new_tokens=64, seed=0))

    async def boom(self, messages, state, **kwargs):
        return 1 / 0

    monkeypatch.setattr(env_cls, "env_response", boom)  # the environment raises in its step
    with pytest.raises(EnvError, match="'tether_vf_add': rollout on example 'vf:tether_vf_add:train:.*' raised "
                                       "ZeroDivisionError"):
        episode()

    async def malformed(self, messages, state, **kwargs):
        return 42

    monkeypatch.setattr(env_cls, "env_response", malformed)  # what it answers is not messages
    with pytest.raises(EnvError, match="rollout on example .* raised"):
        episode()
    monkeypatch.undo()
    monkeypatch.syspath_prepend(str(ENVS_DIR))

    async def setup_boom(self, state):
        raise KeyError("no such row")

    monkeypatch.setattr(env_cls, "setup_state", setup_boom)  # the environment raises opening the episode
    with pytest.raises(EnvError, match="raised KeyError"):
        episode()
    monkeypatch.undo()
    monkeypatch.syspath_prepend(str(ENVS_DIR))
    real = vf.MultiTurnEnv.get_prompt_messages

    async def rewrite(self, state):  # an environment whose later turn drops an earlier message
        msgs = await real(self, state)
        return msgs[1:] if state["trajectory"] else msgs

    monkeypatch.setattr(env_cls, "get_prompt_messages", rewrite)
    with pytest.raises(EnvError, match="rewrote the conversation of example"):
        episode()
    monkeypatch.undo()
    monkeypatch.syspath_prepend(str(ENVS_DIR))
    # a template that rewrites earlier turns (drops every assistant message but the last)
    rewriting = ("{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}{{ '<|im_start|>' + m['role'] + "
                 "'\n' + m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    monkeypatch.setattr(tok, "chat_template", rewriting)
    with pytest.raises(ChatTemplateError, match="the chat template rewrites earlier turns"):
        episode()
    monkeypatch.undo()
    monkeypatch.syspath_prepend(str(ENVS_DIR))
    monkeypatch.setattr(sys.modules["verifiers"], "__version__", "0.2.9")  # 0.4 runs its task API (verifiers_v1)
    with pytest.raises(ConfigError, match="verifiers 0.2.9 is installed; tether drives the classic API of "
                                          "verifiers 0.3"):
        env_from_config(load_config(None, ADD).rollout.agent.env)
    monkeypatch.setitem(sys.modules, "verifiers", None)  # the extra not installed
    with pytest.raises(ConfigError, match=r"pip install 'tether\[verifiers\]'"):
        env_from_config(load_config(None, ADD).rollout.agent.env)


@pytest.mark.slow
def test_verifiers_trains_and_evaluates(tiny_model_dir, tmp_path):
    """tether train for 2 steps on the ToolEnv (its held-out set evaluated at the end), then tether eval with the
    run: the rubric's reward is the reward, verifiers/* metrics are logged."""
    run = tmp_path / "run"
    over = {"model.name": str(tiny_model_dir), "rollout.max_new_tokens": 8, "rollout.prompts_per_step": 2,
            "rollout.n": 2, "run.progress": "false", "run.plot": "false", "run.save_every": 0,
            "run.exact_kl_samples": 0, "eval.limit": 4, "eval.max_new_tokens": 8,
            "rollout.agent.env.max_context": 600}
    env = {"PYTHONPATH": os.pathsep.join([str(ENVS_DIR), os.environ.get("PYTHONPATH", "")])}  # (the classic API's)
    r = run_module("train", "--output-dir", run, "--steps", 2, *[f"{k}={v}" for k, v in {**ADD, **over}.items()],
                   env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    got = rows(run)
    assert [g["step"] for g in got if "reward_mean" in g] == [1, 2]
    assert all("verifiers/turns" in g and "verifiers/errors" in g for g in got if "reward_mean" in g)
    assert any("eval/verifiers_tether_vf_add/avg@1" in g for g in got), got[-1].keys()
    out = tmp_path / "eval"
    r = run_module("eval", "--model", run, "--agent", "multi_turn", "--benchmarks", "verifiers:tether_vf_add",
                   "--limit", 4, "--greedy", "--max-new-tokens", 8, "--no-progress", "--out", out, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((out / "results.json").read_text())
    (name, b), = res["benchmarks"].items()
    assert name == "verifiers_tether_vf_add" and b["metrics"]["avg@1"] >= 0.0 and len(b["metrics"]) > 3
    # a plain model (no run to take the environment from): --env and --env-options, in the chat format
    out = tmp_path / "eval_plain"
    r = run_module("eval", "--model", tiny_model_dir, "--agent", "multi_turn", "--env", "verifiers:tether_vf_add",
                   "--env-options", "{args: {n: 6, n_eval: 3, digits: 2}}", "--benchmarks", "verifiers:tether_vf_add",
                   "--greedy", "--max-new-tokens", 8, "--no-progress", "--out", out, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((out / "results.json").read_text())
    assert res["benchmarks"]["verifiers_tether_vf_add"]["metrics"]["n_problems"] == 3
    r = run_module("eval", "--model", tiny_model_dir, "--agent", "multi_turn", "--env", "verifiers:tether_vf_add",
                   "--env-options", "[1, 2]", "--benchmarks", "verifiers:tether_vf_add", env=env)
    assert r.returncode == 2 and "--env-options must be a mapping" in r.stderr
