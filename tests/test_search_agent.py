"""The search environment run by the multi-turn agent, with a scripted engine and a fake retriever:
exact observations, loss_mask on every token, the policy's ids kept as sampled, the budgets,
and the loss ignoring observation tokens."""

from __future__ import annotations

import math

import pytest
import torch

from tether.agents import MultiTurnAgent
from tether.envs.search import SearchEnv
from tether.rollout import RolloutBatch, SamplingParams
from tether.search.corpus import Passage
from tether.search.protocol import INVALID_ACTION_MESSAGE, render_observation, render_search_error
from tether.search.retrievers import RetrievalError
from tether.tasks import Example
from tether.tasks.prompts import encode_prompts


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def SearchAgent(engine, tok, retriever, *, topk=3, max_searches=4, observation_format="search_r1", **options):
    """What rollout.agent.env.name=search builds: SearchEnv over the retriever, run by MultiTurnAgent."""
    env = SearchEnv(retriever, topk=topk, max_searches=max_searches, observation_format=observation_format)
    return MultiTurnAgent(engine, tok, env, **options)


def char_ids(tok, text: str) -> list[int]:
    """A non-canonical tokenization: one encode per character (what a sampler may well produce)."""
    return [i for ch in text for i in tok(ch, add_special_tokens=False)["input_ids"]]


class ScriptedEngine:
    """Returns, at call c, the scripted turn ids for each row (an Engine; records every call)."""

    pad_token_id = 0

    def __init__(self, tok, calls: list[list[list[int]]]):
        self.tok, self.script, self.calls = tok, calls, []

    def generate(self, prompts, params: SamplingParams) -> RolloutBatch:
        self.calls.append((prompts, params))
        turns = self.script[len(self.calls) - 1]
        rows = [p for p in prompts for _ in range(params.n)]
        assert len(turns) == len(rows), (len(turns), len(rows))
        B, T = len(rows), max(len(t) for t in turns)
        P = max(len(p) for p in rows)
        ids = torch.zeros(B, T, dtype=torch.long)
        mask = torch.zeros(B, T, dtype=torch.bool)
        pid = torch.zeros(B, P, dtype=torch.long)
        pm = torch.zeros(B, P, dtype=torch.bool)
        for i, (p, t) in enumerate(zip(rows, turns)):
            ids[i, :len(t)], mask[i, :len(t)] = torch.tensor(t), True
            pid[i, P - len(p):], pm[i, P - len(p):] = torch.tensor(p), True
        return RolloutBatch(prompt_ids=pid, prompt_mask=pm, response_ids=ids, response_mask=mask,
                            finish_reason=["stop"] * B, group=torch.arange(B) // params.n,
                            texts=[self.tok.decode(t, skip_special_tokens=True) for t in turns],
                            gen_time_s=0.0, gen_tokens=int(mask.sum()))

    def sync_weights(self, model) -> None:
        pass


class LogpEngine(ScriptedEngine):
    """A scripted engine that also reports the sampler's log-probs: -(k + 1) / 100 for the k-th id of a turn."""

    def generate(self, prompts, params):
        rb = super().generate(prompts, params)
        T = rb.response_ids.shape[1]
        rb.sampler_logp = -(torch.arange(T, dtype=torch.float32) + 1).expand(len(rb), T) / 100 * rb.response_mask
        return rb


class FakeRetriever:
    def __init__(self, fail: bool = False):
        self.batches, self.fail = [], fail

    def search(self, queries, k):
        self.batches.append(list(queries))
        if self.fail:
            raise RetrievalError("connection refused", attempts=3)
        return [[Passage(id=f"{q}-{j}", title=f"T{j} {q}", text=f"text {j} about {q}", score=1.0 - j / 10)
                 for j in range(k)] for q in queries]


EX = Example(prompt="Who wrote it?", answer="Ann", id="q0", meta={"golden_answers": ["Ann"]})


