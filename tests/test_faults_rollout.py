"""Fault injection in rollouts and rewards, on the tiny model: a reward that hangs, raises, dies or
returns garbage; NaN / inf logits; a prompt longer than the model's context.

Each test is bounded (a reward hang is cut by ``data.reward_timeout`` of a second) and fast.
"""

from __future__ import annotations

import json

import pytest
import torch

from helpers import rows, run_module, tiny_config
from tether.errors import GenerationError
from tether.models import ModelConfig, load_model
from tether.rollout import HFEngine, SamplingParams
from tether.rollout.hf import _InverseCDFSampler
from tether.tasks.base import Example
from tether.train import build_trainer, train

pytestmark = pytest.mark.faults

REWARDS = '''
import os, time

MARK = os.environ.get("TETHER_TEST_MARK", "")

def hang_once(completion, example):
    """Example 1 hangs (a busy loop: no thread could stop it) the first time it is scored."""
    if example.answer == "1" and not os.path.exists(MARK):
        open(MARK, "w").close()
        while True:
            pass
    return 0.5

GARBAGE = {"0": None, "1": "1.0", "2": float("nan"), "3": (1.0, True), "4": {"reward": 1.0}, "5": float("inf")}

def garbage(completion, example):
    """Rows 0-5 return something that is not a finite number; the others 0.5."""
    return GARBAGE.get(example.answer, 0.5)

def sleepy(completion, example):
    if example.answer == "1":
        time.sleep(1000)
    return 1.0

def dies(completion, example):
    if example.answer == "1":
        os._exit(3)
    return 1.0
'''


@pytest.fixture(scope="module")
def workdir(make_workdir):
    return make_workdir("faults", REWARDS, n_rows=8)


def cfg_for(workdir, tiny_model_dir, steps=1, **over):
    return tiny_config(workdir, tiny_model_dir, "grpo", steps, reward="hang_once",
                       **{"data.shuffle": False, "data.format_weight": 0.0, "train.lr": 1e-3,
                          "rollout.max_new_tokens": 4, "rollout.n": 2, **over})


# ---------------------------------------------------------------- rewards


