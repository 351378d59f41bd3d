"""bench/_benchutil.py's fixed-length decoding: EOS banned through SamplingParams.min_new_tokens
(the engine from tether.rollout.make_engine), and for a Trainer through rollout.min_new_tokens."""

from __future__ import annotations

import pytest

from tether.models import ModelConfig, load_model
from tether.resolve import load_config
from tether.rollout import SamplingParams
from tether.rollout.hf import HFEngine
from tether.tasks.base import Example
from tether.tasks.prompts import encode_prompts
from tether.train import build_trainer


def eos_eager(model, tok):
    """Make ``model`` put (almost) all its mass on EOS, so only a ban keeps responses going."""
    eos = tok.eos_token_id

    def hook(module, args, out):
        out = out.clone()
        out[..., eos] += 50.0
        return out

    return model.get_output_embeddings().register_forward_hook(hook)


@pytest.fixture(scope="module")
def bu(bench_script):
    return bench_script("_benchutil")


def test_full_length_engine_with_min_new_tokens(bu, tiny_model_dir):
    model, tok = load_model(ModelConfig(name=str(tiny_model_dir)))
    eng = bu.full_length_engine(model, tok, batch_size=3, sampler="multinomial", kv_cache="dynamic")
    assert isinstance(eng, HFEngine) and (eng.batch_size, eng.sampler, eng.kv_cache) == (3, "multinomial", "dynamic")
    prompts = encode_prompts(tok, [Example(prompt=f"say {i}", answer="", id=str(i)) for i in range(2)])
    eos_eager(model, tok)
    assert eng.generate(prompts, SamplingParams(n=2, max_new_tokens=7, seed=0)).response_lengths.tolist() == [1] * 4
    batch = eng.generate(prompts, SamplingParams(n=2, max_new_tokens=7, min_new_tokens=7, seed=0))
    assert batch.response_lengths.tolist() == [7] * 4 and batch.gen_tokens == 28


def test_force_full_length_follows_max_new_tokens(bu, tiny_model_dir, tmp_path):
    cfg = load_config(None, {"model.name": str(tiny_model_dir), "rollout.max_new_tokens": 6,
                             "rollout.prompts_per_step": 2, "rollout.n": 2, "train.steps": 3, "run.progress": False,
                             "run.plot": False, "run.exact_kl_samples": 0, "run.save_every": 0,
                             "run.output_dir": str(tmp_path)}, recipe_name="grpo")
    trainer = build_trainer(cfg, tmp_path / "run", log=lambda *a: None)
    generate = trainer.engine.generate

    def eager_generate(prompts, params):  # EOS-eager while sampling only (the log-prob passes check the head)
        handle = eos_eager(trainer.model, trainer.tokenizer)
        try:
            return generate(prompts, params)
        finally:
            handle.remove()

    trainer.engine.generate = eager_generate
    assert trainer.train_step()["response_len"] == 1
    bu.force_full_length(trainer)
    assert trainer.cfg.rollout.min_new_tokens == 6 and trainer._sampling(0).min_new_tokens == 6
    assert trainer.train_step()["response_len"] == 6
    trainer.cfg.rollout.max_new_tokens = 4
    bu.force_full_length(trainer)
    assert trainer.train_step()["response_len"] == 4


def test_run_child_adds_env_to_the_child_only(bu, tmp_path, monkeypatch):
    """run_child(env=...): the child sees the added variables beside the parent's; the parent's stay as they were
    (bench/vs_trl.py's RUN_ENV, e.g. glibc's MALLOC_MMAP_THRESHOLD_ for one run)."""
    import os

    monkeypatch.setenv("TETHER_PARENT_VAR", "kept")
    script = tmp_path / "child.py"
    script.write_text("import json, os, sys\n"
                      "json.dump({'ok': True, 'added': os.environ.get('TETHER_ADDED'), "
                      "'parent': os.environ.get('TETHER_PARENT_VAR')}, open(sys.argv[1], 'w'))\n")
    res, err = bu.run_child([str(script), str(tmp_path / "r.json")], tmp_path / "log", tmp_path / "r.json",
                            env={"TETHER_ADDED": "1048576"})
    assert err == "" and res["added"] == "1048576" and res["parent"] == "kept"
    assert "TETHER_ADDED" not in os.environ
    res, _ = bu.run_child([str(script), str(tmp_path / "r.json")], tmp_path / "log", tmp_path / "r.json")
    assert res["added"] is None and res["parent"] == "kept"