def segments(rb: RolloutBatch, row: int = 0):
    """(policy?, ids) runs of one row's response."""
    ids = rb.response_ids[row][rb.response_mask[row]].tolist()
    pol = rb.loss_mask[row][rb.response_mask[row]].tolist()
    out = []
    for i, p in zip(ids, pol):
        if out and out[-1][0] == p:
            out[-1][1].append(i)
        else:
            out.append((p, [i]))
    return out


def test_one_episode_two_searches_and_an_answer(tok):
    t1 = "<think>hm</think><search>first q</search>"
    t2 = "<search>second q</search>"
    t3 = "<answer> Ann </answer>"
    script = [[char_ids(tok, t1)], [char_ids(tok, t2)], [char_ids(tok, t3)]]
    # the test would not see a re-tokenization otherwise
    assert script[0][0] != tok(t1, add_special_tokens=False)["input_ids"]
    eng, ret = ScriptedEngine(tok, script), FakeRetriever()
    agent = SearchAgent(eng, tok, ret, topk=2, max_searches=4, max_obs_tokens=10_000)
    rb = agent.rollout([EX], SamplingParams(n=1, temperature=1.0, max_new_tokens=64, seed=1))
    segs = segments(rb)
    assert [p for p, _ in segs] == [True, False, True, False, True]
    # the policy's ids exactly as sampled, never re-tokenized
    assert [s for p, s in segs if p] == [script[0][0], script[1][0], script[2][0]]
    # observations: exactly the rendered passages, tokenized and appended
    obs = [tok.decode(s) for p, s in segs if not p]
    assert obs[0] == render_observation(FakeRetriever().search(["first q"], 2)[0])
    assert obs[1] == render_observation(FakeRetriever().search(["second q"], 2)[0])
    assert ret.batches == [["first q"], ["second q"]]
    assert rb.finish_reason == ["stop"] and rb.group.tolist() == [0]
    assert torch.equal(rb.loss_mask & ~rb.response_mask, torch.zeros_like(rb.loss_mask))
    assert rb.texts[0] == tok.decode(rb.response_ids[0][rb.response_mask[0]], skip_special_tokens=True)
    # the prompt is the example's, through the chat template; every turn continues the whole context
    prompt = encode_prompts(tok, [EX])[0]
    assert rb.prompt_ids[0][rb.prompt_mask[0]].tolist() == prompt
    ctx = prompt + sum((s for _, s in segs[:2]), [])
    assert eng.calls[1][0] == [ctx] and eng.calls[1][1].stop == ["</search>", "</answer>"]
    m = agent.metrics()
    assert m["search/em"] == 1 and m["search/f1"] == 1  # "Ann" is EX's golden answer
    assert m["search/searches"] == 2 and m["search/answered_rate"] == 1 and m["search/turns"] == 3
    assert m["search/invalid_action_rate"] == 0 and m["search/obs_tokens"] == sum(len(s) for p, s in segs if not p)
    assert agent.metrics() == {}  # counters reset once read


def test_turn_cap_then_a_final_turn_without_search(tok):
    s = [char_ids(tok, "<search>q</search>")]
    eng, ret = ScriptedEngine(tok, [s, s, s]), FakeRetriever()
    agent = SearchAgent(eng, tok, ret, topk=1, max_searches=2)
    rb = agent.rollout([EX], SamplingParams(n=1, max_new_tokens=64, seed=0))
    assert len(eng.calls) == 3 and len(ret.batches) == 2  # the third search is never executed
    assert eng.calls[2][1].stop == ["</answer>"]  # the final turn cannot stop at </search>
    assert [p for p, _ in segments(rb)] == [True, False, True, False, True]
    assert agent.metrics()["search/answered_rate"] == 0


