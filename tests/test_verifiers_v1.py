"""verifiers 0.4's task API (``rollout.agent.env.name=verifiers:<id>`` with verifiers 0.4 installed; docs/ecosystem.md)
through tether's endpoint (`tether.rollout.endpoint`) over the hf engine: a local taskset written here
(tests/vf1_envs/tether_vf1_add.py: a reward and an MCP tool) with verifiers' null harness and subprocess runtime, on
the tiny model, offline but for the harness program's first ``uv sync`` (PyPI).

Token-exact rows (the trained ids are the trace's, the masks cover exactly the policy's tokens, the sampler's
log-probs are the trainer's), two turns with a tool call, the reward reaching the advantage (tether train), tether
eval, and one error line for each bad input. The served engine's route is tests/test_vllm_served.py's."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

vf = pytest.importorskip("verifiers.v1", reason="verifiers 0.4, the optional extra tether[verifiers]")

from helpers import assert_clean_error, rows, subprocess_env  # noqa: E402
from tether.agents.build import RolloutPlan  # noqa: E402
from tether.errors import ConfigError, EnvError  # noqa: E402
from tether.logprobs import response_stats  # noqa: E402
from tether.models import ModelConfig, load_model  # noqa: E402
from tether.resolve import load_config  # noqa: E402
from tether.rollout import HFEngine, SamplingParams  # noqa: E402

ENVS = Path(__file__).parent / "vf1_envs"
ADD = {"rollout.agent.kind": "multi_turn", "rollout.agent.env.name": "verifiers:tether_vf1_add",
       "rollout.agent.env.observation_format": "chat", "rollout.agent.env.max_turns": 3}
CALL = '<tool_call>{"name": "calc_add", "arguments": {"a": 1, "b": 2}}</tool_call>'
#: ChatML with an assistant's tool calls in the Hermes format (as the Qwen family's templates render them)
TOOL_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{%- for tc in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ tc.function.name }}\", \"arguments\": "
    "{%- if tc.function.arguments is string %} {{ tc.function.arguments }}"
    "{%- else %} {{ tc.function.arguments | tojson }}{%- endif %}}</tool_call>{%- endfor %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(autouse=True)
def env_modules(monkeypatch):
    """The taskset module importable here and by the processes verifiers starts (its tool server)."""
    monkeypatch.syspath_prepend(str(ENVS))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ENVS), os.environ.get("PYTHONPATH", "")]))


@pytest.fixture(scope="module")
def tool_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with ``<tool_call>`` / ``</tool_call>`` as tokens of their own, as in the Qwen family: the
    renderer's Hermes parser (``tool_parser: qwen3``) finds a call by those token ids."""
    d = tmp_path_factory.mktemp("tool_model")
    model, tok = load_model(ModelConfig(name=str(tiny_model_dir)))
    tok.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    tok.chat_template = TOOL_TEMPLATE
    model.resize_token_embeddings(len(tok))
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def model_tok(tool_model_dir):
    return load_model(ModelConfig(name=str(tool_model_dir)))


class ForcedEngine(HFEngine):
    """The hf engine, recording its log-probs; its first calls answer ``forced`` ids (a tool call the tiny random
    model would not write), with the model's own log-probs of them (teacher-forced), the rest sampled."""

    def __init__(self, model, tokenizer, forced: list[list[int]]):
        super().__init__(model, tokenizer, record_logp=True)
        self.forced, self.calls = list(forced), []

    def generate(self, prompts, params, sessions=None):
        self.calls.append([list(p) for p in prompts])
        if not self.forced:
            return super().generate(prompts, params)
        ids = self.forced.pop(0)
        rb = self.assemble(prompts, [0] * params.n, [(ids, "stop", self.tokenizer.decode(ids))] * params.n)
        with torch.no_grad():
            st = response_stats(self.model, rb.prompt_ids, rb.prompt_mask, rb.response_ids, rb.response_mask,
                                temperature=params.temperature, entropy=False)
        rb.sampler_logp = torch.where(rb.response_mask, st.logp.float(), 0.0)
        return rb


def agent_on(engine, tok, **options):
    cfg = load_config(None, {**ADD, "rollout.agent.env.options": {"taskset": {"size": 2}, **options}})
    plan = RolloutPlan(cfg)
    return plan.agent(engine, tok), plan.tools["env"]