def test_hanging_reward_times_out_scores_zero_and_training_goes_on(workdir, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TETHER_TEST_MARK", str(tmp_path / "hung"))
    logs = []
    cfg = cfg_for(workdir, tiny_model_dir, steps=2, **{"data.reward_timeout": 1.0})
    run = train(cfg, tmp_path / "run", log=logs.append)
    m = rows(run)
    assert (tmp_path / "hung").exists()  # the reward did hang once
    assert [r["step"] for r in m] == [1, 2] and m[-1]["reward_errors"] == 1  # counted; both steps ran
    assert m[0]["reward_mean"] == pytest.approx(0.5 * 7 / 8)  # the hung call scored 0, the 7 others 0.5
    said = [x for x in logs if "timed out" in str(x)]
    assert len(said) == 1 and "example prompts:1" in said[0] and "data.reward_timeout" in said[0]
    assert "timed out on example prompts:1" in (run / "reward_errors.log").read_text()


def test_reward_returning_garbage_scores_zero_counted_and_logged_once(workdir, tiny_model_dir, tmp_path):
    logs = []
    cfg = cfg_for(workdir, tiny_model_dir, steps=2, **{"data.reward": f"{workdir / 'rew.py'}:garbage"})
    run = train(cfg, tmp_path / "run", log=logs.append)
    m = rows(run)
    # step 1 scores rows 0-3 (None, "1.0", nan, a tuple), step 2 rows 4-7 (a dict, inf, 0.5, 0.5): n = 2 each
    assert m[0]["reward_errors"] == 8 and m[1]["reward_errors"] == 12
    assert m[0]["reward_mean"] == 0.0 and m[1]["reward_mean"] == pytest.approx(0.25)
    said = [x for x in logs if "invalid value" in str(x)]
    assert len(said) == 1 and "example prompts:0" in said[0] and "NoneType (None)" in said[0]
    assert "invalid value on example prompts:0" in (run / "reward_errors.log").read_text()


def test_reward_worker_kinds_of_failure(workdir):
    """A hang in a C call (sleep), a worker that dies, and a good call after each: the worker restarts."""
    from tether.tasks.reward_worker import RewardWorker

    exs = [Example("q", str(i), f"ex:{i}") for i in (0, 1, 2)]
    w = RewardWorker(f"{workdir / 'rew.py'}:sleepy", timeout=0.5)
    rewards, correct, failures = w.score(["a", "b", "c"], exs)
    assert rewards == [1.0, 0.0, 1.0] and correct == [True, False, True]
    assert [(f.example_id, f.kind) for f in failures] == [("ex:1", "timeout")]
    assert w.restarts == 1  # the hung worker was killed; a fresh one scored ex:2
    assert w.score(["a"], exs[:1]) == ([1.0], [True], []) and w.restarts == 1
    w.close()
    w = RewardWorker(f"{workdir / 'rew.py'}:dies", timeout=5)
    rewards, _, failures = w.score(["a", "b", "c"], exs)
    assert rewards == [1.0, 0.0, 1.0]
    assert [(f.example_id, f.kind) for f in failures] == [("ex:1", "crashed")] and "code 3" in failures[0].detail
    w.close()


# ---------------------------------------------------------------- non-finite logits


@pytest.fixture
def tiny(tiny_model_dir):
    return load_model(ModelConfig(name=str(tiny_model_dir)))


def test_nan_weights_stop_training_naming_the_step(workdir, tiny_model_dir, tmp_path):
    cfg = cfg_for(workdir, tiny_model_dir, steps=3, **{"data.reward": f"{workdir / 'rew.py'}:garbage"})
    tr = build_trainer(cfg, tmp_path / "run", log=lambda *a: None)
    tr.train_step()
    with torch.no_grad():
        tr.model.lm_head.weight[5].fill_(float("nan"))  # one vocabulary row: NaN reaches every row's softmax
    with pytest.raises(GenerationError, match=r"trainer step 2: the model's logits are NaN or infinite.*train\.lr"):
        tr.train_step()


@pytest.mark.parametrize("mode", ["greedy", "inverse_cdf", "multinomial"])
def test_inf_logits_in_generation_raise(tiny, mode):
    """A forward hook puts +inf into one row's logits at the 3rd decode step."""
    model, tok = tiny
    calls = {"n": 0}

    def hook(module, args, out):
        calls["n"] += 1
        if calls["n"] == 3:
            out = out.clone()
            out[0, -1, 7] = float("inf")
        return out

    model.lm_head.register_forward_hook(hook)
    eng = HFEngine(model, tok, sampler="multinomial" if mode == "multinomial" else "inverse_cdf", prune_every=0)
    params = SamplingParams(n=2, max_new_tokens=6, greedy=mode == "greedy", temperature=1.0, seed=0,
                            min_new_tokens=6)
    with pytest.raises(GenerationError, match="NaN or infinite"):
        eng.generate([tok("Hello world")["input_ids"], tok("x")["input_ids"]], params)
    assert calls["n"] >= 3


def test_sampler_flags_nan_rows_and_stays_in_the_vocabulary():
    """Before: a NaN row drew index 1023 of a 384-token vocabulary (an IndexError in generate)."""
    s = _InverseCDFSampler()
    scores = torch.randn(3, 384)
    scores[1] = float("nan")
    out = s(None, scores)
    assert out.shape == (3, 384) and torch.isfinite(out.amax(-1)).all()  # one token per row, in range
    assert bool(s.nonfinite)
    s2 = _InverseCDFSampler()
    s2(None, torch.randn(3, 384))
    assert not bool(s2.nonfinite)


def test_cli_train_at_huge_lr_exits_2_with_one_line(workdir, tiny_model_dir, tmp_path):
    r = run_module("train", "--model", str(tiny_model_dir), "--data", str(workdir / "prompts.jsonl"), "--steps", "3",
                   "--output-dir", str(tmp_path / "run"), "train.lr=1e10", "run.progress=false", "run.plot=false",
                   "rollout.max_new_tokens=4", "rollout.prompts_per_step=2", "rollout.n=2",
                   f"data.reward={workdir / 'rew.py'}:garbage")
    assert r.returncode == 2, r.stdout + r.stderr
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("tether: error:")]
    assert len(err) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "trainer step" in err[0] and "NaN or infinite" in err[0] and "train.lr" in err[0]


# ---------------------------------------------------------------- prompts longer than the context


@pytest.fixture(scope="module")
def long_data(tmp_path_factory):
    """Six rows; row 3 is far longer than the tiny model's 1024-token context, row 5 is 20 MB."""
    d = tmp_path_factory.mktemp("long")
    with open(d / "long.jsonl", "w") as f:
        for i in range(6):
            f.write(json.dumps({"question": "word " * 1500 if i == 3 else f"Say {i}", "answer": str(i)}) + "\n")
    with open(d / "huge.jsonl", "w") as f:
        for i in range(3):
            f.write(json.dumps({"question": "word " * 4_000_000 if i == 1 else f"Say {i}", "answer": str(i)}) + "\n")
    return d


def test_overlong_row_fails_before_the_first_step(workdir, long_data, tiny_model_dir, tmp_path):
    cfg = cfg_for(workdir, tiny_model_dir, **{"data.task": str(long_data / "long.jsonl")})
    with pytest.raises(GenerationError, match=r"example long:3: the prompt has \d+ tokens, more than the 1020 "
                                              r"that fit in the model's context \(1024 tokens"):
        build_trainer(cfg, tmp_path / "run", log=lambda *a: None)


def test_overlong_row_at_its_step_names_step_and_row(workdir, long_data, tiny_model_dir, tmp_path):
    """A row the early check cannot see (appended after it) fails at the step that draws it."""
    cfg = cfg_for(workdir, tiny_model_dir, steps=2, **{"data.task": str(long_data / "long.jsonl"),
                                                       "rollout.prompts_per_step": 2, "data.limit": 2})
    tr = build_trainer(cfg, tmp_path / "run", log=lambda *a: None)
    tr.data.examples[1] = Example("word " * 1500, "1", "late:1")
    with pytest.raises(GenerationError, match=r"trainer step 1: example late:1: the prompt has \d+ tokens"):
        tr.train_step()