def test_invalid_action_message_and_observation_truncation(tok):
    eng = ScriptedEngine(tok, [[char_ids(tok, "no tags here")], [char_ids(tok, "<search>q</search>")],
                               [char_ids(tok, "<answer>x</answer>")]])
    agent = SearchAgent(eng, tok, FakeRetriever(), topk=3, max_searches=3, max_obs_tokens=12)
    rb = agent.rollout([EX], SamplingParams(n=1, max_new_tokens=64, seed=0))
    segs = segments(rb)
    assert [p for p, _ in segs] == [True, False, True, False, True]
    invalid = tok(INVALID_ACTION_MESSAGE, add_special_tokens=False)["input_ids"]
    assert len(invalid) > 12 and len(segs[1][1]) == 12  # cut to max_obs_tokens ...
    assert tok.decode(segs[1][1]).endswith("</information>\n\n")  # ... keeping the closing tag
    assert len(segs[3][1]) == 12 and tok.decode(segs[3][1]).endswith("</information>\n\n")
    assert agent.metrics()["search/invalid_action_rate"] == pytest.approx(1 / 3)


def test_context_cap_ends_the_episode(tok):
    prompt_len = len(encode_prompts(tok, [EX])[0])
    turn = char_ids(tok, "<search>q</search>")
    eng = ScriptedEngine(tok, [[turn], [turn]])
    agent = SearchAgent(eng, tok, FakeRetriever(), topk=3, max_searches=4, max_context=prompt_len + len(turn) + 5)
    rb = agent.rollout([EX], SamplingParams(n=1, max_new_tokens=64, seed=0))
    assert rb.finish_reason == ["length"] and len(eng.calls) == 1
    assert int(rb.response_mask.sum()) == len(turn) + 5  # the observation is cut at the cap


def test_context_cap_is_at_most_the_models_context(tok, capsys):
    """Before: max_context (default 4096) above the model's context let an episode run past it silently."""
    from types import SimpleNamespace

    prompt_len = len(encode_prompts(tok, [EX])[0])
    turn = char_ids(tok, "<search>q</search>")
    eng = ScriptedEngine(tok, [[turn], [turn]])
    eng.model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=prompt_len + len(turn) + 5))
    agent = SearchAgent(eng, tok, FakeRetriever(), topk=3, max_searches=4)  # max_context 4096
    assert agent.max_context == prompt_len + len(turn) + 5
    assert "max_context=4096 is more than the model's context" in capsys.readouterr().err
    rb = agent.rollout([EX], SamplingParams(n=1, max_new_tokens=64, seed=0))
    assert rb.finish_reason == ["length"] and int(rb.response_mask.sum()) == len(turn) + 5


def test_batched_episodes_leave_when_done_and_a_failed_search_is_an_observation(tok):
    a, s = char_ids(tok, "<answer>Ann</answer>"), char_ids(tok, "<search>q</search>")
    # 2 examples x n=2: rows 0 and 3 answer at once; rows 1 and 2 search, then answer
    eng = ScriptedEngine(tok, [[a, s, s, a], [a, a]])
    ret = FakeRetriever(fail=True)
    agent = SearchAgent(eng, tok, ret, topk=2, max_searches=4)
    ex2 = Example(prompt="Where?", answer="Paris", id="q1")
    rb = agent.rollout([EX, ex2], SamplingParams(n=2, max_new_tokens=64, seed=0))
    assert len(eng.calls[0][0]) == 2 and eng.calls[0][1].n == 2  # turn 0: each prompt once, n samples
    assert len(eng.calls[1][0]) == 2 and eng.calls[1][1].n == 1  # turn 1: only the two active episodes
    assert ret.batches == [["q", "q"]]  # one batched request for the turn
    assert rb.group.tolist() == [0, 0, 1, 1]
    obs = [tok.decode(seg) for p, seg in segments(rb, 1) if not p]
    assert obs == [render_search_error("connection refused")]
    m = agent.metrics()
    assert m["search/failures"] == 2 and m["search/answered_rate"] == 1
    assert m["search/em"] == 0.5 and m["search/f1"] == 0.5  # "Ann" is right for EX, wrong for ex2 (Paris)