def trainer_logp(model, rb):
    with torch.no_grad():
        return response_stats(model, rb.prompt_ids, rb.prompt_mask, rb.response_ids, rb.response_mask,
                              entropy=False).logp.float()


def test_two_turns_with_a_tool_call_are_token_exact(model_tok):
    """Turn 1 calls the tool (forced), verifiers' tool server answers, turn 2 is sampled. The row holds exactly the
    ids the engine produced and what verifiers inserted between them: the engine's ids under loss_mask, the tool
    result masked, the sampler's log-probs equal to the trainer's on every policy token."""
    model, tok = model_tok
    call = tok(CALL, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    eng = ForcedEngine(model, tok, [call])
    agent, env = agent_on(eng, tok)
    try:
        rb = agent.rollout(env.examples("train")[:1], SamplingParams(n=1, temperature=1.0, max_new_tokens=12,
                                                                     seed=0))
    finally:
        agent.close()
    assert len(rb) == 1 and len(eng.calls) == 2, eng.calls  # two model calls, one sample
    m, lm = rb.response_mask[0], rb.loss_mask[0]
    resp = rb.response_ids[0][m].tolist()
    pol = lm[m].tolist()
    assert resp[:len(call)] == call and all(pol[:len(call)])  # turn 1: the engine's ids, verbatim
    second = eng.calls[1][0]
    prompt = rb.prompt_ids[0][rb.prompt_mask[0]].tolist()
    assert second[:len(prompt) + len(call)] == prompt + call  # turn 2's prompt extends turn 1's tokens
    inserted = second[len(prompt) + len(call):]  # what verifiers rendered after the call (the tool's answer)
    assert resp[len(call):len(call) + len(inserted)] == inserted and not any(pol[len(call):len(call) + len(inserted)])
    assert all(pol[len(call) + len(inserted):])  # turn 2: sampled, trained
    assert "3" in tok.decode(inserted)  # the tool's sum reached the model's context
    d = (trainer_logp(model, rb) - rb.sampler_logp).abs()[rb.loss_mask]
    assert float(d.max()) < 1e-4
    assert rb.info[0]["vf_turns"] == 2 and agent.metrics()["verifiers/errors"] == 0


def test_sampled_rows_and_the_reward(model_tok):
    """n samples of each example, grouped; every row's info carries the trace's reward and verdict."""
    model, tok = model_tok
    eng = HFEngine(model, tok, record_logp=True)
    agent, env = agent_on(eng, tok, taskset={"size": 2, "reward": "spread"}, pass_threshold=0.0)
    try:
        t0 = time.perf_counter()
        rb = agent.rollout(env.examples("train"), SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=1))
        wall = time.perf_counter() - t0
    finally:
        agent.close()
    assert rb.group.tolist() == [0, 0, 1, 1]
    assert 0.0 < rb.gen_time_s < wall  # the engine's generating time, measured at the endpoint (not 0)
    assert all(i["env_correct"] and 0.0 <= i["env_reward"] <= 1.0 for i in rb.info)
    d = (trainer_logp(model, rb) - rb.sampler_logp).abs()[rb.loss_mask]
    assert float(d.max()) < 1e-4


@pytest.mark.slow  # about 90 s (two CLI processes, each starting verifiers' harness programs): CI's slow step
def test_the_reward_reaches_the_advantage_in_training_and_eval_scores_it(tool_model_dir, tmp_path):
    """`tether train` for 2 steps (the trace's reward: a number from the reply's characters, so two different
    replies differ) and `tether eval` in the environment, in subprocesses."""
    env = subprocess_env(PYTHONPATH=str(ENVS))
    opts = '{taskset: {size: 4, reward: spread}, pass_threshold: 0.1}'
    args = [sys.executable, "-m", "tether", "train", "--recipe", "grpo", "--output-dir", str(tmp_path / "run"),
            "--steps", "2", f"model.name={tool_model_dir}", *[f"{k}={v}" for k, v in ADD.items()],
            f"rollout.agent.env.options={opts}", "rollout.prompts_per_step=2", "rollout.n=2",
            "rollout.max_new_tokens=8", "train.lr=0.01", "run.progress=false", "run.plot=false", "eval.before=false",
            "eval.after=false"]
    import subprocess

    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    got = rows(tmp_path / "run")
    assert [x["step"] for x in got] == [1, 2]
    # step 1: the policy is its reference (no KL gradient), so a non-zero gradient is the advantages' (rewards
    # that differ within a group); the on-policy surrogate's value itself is 0 whatever they are
    assert got[0]["reward_std"] > 0 and got[0]["kl_loss"] == 0 and got[0]["grad_norm"] > 0
    assert all(x["verifiers/errors"] == 0 for x in got)
    r = subprocess.run([sys.executable, "-m", "tether", "eval", "--model", str(tmp_path / "run"), "--agent",
                        "multi_turn", "--env", "verifiers:tether_vf1_add", "--env-options", opts, "--max-turns", "3",
                        "--benchmarks", "verifiers:tether_vf1_add", "--limit", "2", "--max-new-tokens", "8",
                        "--out", str(tmp_path / "ev")], capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "ev" / "results.json").read_text())
    assert [b["metrics"]["n_problems"] for b in res["benchmarks"].values()] == [2]


