"""bench/tune_regime.py on the tiny random model: it trains, evaluates the validation slice (the
arithmetic *train* split, seed 10000) before the first step and every --every steps, and never
evaluates the test split."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def tune(bench_script):
    return bench_script("tune_regime")


def test_tune_regime_validates_on_the_train_split(tune, tiny_model_dir, tmp_path, monkeypatch):
    import tether.train
    from tether.eval import runner
    from tether.tasks.arithmetic import ArithmeticTask

    seen, trainers = [], []
    real = runner.evaluate_during_training

    class Recorded(tether.train.Trainer):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            trainers.append(self)

    monkeypatch.setattr(tether.train, "Trainer", Recorded)

    def spy(agent, examples, rewards, settings):
        assert agent is trainers[0].agent  # the trainer's own agent (and engine): validated as training samples
        seen.extend(e for ex in examples.values() for e in ex)
        return real(agent, examples, rewards, settings)

    monkeypatch.setattr(runner, "evaluate_during_training", spy)
    out = tmp_path / "run"
    rc = tune.main([str(out), "--recipe", "grpo", f"model.name={tiny_model_dir}", "train.steps=3", "rollout.n=2",
                    "rollout.prompts_per_step=2", "rollout.max_new_tokens=4", "run.save_every=0",
                    "--every", "2", "--val", "3", "--eval-tokens", "4"])
    assert rc == 0
    rows = [json.loads(ln) for ln in (out / "tune.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 3]
    assert [("val_avg@1" in r) for r in rows] == [True, False, True, False, True]
    assert all("reward_mean" in r for r in rows[1:4])
    val = ArithmeticTask(seed=tune.VAL_SEED, difficulty=1, split="train").examples(3)
    assert len(seen) == 3 * 3 and {e.prompt for e in seen} == {e.prompt for e in val}
    test = {e.prompt for e in ArithmeticTask(seed=0, difficulty=1, split="test").examples(200)}
    assert not test & {e.prompt for e in seen}


def test_tune_regime_refuses_another_task(tune, tmp_path):
    with pytest.raises(SystemExit):
        tune.main([str(tmp_path / "r"), "data.task=gsm8k"])