def test_loss_ignores_observation_tokens(tiny_model_dir, tok):
    """Policy loss and KL see only the policy's tokens: with the loss mask fixed, changing the tokens of the
    trailing observation changes neither the loss nor a single gradient, and observation positions get zero
    gradient through their log-probs."""
    from transformers import AutoModelForCausalLM

    from tether.algo import LossInputs, compute_loss
    from tether.config.recipes import recipe
    from tether.logprobs import response_stats

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).float()
    t1, t2 = char_ids(tok, "<search>q</search>"), char_ids(tok, "<search>r</search>")
    prompt_len = len(encode_prompts(tok, [EX])[0])
    obs1 = len(tok(render_observation(FakeRetriever().search(["q"], 1)[0]), add_special_tokens=False)["input_ids"])
    agent = SearchAgent(ScriptedEngine(tok, [[t1], [t2]]), tok, FakeRetriever(), topk=1, max_searches=4,
                        max_context=prompt_len + len(t1) + obs1 + len(t2) + 7)
    rb = agent.rollout([EX], SamplingParams(n=1, max_new_tokens=64, seed=0))
    assert [p for p, _ in segments(rb)] == [True, False, True, False]  # ends on a (cut) observation

    def loss_and_grads(resp_ids):
        model.zero_grad()
        st = response_stats(model, rb.prompt_ids, rb.prompt_mask, resp_ids, rb.response_mask, entropy=False)
        st.logp.retain_grad()
        cfg = recipe("grpo")
        out = compute_loss(cfg, LossInputs(logp=st.logp, mask=rb.loss_mask, adv=torch.tensor([1.0]),
                                           ref_logp=st.logp.detach() - 0.1))
        out.loss.backward()
        return out.loss.item(), [p.grad.clone() for p in model.parameters()], st.logp.grad

    l0, g0, lg = loss_and_grads(rb.response_ids)
    obs = rb.response_mask & ~rb.loss_mask
    assert torch.all(lg[obs] == 0) and torch.any(lg[rb.loss_mask] != 0)
    altered = rb.response_ids.clone()
    last_policy = int(rb.loss_mask[0].nonzero().max())
    tail = torch.arange(altered.shape[1]) > last_policy
    altered[0, tail & rb.response_mask[0]] = 5  # other observation tokens, same mask
    assert not torch.equal(altered, rb.response_ids)
    l1, g1, _ = loss_and_grads(altered)
    assert l1 == l0 and all(torch.equal(a, b) for a, b in zip(g0, g1))


def test_search_training_runs_end_to_end(tiny_model_dir, tmp_path, monkeypatch):
    """tether train in the search environment on the tiny model, BM25 over a small corpus file: metrics of the
    agent per step, whole trajectories in samples.jsonl, and a corpus error before the model loads."""
    import json

    from tether.resolve import load_config
    from tether.train import train

    corpus = tmp_path / "corpus.jsonl"
    with open(corpus, "w") as f:
        for i in range(30):
            contents = f'"Title {i}"\nParagraph number {i} says the answer is {i}.'
            f.write(json.dumps({"id": f"p{i}", "contents": contents}) + "\n")
    data = tmp_path / "qa.jsonl"
    with open(data, "w") as f:
        for i in range(8):
            f.write(json.dumps({"question": f"What does paragraph {i} say?", "golden_answers": [str(i)]}) + "\n")
    over = {"model.name": str(tiny_model_dir), "data.task": str(data),
            "rollout.agent.env.retriever.corpus": str(corpus), "rollout.agent.env.max_turns": 3,
            "rollout.agent.env.max_context": 400, "rollout.max_new_tokens": 16,
            "rollout.prompts_per_step": 2, "rollout.n": 2, "train.steps": 2, "run.progress": False,
            "run.plot": False, "run.save_every": 0}
    cfg = load_config(None, over, recipe_name="ema_pg", task="search")
    assert cfg.rollout.agent.env.name == "search" and cfg.data.format_weight == 0.0
    run = train(cfg, tmp_path / "run", log=lambda *a: None)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for r in rows:
        assert r["search/turns"] >= 1 and 0 <= r["search/answered_rate"] <= 1 and r["skipped_updates"] == 0
        assert r["search/searches"] <= 2 and math.isfinite(r["pg_loss"])
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert samples and all("response" in s for s in samples)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "contents": "x"}\n{"id": 3}\n')
    import tether.models

    monkeypatch.setattr(tether.models, "load_model", lambda *a, **k: pytest.fail("the model loaded first"))
    with pytest.raises(Exception, match=r"bad\.jsonl.*(line )?2"):
        train(load_config(None, {**over, "rollout.agent.env.retriever.corpus": str(bad)}, recipe_name="ema_pg",
                          task="search"),
              tmp_path / "run2", model=None, log=lambda *a: None)


