"""Tests for tether.eval and `tether eval`: pass@k, maj@n, custom and named benchmarks,
evaluating a run's policy and anchor, and input errors caught before any generation."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tether.cli import main
from tether.eval import (
    EvalError,
    EvalSettings,
    default_ks,
    evaluate,
    evaluate_during_training,
    load_benchmark,
    load_benchmarks,
    majority_vote,
    pass_at_k,
    summarize,
)
from tether.eval.cli import load_eval_model
from tether.resolve import load_config
from tether.tasks.base import DataError
from tether.train import train

REWARDS = '''
from tether.tasks import RewardResult

def judge(completion, example):
    """Correct iff the reference starts with 'yes' (independent of the response)."""
    ok = example.answer.startswith("yes")
    return RewardResult(reward=float(ok), correct=ok, pred=example.answer)

def parity(completion, example):
    """Correct iff the response has an even number of characters; the 'answer' is len % 3."""
    ok = len(completion) % 2 == 0
    return RewardResult(reward=float(ok), correct=ok, pred=str(len(completion) % 3))

def digits(completion, example):
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)
'''

GOLD = ["yes-1", "no-2", "yes-3", "yes-4", "no-5", "no-6"]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("eval")
    (d / "rew.py").write_text(REWARDS)
    (d / "custom.json").write_text(json.dumps(
        [{"q": f"Question number {i}: say something", "gold": g, "extra": i} for i, g in enumerate(GOLD)]))
    with open(d / "prompts.jsonl", "w") as f:
        for i in range(16):
            f.write(json.dumps({"question": f"Say some numbers {i}", "answer": str(i)}) + "\n")
    return d


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    model, tok, desc = load_eval_model(str(tiny_model_dir))
    return model, tok


def agent_for(model, tok, batch_size: int = 64, name: str = "single_turn", **options):
    """The agent `tether eval` builds: make_agent on a transformers engine of ``batch_size`` sequences."""
    from tether.agents import make_agent
    from tether.config import RolloutConfig
    from tether.rollout import make_engine

    return make_agent(name, make_engine(RolloutConfig(batch_size=batch_size), model, tok), tok, **options)


def _train_run(work, tiny_model_dir, run_dir, recipe, steps, **over):
    base = {
        "model.name": str(tiny_model_dir), "data.task": str(work / "prompts.jsonl"),
        "data.reward": f"{work / 'rew.py'}:digits", "train.steps": steps, "train.lr": 1e-2,
        "rollout.max_new_tokens": 6, "rollout.prompts_per_step": 2, "rollout.n": 2,
        "run.progress": False, "run.plot": False, "run.exact_kl_samples": 0, "run.save_every": 0,
    }
    base.update(over)
    return train(load_config(None, base, recipe_name=recipe), run_dir, log=lambda *a: None)


@pytest.fixture(scope="module")
def ema_run(work, tiny_model_dir, tmp_path_factory):
    return _train_run(work, tiny_model_dir, tmp_path_factory.mktemp("runs") / "ema", "ema_pg", 2,
                      **{"algo.anchor.every": 1})


@pytest.fixture(scope="module")
def dapo_run(work, tiny_model_dir, tmp_path_factory):
    return _train_run(work, tiny_model_dir, tmp_path_factory.mktemp("runs") / "dapo", "dapo", 1)


# ------------------------------------------------------------------ pass@k, maj@n


def test_pass_at_k_hand_cases():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(4, 4, 1) == 1.0 and pass_at_k(4, 4, 3) == 1.0
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(5, 2)) == pytest.approx(0.7)
    assert pass_at_k(5, 2, 4) == 1.0  # n - c < k: every 4-subset holds a correct sample
    assert pass_at_k(1000, 1, 1) == pytest.approx(1e-3)
    # large n stays finite and accurate where the binomials would overflow floats
    assert pass_at_k(2000, 3, 1000) == pytest.approx(1 - math.comb(1997, 1000) / math.comb(2000, 1000))
    for bad in [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5), (0, 0, 1)]:
        with pytest.raises(ValueError):
            pass_at_k(*bad)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 6, 8])
def test_pass_at_k_matches_subset_enumeration(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(range(n), k))
            brute = sum(any(i < c for i in s) for s in subsets) / len(subsets)  # samples 0..c-1 correct
            assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)


def test_default_ks():
    assert default_ks(1) == [1] and default_ks(4) == [1, 2, 4] and default_ks(6) == [1, 2, 4, 6]
    assert default_ks(16) == [1, 2, 4, 8, 16]


def test_majority_vote_pools_equivalent_answers():
    v = majority_vote(["0.5", "\\frac{1}{2}", "1/3"], "1/2")
    assert v.answer == "0.5" and v.count == 2 and v.correct and v.clusters == 2
    v = majority_vote(["1/3", "0.5", "\\frac{1}{2}", "\\dfrac{1}{2}"], ["0.5"])
    assert v.answer == "0.5" and v.count == 3 and v.correct
    v = majority_vote(["1,000", "1000", "999", "999.0", "1000.0"], "1000")
    assert v.answer == "1,000" and v.count == 3 and v.correct
    v = majority_vote(["x+1", "1 + x", "2"], "x + 1")  # math-verify pools symbolic forms
    assert v.count == 2 and v.correct


def test_majority_vote_none_and_ties():
    v = majority_vote([None, None, None, "3"], "4")
    assert v.answer == "3" and v.count == 1 and v.index == 3 and not v.correct
    v = majority_vote([None, None], "4")
    assert v.answer is None and not v.correct
    assert majority_vote([None, None], correct=[True, False]).correct  # no vote: the first sample's verdict
    v = majority_vote(["2", "3", "3", "2"], "3")  # tie: first occurrence wins
    assert v.answer == "2" and v.count == 2 and not v.correct
    v = majority_vote(["3", "2", "2", "3"], "3")
    assert v.answer == "3" and v.correct
    v = majority_vote(["5", "7", "7", "9"], "5")  # the plurality beats the first occurrence
    assert v.answer == "7" and not v.correct
    # scored by the reward's per-sample verdicts when no reference is given
    v = majority_vote(["7", "7", "8"], correct=[False, False, True])
    assert v.answer == "7" and not v.correct
    v = majority_vote(["8", "7", "8"], correct=[True, False, True])
    assert v.answer == "8" and v.correct
    assert majority_vote([], "1").answer is None


# ------------------------------------------------------------------ evaluate on the tiny model


def test_evaluate_sampling_metrics_match_rows(work, tiny):
    model, tok = tiny
    b = load_benchmark(str(work / "custom.json"), prompt_key="q", answer_key="gold",
                       reward=f"{work / 'rew.py'}:parity")
    assert [e.answer for e in b.examples] == GOLD and b.name == "custom"
    rng = torch.get_rng_state()
    agent = agent_for(model, tok, 8)
    sampled = EvalSettings(n=4, temperature=1.0, top_p=1.0, max_new_tokens=12, batch_size=8, seed=3)
    res = evaluate(agent, b.examples, b.reward_fn, sampled, show_progress=False)
    assert torch.equal(rng, torch.get_rng_state())  # sampling runs in a forked RNG
    m, rows = res.metrics, res.per_problem
    assert [r["id"] for r in rows] == [e.id for e in b.examples]
    assert m["n_problems"] == 6 and m["n_samples"] == 4 and m["n_responses"] == 24
    assert set(m) >= {"avg@4", "pass@1", "pass@2", "pass@4", "maj@4", "mean_response_tokens",
                      "truncation_rate", "wall_time_s", "tokens_per_s", "gen_tokens"}
    for r in rows:
        assert len(r["responses"]) == len(r["correct"]) == len(r["lengths"]) == len(r["finish_reasons"]) == 4
        assert r["correct"] == [len(t) % 2 == 0 for t in r["responses"]]
        assert r["preds"] == [str(len(t) % 3) for t in r["responses"]]
        assert all(1 <= x <= 12 for x in r["lengths"])
        v = majority_vote(r["preds"], correct=r["correct"])
        assert (r["maj_answer"], r["maj_correct"]) == (v.answer, v.correct)
    flat = [c for r in rows for c in r["correct"]]
    assert m["avg@4"] == pytest.approx(sum(flat) / 24)
    assert m["pass@1"] == pytest.approx(m["avg@4"])
    for k in (2, 4):
        assert m[f"pass@{k}"] == pytest.approx(sum(pass_at_k(4, sum(r["correct"]), k) for r in rows) / 6)
    assert m["maj@4"] == pytest.approx(sum(r["maj_correct"] for r in rows) / 6)
    assert m["mean_response_tokens"] == pytest.approx(sum(x for r in rows for x in r["lengths"]) / 24)
    trunc = sum(f == "length" for r in rows for f in r["finish_reasons"]) / 24
    assert m["truncation_rate"] == pytest.approx(trunc)
    assert m["gen_tokens"] == sum(x for r in rows for x in r["lengths"])
    assert m == pytest.approx(summarize(rows, 4) | {k: m[k] for k in m if k not in summarize(rows, 4)})
    # same seed and batch size -> same responses; another seed -> (almost surely) different ones
    again = evaluate(agent_for(model, tok, 8), b.examples, b.reward_fn, sampled, show_progress=False)
    assert [r["responses"] for r in again.per_problem] == [r["responses"] for r in rows]
    other = evaluate(agent, b.examples, b.reward_fn, dataclasses.replace(sampled, seed=4), show_progress=False)
    assert [r["responses"] for r in other.per_problem] != [r["responses"] for r in rows]


def test_greedy_settings_are_checked(work, tiny):
    model, tok = tiny
    ex = load_benchmark(str(work / "custom.json"), prompt_key="q", answer_key="gold").examples
    agent = agent_for(model, tok, 4)
    with pytest.raises(EvalError, match="greedy"):
        evaluate(agent, ex, "math", EvalSettings(n=4, temperature=1.0, max_new_tokens=4, greedy=True, batch_size=4),
                 show_progress=False)
    with pytest.raises(EvalError, match="1 <= k <= n"):
        evaluate(agent, ex, "math", EvalSettings(n=2, temperature=1.0, max_new_tokens=4, batch_size=4, ks=[4]),
                 show_progress=False)
    with pytest.raises(EvalError, match="unknown eval setting"):
        evaluate(agent, ex, "math", {"max_tokens": 4}, show_progress=False)
    res = evaluate(agent, ex, "math", EvalSettings(n=1, temperature=0.7, max_new_tokens=4, greedy=True, batch_size=4),
                   show_progress=False)
    assert res.settings["temperature"] == 0.0 and res.settings["n"] == 1 and "avg@1" in res.metrics


@pytest.mark.parametrize("flags,msg", [(["--n", "0"], "--n must be >= 1, got 0"),
                                       (["--top-p", "2"], "--top-p must be in (0, 1], got 2.0"),
                                       (["--temperature", "-1"],
                                        "--temperature must be a finite number >= 0, got -1.0"),
                                       (["--limit", "0"], "--limit must be >= 1, got 0"),
                                       (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
                                       (["--max-new-tokens", "-3"], "--max-new-tokens must be >= 1, got -3")])
def test_cli_sampling_errors_name_the_option(flags, msg, tmp_path, capsys):
    """The CLI's sampling checks name its options (--n, --top-p), before any file or model is read; each flag's
    range is its key's declared one."""
    from tether.cli import main

    assert main(["eval", "--model", str(tmp_path / "none"), "--benchmarks", "gsm8k", *flags]) == 2
    assert capsys.readouterr().err.strip() == f"tether: error: {msg}"