@pytest.mark.parametrize("over, needle", [
    ({"rollout.agent.env.name": "verifiers:no_such_env_here"}, "unknown verifiers environment 'no_such_env_here'"),
    ({"rollout.agent.env.options": {"harness": {"id": "mini_swe_agent"}}},
     "the 'mini_swe_agent' harness needs a container"),
    ({"rollout.agent.env.options": {"runtime": {"type": "docker"}}}, "the 'docker' runtime needs a container"),
    ({"rollout.agent.env.options": {"agent": {"client": {"type": "eval"}}}},
     "rollout.agent.env.options.agent.client is tether's to set"),
    ({"rollout.agent.env.options": {"tool_format": "hermes"}}, "unknown key(s) ['tool_format']"),
])
def test_each_bad_environment_is_one_error_naming_it(over, needle):
    with pytest.raises(ConfigError) as e:
        RolloutPlan(load_config(None, {**ADD, **over}))
    assert needle in str(e.value)


@pytest.mark.slow  # about 20 s: CI's slow step
def test_a_taskset_raising_in_its_reward_is_one_error_line(tiny_model_dir, tmp_path):
    r = __import__("subprocess").run(
        [sys.executable, "-m", "tether", "train", "--recipe", "grpo", "--output-dir", str(tmp_path / "run"),
         "--steps", "1", f"model.name={tiny_model_dir}", *[f"{k}={v}" for k, v in ADD.items()],
         "rollout.agent.env.options={taskset: {size: 2, reward: raise}}", "rollout.prompts_per_step=1", "rollout.n=1",
         "rollout.max_new_tokens=4", "run.progress=false", "eval.before=false", "eval.after=false"],
        capture_output=True, text=True, env=subprocess_env(PYTHONPATH=str(ENVS)), timeout=900)
    assert_clean_error(r.returncode, r.stderr, "verifiers:tether_vf1_add: the taskset raised on example",
                       "the test's reward raises on purpose", line_only=True)


def test_a_trace_with_no_tokens_is_one_error(model_tok):
    """A trace that called the model but holds no token ids (its client was an eval client: the relay keeps no
    tokens) is an EnvError naming the example."""
    model, tok = model_tok
    agent, env = agent_on(HFEngine(model, tok, record_logp=True), tok)
    try:
        trace = SimpleNamespace(errors=[], branches=[], calls=[object()], reward=0.0, stop_condition="agent_completed")
        with pytest.raises(EnvError, match="has model calls but no token ids: its client was not a training client"):
            agent._batch(env.examples("train")[:1], [(0, SimpleNamespace(traces=[trace], errors=[]))])
    finally:
        agent.close()


def test_the_endpoint_counts_overlapping_requests_once(monkeypatch):
    """`GenerateEndpoint.busy_s`: the seconds during which at least one request was generating."""
    from tether.rollout import endpoint as ep

    clock = iter([0.0, 1.0, 3.0, 4.0, 10.0, 12.0])  # A starts at 0, B at 1, A ends at 3, B at 4; C from 10 to 12
    monkeypatch.setattr(ep.time, "perf_counter", lambda: next(clock))
    e = ep.GenerateEndpoint.__new__(ep.GenerateEndpoint)  # the clock alone, without a server
    e._lock, e._busy, e._busy_since, e._busy_s = threading.Lock(), 0, 0.0, 0.0
    for d in (+1, +1, -1, -1, +1, -1):
        e._generating(d)
    assert e.busy_s == 6.0  # 0 -> 4 once, not 3 + 3; then 2