@pytest.mark.slow
def test_real_smollm2_search_training(tmp_path):
    """SmolLM2-135M, 2 steps of ema_pg on the closed-pool multihop set with BM25 over the shared corpus."""
    import json

    from tether.resolve import load_config
    from tether.search.data import search_data_dir
    from tether.train import train

    if search_data_dir() is None:
        pytest.skip("the shared search data (../shared/data/search) is not beside the checkout")
    over = {"train.steps": 2, "rollout.prompts_per_step": 2, "rollout.n": 2, "rollout.max_new_tokens": 48,
            "rollout.agent.env.max_turns": 3, "rollout.agent.env.max_context": 1536, "run.progress": False,
            "run.plot": False, "run.save_every": 0}
    run = train(load_config(None, over, recipe_name="ema_pg", task="search"), tmp_path / "run", log=lambda *a: None)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["skipped_updates"] == 0 and math.isfinite(r["pg_loss"]) for r in rows)
    assert all("search/searches" in r and "search/answered_rate" in r for r in rows)
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert any("<information>" in s["response"] for s in samples) or all(r["search/searches"] == 0 for r in rows)


def test_each_turn_is_capped_by_max_new_tokens(tok):
    s = [char_ids(tok, "<search>q</search>")]
    eng = ScriptedEngine(tok, [s, [char_ids(tok, "<answer>x</answer>")]])
    SearchAgent(eng, tok, FakeRetriever(), max_searches=2).rollout([EX], SamplingParams(n=1, max_new_tokens=37))
    assert [p.max_new_tokens for _, p in eng.calls] == [37, 37]  # rollout.max_new_tokens is the per-turn cap


def test_search_options_that_cannot_act_are_errors():
    from tether.errors import ConfigError
    from tether.resolve import load_config

    for over, msg in (({"rollout.agent.env.retriever.dense_model": "m"}, "dense_model is a key of .*kind=dense"),
                      ({"rollout.agent.env.retriever.timeout": 5.0}, "timeout is a key of .*kind=http"),
                      ({"rollout.agent.env.retriever.retries": 0}, "retries is a key of .*kind=http"),
                      ({"rollout.agent.env.retriever.kind": "http"}, "rollout.agent.env.retriever.url must be set"),
                      ({"rollout.agent.env.retriever.topk": 4, "rollout.agent.env.name": "calculator"},
                       "rollout.agent.env.retriever is a key of rollout.agent.env.name=search, and "
                       "rollout.agent.env.name is 'calculator'")):
        with pytest.raises(ConfigError, match=msg):
            load_config(None, over, task="search")
    r = "rollout.agent.env.retriever."
    load_config(None, {r + "kind": "http", r + "url": "http://127.0.0.1:1", r + "timeout": 5.0}, task="search")