def test_huge_row_is_rejected_without_tokenizing_it(workdir, long_data, tiny_model_dir, tmp_path):
    """20 MB take about 20 s to tokenize (SmolLM2's tokenizer); the character bound answers at once
    (the message counts characters: the row was never tokenized)."""
    cfg = cfg_for(workdir, tiny_model_dir, **{"data.task": str(long_data / "huge.jsonl")})
    with pytest.raises(GenerationError, match=r"example huge:1: the prompt has 20000000 characters \(so at least"):
        build_trainer(cfg, tmp_path / "run", log=lambda *a: None)


def test_cli_overlong_row_exits_2_before_training(workdir, long_data, tiny_model_dir, tmp_path):
    r = run_module("train", "--model", str(tiny_model_dir), "--data", str(long_data / "long.jsonl"),
                   "--steps", "1", "--output-dir", str(tmp_path / "run"), "run.progress=false", "run.plot=false",
                   "rollout.max_new_tokens=4", f"data.reward={workdir / 'rew.py'}:garbage")
    assert r.returncode == 2, r.stdout + r.stderr
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("tether: error:")]
    assert len(err) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "example long:3: the prompt has" in err[0] and "rollout.prompt_overflow=truncate" in err[0], err[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # no step ran


def test_cli_truncate_trains_and_warns_once(workdir, long_data, tiny_model_dir, tmp_path):
    r = run_module("train", "--model", str(tiny_model_dir), "--data", str(long_data / "long.jsonl"),
                   "--steps", "1", "--output-dir", str(tmp_path / "run"), "run.progress=false", "run.plot=false",
                   "rollout.max_new_tokens=4", "rollout.prompts_per_step=4", "rollout.n=2", "data.shuffle=false",
                   "rollout.prompt_overflow=truncate", f"data.reward={workdir / 'rew.py'}:garbage")
    assert r.returncode == 0, r.stdout + r.stderr
    warned = [ln for ln in r.stderr.splitlines() if "warning: example long:3" in ln]
    assert len(warned) == 1 and "keeping its last 1020 tokens" in warned[0], r.stderr
    assert len(rows(tmp_path / "run")) == 1


def test_cli_eval_bad_reward_spec_and_overlong_prompt_exit_2(workdir, long_data, tiny_model_dir, tmp_path):
    """Before: a reward file with a syntax error ended `tether eval` with a SyntaxError traceback."""
    (tmp_path / "syntax.py").write_text("def fn(c, e):\n    return 1 +\n")
    common = ["eval", "--model", str(tiny_model_dir), "--max-new-tokens", "4", "--no-progress", "--limit", "4"]
    for bench, reward, want in (
            (workdir / "prompts.jsonl", f"{tmp_path / 'syntax.py'}:fn", "syntax.py, line 2: SyntaxError"),
            (long_data / "long.jsonl", f"{workdir / 'rew.py'}:garbage", "example long:3: the prompt has")):
        r = run_module(*common, "--benchmarks", str(bench), "--reward", reward, "--out", str(tmp_path / "ev"))
        assert r.returncode == 2, r.stdout + r.stderr
        err = [ln for ln in r.stderr.splitlines() if ln.startswith("tether: error:")]
        assert len(err) == 1 and "Traceback" not in r.stderr and want in err[0], r.stderr


@pytest.mark.slow  # about 15 s: out of the default suite's 15 minutes, run by CI's slow step
def test_cli_train_bad_reward_spec_exits_2_before_the_model_loads(workdir, tiny_model_dir, tmp_path):
    """Before: a traceback (ValueError, SyntaxError or the module's own exception) and exit 1."""
    (tmp_path / "syntax.py").write_text("def fn(c, e):\n    return 1 +\n")
    (tmp_path / "raises.py").write_text("raise RuntimeError('no verifier here')\n")
    for spec, want in ((f"{tmp_path / 'syntax.py'}:fn", "syntax.py, line 2: SyntaxError"),
                       (f"{tmp_path / 'raises.py'}:fn", "raised RuntimeError: no verifier here"),
                       ("nosuch", "'nosuch'"),  # (the config check may catch it first)
                       ("no_such_module_xyz:fn", "cannot import reward module 'no_such_module_xyz'")):
        r = run_module("train", "--model", str(tiny_model_dir), "--data", str(workdir / "prompts.jsonl"),
                       "--steps", "1", "--output-dir", str(tmp_path / "run"), f"data.reward={spec}")
        assert r.returncode == 2, r.stdout + r.stderr
        err = [ln for ln in r.stderr.splitlines() if ln.startswith("tether: error:")]
        assert len(err) == 1 and "Traceback" not in r.stderr and want in err[0], r.stderr
        assert "loading model" not in r.stdout + r.stderr