def test_cli_custom_benchmark_greedy(work, tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["eval", "--model", str(tiny_model_dir), "--benchmarks", str(work / "custom.json"),
               "--prompt-key", "q", "--answer-key", "gold", "--reward", f"{work / 'rew.py'}:judge",
               "--greedy", "--max-new-tokens", "8", "--batch-size", "4", "--out", str(out), "--no-progress"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "custom" in printed and "avg@1" in printed and "maj@1" in printed
    res = json.loads((out / "results.json").read_text())
    assert res["settings"]["greedy"] and res["settings"]["n"] == 1 and res["settings"]["temperature"] == 0
    m = res["benchmarks"]["custom"]["metrics"]
    assert m["n_problems"] == 6 and m["n_samples"] == 1
    assert m["avg@1"] == m["pass@1"] == m["maj@1"] == pytest.approx(3 / 6)
    rows = [json.loads(x) for x in (out / "custom.jsonl").read_text().splitlines()]
    assert [r["answer"] for r in rows] == GOLD
    assert [r["correct"] for r in rows] == [[g.startswith("yes")] for g in GOLD]
    assert all(len(r["responses"]) == 1 and r["preds"] == [r["answer"]] for r in rows)
    # greedy is deterministic: a second run writes the same responses
    out2 = tmp_path / "out2"
    assert main(["eval", "--model", str(tiny_model_dir), "--benchmarks", str(work / "custom.json"),
                 "--prompt-key", "q", "--answer-key", "gold", "--reward", f"{work / 'rew.py'}:judge",
                 "--greedy", "--max-new-tokens", "8", "--batch-size", "3", "--out", str(out2), "--no-progress"]) == 0
    rows2 = [json.loads(x) for x in (out2 / "custom.jsonl").read_text().splitlines()]
    assert [r["responses"] for r in rows2] == [r["responses"] for r in rows]


def test_eval_generates_through_the_rollout_builder(work, tiny, tiny_model_dir, tmp_path, monkeypatch):
    """`tether eval` builds the engine (tether.rollout.ENGINES) and the agent (tether.agents.AGENTS) once per run
    with tether.agents.build.build_rollout, from the config its flags make (as training builds them: the agent
    gets the same options), and evaluate() runs every episode through the agent it is given."""
    import tether.agents
    import tether.rollout
    from tether.agents import SingleTurnAgent

    calls = {"engines": [], "rollouts": [], "system_prompts": []}
    real_hf = tether.rollout.ENGINES["hf"]

    def counting_hf(cfg, model, tokenizer, **overrides):
        calls["engines"].append(cfg.batch_size)
        return real_hf(cfg, model, tokenizer, **overrides)

    class CountingAgent(SingleTurnAgent):
        def __init__(self, engine, tokenizer, system_prompt="", prompt_overflow="error", tag="default"):
            super().__init__(engine, tokenizer, system_prompt, prompt_overflow)
            self.tag, self.episodes = tag, 0
            calls["system_prompts"].append(system_prompt)

        def rollout(self, examples, params):
            calls["rollouts"].append((self.tag, len(examples), params.n))
            self.episodes += len(examples) * params.n
            return super().rollout(examples, params)

        def metrics(self):  # since the last call, as the Agent protocol says
            n, self.episodes = self.episodes, 0
            return {"episodes": n}

    monkeypatch.setitem(tether.rollout.ENGINES, "hf", counting_hf)
    monkeypatch.setitem(tether.agents.AGENTS._items, "single_turn", CountingAgent)  # the default agent
    out = tmp_path / "out"
    assert main(["eval", "--model", str(tiny_model_dir), "--benchmarks", str(work / "custom.json"),
                 "--prompt-key", "q", "--answer-key", "gold", "--reward", f"{work / 'rew.py'}:judge", "--n", "2",
                 "--max-new-tokens", "4", "--batch-size", "4", "--system-prompt", "Be brief.", "--out", str(out),
                 "--no-progress"]) == 0
    assert calls["engines"] == [4] and calls["system_prompts"] == ["Be brief."]
    assert [r[0] for r in calls["rollouts"]] == ["default"] * 3  # 6 problems, 4 // 2 = 2 per chunk
    assert sum(r[1] for r in calls["rollouts"]) == len(GOLD) and {r[2] for r in calls["rollouts"]} == {2}
    res = json.loads((out / "results.json").read_text())
    assert res["benchmarks"]["custom"]["metrics"]["agent/episodes"] == 2 * len(GOLD)

    # two benchmarks: one engine and one agent for the run
    calls["engines"].clear(), calls["rollouts"].clear(), calls["system_prompts"].clear()
    shutil.copy(work / "custom.json", tmp_path / "again.json")
    assert main(["eval", "--model", str(tiny_model_dir), "--benchmarks", str(work / "custom.json"),
                 str(tmp_path / "again.json"), "--prompt-key", "q", "--answer-key", "gold", "--reward",
                 f"{work / 'rew.py'}:judge", "--greedy", "--max-new-tokens", "4", "--batch-size", "4", "--limit", "2",
                 "--out", str(tmp_path / "two"), "--no-progress"]) == 0
    assert calls["engines"] == [4] and calls["system_prompts"] == [""] and len(calls["rollouts"]) == 2
    res = json.loads((tmp_path / "two" / "results.json").read_text())
    assert [b["metrics"]["agent/episodes"] for b in res["benchmarks"].values()] == [2, 2]  # each its own

    # an agent with options, built by the caller, through the Python API
    monkeypatch.setitem(tether.agents.AGENTS._items, "counting_test", CountingAgent)
    model, tok = tiny
    ex = load_benchmark(str(work / "custom.json"), prompt_key="q", answer_key="gold").examples
    calls["rollouts"].clear()
    agent = agent_for(model, tok, 8, "counting_test", tag="search")
    agent.episodes = 5  # counters from before the evaluation are not its own: evaluate() drops them first
    r = evaluate(agent, ex, f"{work / 'rew.py'}:judge", EvalSettings(max_new_tokens=4, batch_size=8),
                 show_progress=False)
    assert calls["rollouts"] == [("search", len(GOLD), 1)] and calls["engines"][-1] == 8
    assert r.settings["agent"] == "CountingAgent" and r.settings["engine"] == "HFEngine"
    assert r.metrics["agent/episodes"] == len(GOLD)


def test_evaluate_during_training(work, tiny):
    model, tok = tiny
    model.train()
    ex = load_benchmark(str(work / "custom.json"), prompt_key="q", answer_key="gold").examples
    agent = agent_for(model, tok, 4)
    out = evaluate_during_training(agent, {"custom": ex}, {"custom": f"{work / 'rew.py'}:judge"},
                                   {"max_new_tokens": 4, "batch_size": 4})
    assert out["eval/custom/avg@1"] == pytest.approx(0.5) and out["eval/custom/n_problems"] == 6
    assert all(k.startswith("eval/custom/") and isinstance(v, float) for k, v in out.items())
    assert model.training  # mode restored
    model.eval()
    with pytest.raises(EvalError, match="unknown eval setting"):
        evaluate_during_training(agent, {"custom": ex}, "math", {"max_tokens": 4})


# ------------------------------------------------------------------ runs, checkpoints, anchors


def test_eval_run_anchor_and_policy(ema_run, work):
    ckpt = ema_run / "checkpoints" / "step-000002"
    assert ckpt.is_dir()
    anchor_t = load_file(str(ckpt / "anchor.safetensors"))
    policy_t = load_file(str(ckpt / "policy.safetensors"))
    am, tok, desc = load_eval_model(ema_run, anchor=True)
    assert "anchor" in desc and "step 2" in desc
    named = dict(am.named_parameters())
    assert set(anchor_t) <= set(named)
    for k, t in anchor_t.items():
        assert torch.equal(named[k], t.to(named[k].dtype)), k
    pm, _, pdesc = load_eval_model(ema_run, anchor=False)
    pnamed = dict(pm.named_parameters())
    for k, t in policy_t.items():
        assert torch.equal(pnamed[k], t), k
    assert "policy" in pdesc
    assert any(not torch.equal(named[k], pnamed[k]) for k in anchor_t)  # the EMA lags the policy
    # a checkpoint directory works too
    cm, _, cdesc = load_eval_model(ckpt, anchor=True)
    assert all(torch.equal(p, named[k]) for k, p in cm.named_parameters())
    # and the anchor can be evaluated
    ex = load_benchmark(str(work / "custom.json"), prompt_key="q", answer_key="gold").examples[:2]
    res = evaluate(agent_for(am, tok, 4), ex, f"{work / 'rew.py'}:judge",
                   EvalSettings(n=2, temperature=1.0, max_new_tokens=4, batch_size=4), show_progress=False)
    assert res.metrics["n_problems"] == 2 and res.metrics["avg@2"] == pytest.approx(0.5)


def test_eval_lora_run_anchor(work, tiny_model_dir, tmp_path):
    run = _train_run(work, tiny_model_dir, tmp_path / "lora", "ema_pg", 1,
                     **{"algo.anchor.every": 1, "model.lora_r": 4, "model.lora_target_modules": ["q_proj", "v_proj"]})
    ckpt = run / "checkpoints" / "step-000001"
    anchor_t = load_file(str(ckpt / "anchor.safetensors"))
    assert anchor_t and all("lora_" in k for k in anchor_t)
    am, tok, desc = load_eval_model(run, anchor=True, merge_lora=False)
    named = dict(am.named_parameters())
    for k, t in anchor_t.items():
        assert torch.equal(named[k], t), k
    merged, _, _ = load_eval_model(run, anchor=True)  # adapters folded into the base weights
    assert not any("lora_" in k for k, _ in merged.named_parameters()) and "LoRA r=4" in desc
    ids = torch.tensor([tok("What is 2 + 2?")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, am(input_ids=ids).logits, rtol=1e-4, atol=1e-4)


def test_eval_run_errors(ema_run, dapo_run, tiny_model_dir, tmp_path, work, capsys):
    with pytest.raises(EvalError, match=r"no anchor.*no KL term"):
        load_eval_model(dapo_run, anchor=True)
    load_eval_model(dapo_run)  # its policy is fine
    with pytest.raises(EvalError, match="needs a training run"):
        load_eval_model(str(tiny_model_dir), anchor=True)
    empty = tmp_path / "empty_run"
    empty.mkdir()
    shutil.copy(ema_run / "config.yaml", empty / "config.yaml")
    (empty / "checkpoints").mkdir()
    with pytest.raises(EvalError, match="cannot evaluate .* has no checkpoint"):
        load_eval_model(empty)
    rc = main(["eval", "--model", str(dapo_run), "--anchor", "--benchmarks", str(work / "custom.json"),
               "--prompt-key", "q", "--answer-key", "gold", "--out", str(tmp_path / "o"), "--no-progress"])
    assert rc == 2 and "no anchor" in capsys.readouterr().err
    rc = main(["eval", "--model", str(tiny_model_dir), "--greedy", "--n", "4", "--benchmarks", "gsm8k"])
    assert rc == 2 and "--greedy" in capsys.readouterr().err


def test_malformed_row_fails_before_model_and_generation(work, tmp_path, monkeypatch, capsys):
    import tether.eval.cli as ev
    import tether.models

    bad = tmp_path / "broken.jsonl"
    bad.write_text('{"q": "fine", "gold": "1"}\n\n{"q": "no answer here"}\n')
    fail = lambda *a, **k: pytest.fail("model loaded or generation started before the data check")  # noqa: E731
    monkeypatch.setattr(ev, "load_eval_model", fail)
    monkeypatch.setattr(ev, "evaluate", fail)
    monkeypatch.setattr(tether.models, "load_model", fail)
    with pytest.raises(DataError, match=r"broken.jsonl row 3.*'gold'"):
        load_benchmarks([str(work / "custom.json"), str(bad)], prompt_key="q", answer_key="gold")
    # the good benchmark comes first: it is not evaluated before the bad one is found
    rc = main(["eval", "--model", "smollm2", "--benchmarks", str(work / "custom.json"), str(bad),
               "--prompt-key", "q", "--answer-key", "gold", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "tether: error:" in err and "broken.jsonl row 3" in err and "'gold'" in err
    assert not (tmp_path / "o").exists()
    rc = main(["eval", "--model", "smollm2", "--benchmarks", str(work / "custom.json"), "--prompt-key", "q",
               "--answer-key", "gold", "--reward", "no_such_reward"])
    assert rc == 2 and "unknown reward" in capsys.readouterr().err


def _shared_data_dir() -> Path | None:
    env = os.environ.get("TETHER_DATA_DIR")
    for d in ([Path(env)] if env else []) + [Path(__file__).resolve().parents[1].parent / "shared" / "data" / "math"]:
        if (d / "gsm8k_test.jsonl").is_file():
            return d
    return None


def test_named_gsm8k_plumbing(tiny_model_dir, tmp_path):
    d = _shared_data_dir()
    if d is None:
        pytest.skip("no shared data dir with gsm8k_test.jsonl ($TETHER_DATA_DIR or ../shared/data/math)")
    out = tmp_path / "g"
    assert main(["eval", "--model", str(tiny_model_dir), "--benchmarks", "gsm8k", "--limit", "3", "--data-dir",
                 str(d), "--n", "2", "--max-new-tokens", "6", "--out", str(out), "--no-progress"]) == 0
    res = json.loads((out / "results.json").read_text())
    g = res["benchmarks"]["gsm8k"]
    assert g["split"] == "test" and g["reward"] == "gsm8k" and g["metrics"]["n_problems"] == 3
    assert set(g["metrics"]) >= {"avg@2", "pass@1", "pass@2", "maj@2"}
    rows = [json.loads(x) for x in (out / "gsm8k.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ["gsm8k_test:0", "gsm8k_test:1", "gsm8k_test:2"]
    assert all(len(r["responses"]) == 2 for r in rows)


def test_held_out_evaluation_runs_through_the_trainers_agent_and_engine(tiny_model_dir, tmp_path, monkeypatch):
    """The trainer's held-out evaluation (tether.eval.held_out.HeldOut) samples with the trainer's own agent
    and engine (so rollout.engine=vllm evaluates with vLLM); with eval.anchor the engine is given the
    anchor's weights for the anchor's evaluation and the policy's back after it (a no-op for
    transformers, a reload for vLLM's copy). It stops at the training rollouts' stop strings."""
    from tether.train import build_trainer

    cfg = load_config(None, {
        "model.name": str(tiny_model_dir), "data.task": "arithmetic", "train.steps": 1, "train.lr": 1e-2,
        "rollout.max_new_tokens": 4, "rollout.prompts_per_step": 2, "rollout.n": 2, "run.progress": False,
        "run.plot": False, "run.exact_kl_samples": 0, "run.save_every": 0, "eval.limit": 3, "eval.max_new_tokens": 4,
        "eval.anchor": True, "algo.anchor.every": 1, "rollout.stop": ["\n\n"]}, recipe_name="ema_pg")
    trainer = build_trainer(cfg, tmp_path / "run", log=lambda *a: None)
    rollouts, synced, stops = [], [], set()
    real_rollout = trainer.agent.rollout

    def rollout(examples, params):
        rollouts.append(("eval" if params.greedy else "train", len(examples)))
        stops.add(tuple(params.stop))
        return real_rollout(examples, params)

    def weights(model) -> float:
        return sum(float(p.detach().double().sum()) for p in model.parameters())

    monkeypatch.setattr(trainer.agent, "rollout", rollout)
    monkeypatch.setattr(trainer.engine, "sync_weights", lambda model: synced.append(weights(model)))
    trainer.run()
    # before training: policy, anchor (3 problems each); step 1: training; after it: policy, anchor
    assert rollouts == [("eval", 3)] * 2 + [("train", 2)] + [("eval", 3)] * 2
    assert stops == {("\n\n",)}  # training's and every evaluation's
    policy = weights(trainer.model)
    # syncs: anchor and policy back (before), the step's, anchor and policy back (after)
    assert len(synced) == 5 and synced[2:5:2] == [policy, policy] and synced[3] != policy
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["eval/arithmetic/n_problems"] == rows[-1]["eval_anchor/arithmetic/n_problems"] == 3


def test_benchmark_prefixes_name_their_loaders_by_module_and_function():
    """The table of environment-held benchmarks is its module's own ("module:function", imported on use): no module
    adds to it on import, and each entry names an importable loader (``verifiers:``, tether.envs.verifiers)."""
    import importlib

    from tether.envs import verifiers
    from tether.tasks.benchmarks import BENCHMARK_PREFIXES

    assert BENCHMARK_PREFIXES == {verifiers.PREFIX: "tether.envs.verifiers:eval_benchmark"}
    for target in BENCHMARK_PREFIXES.values():
        module, _, function = target.partition(":")
        assert callable(getattr(importlib.import_module(module), function))


def test_arithmetic_benchmark_is_the_runs_held_out_split(tiny_model_dir, tmp_path):
    """``arithmetic-dN`` is the synthetic task's test split at difficulty N (seed 0): the very problems a
    ``train.seed=0`` run at ``data.difficulty=N`` evaluates on, so a model is comparable across the two."""
    from tether.tasks.benchmarks import load_benchmark
    from tether.tasks.stream import held_out_sets

    cfg = load_config(overrides={"data.task": "arithmetic", "data.difficulty": 3, "train.seed": 0, "eval.limit": 7})
    ex, _ = held_out_sets(cfg, ["arithmetic"])["arithmetic"]
    b = load_benchmark("arithmetic-d3", limit=7)
    assert b.name == "arithmetic_d3" and b.split == "test" and b.reward == "arithmetic"
    assert [(e.prompt, e.answer) for e in b.examples] == [(e.prompt, e.answer) for e in ex]
    assert [e.prompt for e in load_benchmark("arithmetic", limit=3).examples] != [e.prompt for e in b.examples[:3]]
    with pytest.raises(EvalError, match="arithmetic-d9"):
        load_benchmark("arithmetic-d9")
    out = tmp_path / "out"
    assert main(["eval", "--model", str(tiny_model_dir), "--benchmarks", "arithmetic-d2", "--limit", "3", "--greedy",
                 "--max-new-tokens", "4", "--out", str(out), "--no-progress"]) == 0
    m = json.loads((out / "results.json").read_text())["benchmarks"]["arithmetic_d2"]["metrics"]
    assert m["n_problems"] == 3
