"""``run.final_checkpoint``: the checkpoint after the last step can be left out (the final weights stay in
memory), which is what ``bench/compare_recipes.py`` needs instead of patching ``Trainer.save``."""

from __future__ import annotations

import json

import pytest

from tether.resolve import load_config
from tether.train import train

REWARD = "def digits(completion, example):\n    return sum(c.isdigit() for c in completion) / max(len(completion), 1)\n"


@pytest.mark.parametrize("final", [True, False])
def test_final_checkpoint_option(final, tiny_model_dir, tmp_path):
    (tmp_path / "rew.py").write_text(REWARD)
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"question": f"Say {i}", "answer": str(i)}) + "\n"
                                              for i in range(8)))
    cfg = load_config(None, {
        "model.name": str(tiny_model_dir), "data.task": str(tmp_path / "p.jsonl"),
        "data.reward": f"{tmp_path / 'rew.py'}:digits", "train.steps": 3, "rollout.max_new_tokens": 4,
        "rollout.prompts_per_step": 2, "rollout.n": 2, "run.progress": False, "run.plot": False,
        "run.exact_kl_samples": 0, "run.save_every": 2, "run.final_checkpoint": final})
    run = train(cfg, tmp_path / "run", log=lambda *a, **k: None)
    steps = sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert steps == (["step-000002", "step-000003"] if final else ["step-000002"])
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 3
