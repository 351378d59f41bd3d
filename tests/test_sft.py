"""tether sft on a tiny random model: the loss falls, micro-batching and packing leave the gradient as it
is, a stopped run resumes exactly, LoRA runs chain, and an SFT run is a model for tether train / eval /
export (end to end through the CLI)."""

from __future__ import annotations

import json
import os
import shutil
import signal

import pytest
import torch
from safetensors.torch import load_file

from helpers import DIGITS, assert_clean_error, cli_args, rows, run_module, strip
from tether.errors import ConfigError, RunError
from tether.models import ModelConfig, load_model
from tether.resolve.sft import load_sft_config, sft_reference
from tether.rundir.checkpoint import latest_checkpoint
from tether.rundir.owned import read_marker, write_marker
from tether.sft import SFTTrainer, resume_sft, resume_sft_config, sft

QUIET = {"run.progress": False, "run.plot": False}


def conversations(n: int = 24) -> list[dict]:
    """Rows of all three shapes: prompt / completion, a raw trajectory with a masked observation, multi-turn chat."""
    out = []
    for i in range(n):
        if i % 3 == 0:
            out.append({"prompt": f"What is {i} + {i}?", "completion": f"The answer is {2 * i}."})
        elif i % 3 == 1:
            out.append({"messages": [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": f"Say some numbers {i}"},
                {"role": "assistant", "content": [{"text": "<search> numbers </search>", "train": True},
                                                  {"text": f"<information> {i} {i + 1} </information>", "train": False},
                                                  {"text": f"<answer> {i} </answer>", "train": True}]}]})
        else:
            out.append({"messages": [{"role": "user", "content": "Hello there."},
                                     {"role": "assistant", "content": "Hello world!"},
                                     {"role": "tool", "content": f"{i}"},
                                     {"role": "assistant", "content": f"{i} apples are left."}]})
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("sft_data")
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in conversations()))
    return d / "train.jsonl"


def settings(data, model_dir, **over) -> dict:
    return {"model.name": str(model_dir), "data.path": str(data), "train.batch_size": 4, "train.micro_batch_size": 2,
            "train.lr": 1e-2, **QUIET, **over}


def config(data, model_dir, **over):
    return load_sft_config(None, settings(data, model_dir, **over))


def policy(run) -> dict:
    return load_file(str(latest_checkpoint(run) / "policy.safetensors"))


def test_sft_lowers_the_loss_and_reports_the_validation_loss(data, tiny_model_dir, tmp_path):
    run = sft(config(data, tiny_model_dir, **{"train.epochs": 4, "data.val_fraction": 0.25, "train.val_every": 5}),
              tmp_path / "run", log=lambda *a: None)
    m = rows(run)
    assert [r["step"] for r in m] == list(range(0, 21))  # 18 rows in batches of 4: 5 steps a pass; 0 = before
    assert set(m[0]) == {"step", "val_loss", "val_tokens", "time_val_s"}
    val = [r["val_loss"] for r in m if "val_loss" in r]
    assert [r["step"] for r in m if "val_loss" in r] == [0, 5, 10, 15, 20] and val[-1] < val[0] - 1.0
    train = [r["loss"] for r in m[1:]]
    assert sum(train[-5:]) / 5 < sum(train[:5]) / 5 - 1.0
    assert m[-1]["epoch"] == 4 and all(r["skipped_updates"] == 0 for r in m[1:])
    assert m[1]["sequences"] == 4 and sum(r["sequences"] for r in m[1:6]) == 18  # the last batch of a pass: 2
    assert read_marker(run)["kind"] == "sft" and not (run / "samples.jsonl").exists()
    assert latest_checkpoint(run).name == "step-000020"  # the last step always writes one


def _grads(trainer, rows_) -> list[torch.Tensor]:
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.backward(rows_)
    return [p.grad.clone() for p in trainer.params]


@pytest.mark.parametrize("other", [{"train.micro_batch_size": 1}, {"train.batching": "packed"}])
def test_micro_batches_and_packing_do_not_change_the_gradient(other, data, tiny_model_dir, tmp_path):
    """The gradient of one batch of 8 conversations: 2 micro-batches of 4 (padded) against 8 of 1, and against
    packed rows (no padding, positions restarting per conversation), to 1e-6."""
    base = SFTTrainer(config(data, tiny_model_dir, **{"train.batch_size": 8, "train.micro_batch_size": 4}),
                      tmp_path / "a", log=lambda *a: None)
    ref = _grads(base, base.plan.batch(0))
    cfg = config(data, tiny_model_dir, **{"train.batch_size": 8, "train.micro_batch_size": 4, **other})
    t = SFTTrainer(cfg, tmp_path / "b", model=base.model, tokenizer=base.tokenizer, log=lambda *a: None)
    got = _grads(t, base.plan.batch(0))
    assert max(float((a - b).abs().max()) for a, b in zip(ref, got)) < 1e-6
    assert max(float(a.abs().max()) for a in ref) > 1e-2  # a real gradient, not zeros


def test_packing_is_refused_when_the_attention_mixes_conversations(data, tiny_model_dir, tmp_path, monkeypatch):
    """Without transformers' packed-sequence detection, packed rows would attend across conversations: the
    check at the start compares with the padded forward and refuses."""
    import transformers.masking_utils as mu

    monkeypatch.setattr(mu, "find_packed_sequence_indices", lambda position_ids: None)
    with pytest.raises(ConfigError, match="train.batching=packed: this model's attention does not keep packed"):
        SFTTrainer(config(data, tiny_model_dir, **{"train.batching": "packed"}), tmp_path / "r", log=lambda *a: None)


def test_stop_by_signal_then_resume_equals_an_uninterrupted_run(data, tiny_model_dir, tmp_path, monkeypatch):
    """SIGTERM during step 3 of 8 (cosine LR, length-grouped batches over two passes): the step finishes, a
    checkpoint is written, and the resumed run ends with the uninterrupted run's metrics and weights (1e-6)."""
    over = {"train.steps": 8, "train.batching": "length_grouped", "data.val_fraction": 0.2, "train.val_every": 3,
            "run.save_every": 0}
    full = sft(config(data, tiny_model_dir, **over), tmp_path / "full", log=lambda *a: None)
    step = SFTTrainer.train_step

    def signalling(self):
        if self.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return step(self)

    monkeypatch.setattr(SFTTrainer, "train_step", signalling)
    part = sft(config(data, tiny_model_dir, **over), tmp_path / "part", log=lambda *a: None)
    monkeypatch.undo()
    assert [r["step"] for r in rows(part)] == [0, 1, 2, 3] and latest_checkpoint(part).name == "step-000003"
    resume_sft(part, log=lambda *a: None)
    assert [strip(r) for r in rows(part)] == [strip(r) for r in rows(full)]
    a, b = policy(full), policy(part)
    assert a.keys() == b.keys() and max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6


def test_resume_after_a_kill_is_exact(data, tiny_model_dir, tmp_path):
    """What kill -9 in step 6's checkpoint write leaves (step 5's row logged and a torn row after it, a partial
    temporary checkpoint, the newest complete checkpoint at step 4): the resumed run equals the uninterrupted one."""
    over = {"train.steps": 6, "run.save_every": 2, "run.keep_checkpoints": -1, "data.val_fraction": 0.2}
    full = sft(config(data, tiny_model_dir, **over), tmp_path / "full", log=lambda *a: None)
    killed = shutil.copytree(full, tmp_path / "killed")
    shutil.rmtree(killed / "checkpoints" / "step-000006")
    (killed / "checkpoints" / "latest").write_text("step-000004\n")
    partial = killed / "checkpoints" / "step-000006.tmp-999999999"  # a writer that is gone
    partial.mkdir()
    (partial / "policy.safetensors").write_bytes(b"\0" * 64)
    lines = (killed / "metrics.jsonl").read_text().splitlines(keepends=True)
    (killed / "metrics.jsonl").write_text("".join(lines[:6]) + lines[6][:20])  # steps 0-5, step 6 torn
    resume_sft(killed, log=lambda *a: None)
    assert [strip(r) for r in rows(killed)] == [strip(r) for r in rows(full)]
    a, b = policy(full), policy(killed)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6
    assert not partial.exists()


def test_resume_extends_and_refuses_what_would_change_the_batches(data, tiny_model_dir, tmp_path):
    run = sft(config(data, tiny_model_dir, **{"train.steps": 2, "train.schedule": "constant"}), tmp_path / "run",
              log=lambda *a: None)
    with pytest.raises(ConfigError, match="train.batch_size=8 cannot apply to --resume"):
        resume_sft_config(run, {"train.batch_size": 8})
    with pytest.raises(RunError, match=r"it is an SFT run; resume it with: tether sft --resume"):
        from tether.train import resume
        resume(run)
    resume_sft(run, {"train.steps": 3}, log=lambda *a: None)
    assert [r["step"] for r in rows(run)] == [1, 2, 3]
    moved = tmp_path / "other.jsonl"  # the data changed: the resumed batches would not be the same
    moved.write_text("".join(json.dumps(r) + "\n" for r in conversations()[:-1]))
    cfg = tmp_path / "run" / "config.yaml"
    cfg.write_text(cfg.read_text().replace(str(data), str(moved)))
    with pytest.raises(RunError, match="data.path .* changed since checkpoint step-000003"):
        resume_sft(run, {"train.steps": 4}, log=lambda *a: None)


def test_overwrite_replaces_only_an_sft_run(data, tiny_model_dir, tmp_path):
    rl = tmp_path / "rl"
    rl.mkdir()
    (rl / "config.yaml").write_text("recipe: grpo\n")
    write_marker(rl, "run")
    with pytest.raises(RunError, match="is a tether training run, not a supervised fine-tuning run"):
        sft(config(data, tiny_model_dir, **{"train.steps": 1, "run.overwrite": True, "run.output_dir": str(rl)}),
            log=lambda *a: None)
    assert (rl / "config.yaml").read_text() == "recipe: grpo\n"


def test_lora_sft_run_loads_as_a_merged_model(data, tiny_model_dir, tmp_path):
    """model.name=<a LoRA SFT run>: the base model with the run's adapters merged in computes what the adapters do."""
    from tether.eval.run import checkpoint_at, load_run_model
    from tether.rundir.reader import RunDir

    lora = {"model.lora_r": 4, "model.lora_target_modules": ["q_proj", "v_proj"], "train.steps": 2}
    run = sft(config(data, tiny_model_dir, **lora), tmp_path / "lora", log=lambda *a: None)
    merged, tok = load_model(ModelConfig(name=str(run)))
    adapters, _, _ = load_run_model(checkpoint_at(RunDir(run)), merge_lora=False)
    base, _ = load_model(ModelConfig(name=str(tiny_model_dir)))
    assert any("lora_" in n for n, _ in adapters.named_parameters())
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    ids = torch.tensor([tok("What is 2 + 2?")["input_ids"]])
    with torch.no_grad():
        want = adapters(input_ids=ids).logits
        torch.testing.assert_close(merged(input_ids=ids).logits, want, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(base(input_ids=ids).logits, want, atol=1e-3)  # SFT moved it


@pytest.mark.parametrize("over, msg", [
    ({"train.steps": 5, "train.epochs": 2}, "override: train.steps=5 and train.epochs=2 both set the length"),
    ({"train.micro_batch_size": 8, "train.batch_size": 4}, "override: train.micro_batch_size=8 exceeds "
                                                           "train.batch_size=4"),
    ({"train.steps": 3, "train.warmup_steps": 4}, "override: train.warmup_steps=4 exceeds the run's 3 optimizer steps"),
    ({"data.val_fraction": 0.2, "data.val_path": "v.jsonl"}, "override: data.val_fraction and data.val_path both "
                                                             "choose the validation rows"),
    ({"run.overwrite": True}, "override: run.overwrite=true needs run.output_dir"),
])
def test_the_rules_joining_keys_of_one_section_are_refused_as_it_is_read(over, msg, tmp_path):
    """Declared with the keys they join (tether.config.sft), said once, naming the source and the keys."""
    (tmp_path / "d.jsonl").write_text("")
    with pytest.raises(ConfigError, match=msg.replace("(", r"\(")) as e:
        load_sft_config(None, {"data.path": str(tmp_path / "d.jsonl"), **over})
    assert str(e.value).count(msg.partition(": ")[2]) == 1
    load_sft_config(None, {"data.path": str(tmp_path / "d.jsonl"), "train.steps": 3, "train.warmup_steps": 3})


def test_a_warmup_past_the_length_the_rows_give_is_refused(data, tiny_model_dir, tmp_path):
    """With train.epochs the length is known once the rows are read (24 rows, batches of 4: 6 steps a pass); the
    same rule as train.steps' (OptimizerConfig.warmup_problem)."""
    with pytest.raises(ConfigError, match=r"^train.warmup_steps=7 exceeds the run's 6 optimizer steps: the LR would "
                                          r"never reach train.lr$"):
        sft(config(data, tiny_model_dir, **{"train.warmup_steps": 7}), tmp_path / "run")


def test_docs_sft_md_lists_every_option():
    doc = (os.path.join(os.path.dirname(__file__), "..", "docs", "sft.md"))
    text = open(doc).read()
    missing = [ln for ln in sft_reference().splitlines() if ln.strip() and ln not in text]
    assert not missing, "docs/sft.md is out of date (paste tether.resolve.sft.sft_reference()):\n" + "\n".join(missing)


@pytest.mark.slow
def test_smollm2_sft_then_one_rl_step_from_its_checkpoint(tmp_path):
    """The real model: a few SFT steps on search trajectories lower the loss, then one RL step starts from them."""
    from tether.resolve import load_config
    from tether.train import train

    rows_ = [r for r in conversations(8) if "messages" in r and r["messages"][0]["role"] == "system"]
    f = tmp_path / "demos.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows_ * 2))
    run = sft(load_sft_config(None, {"data.path": str(f), "train.batch_size": 2, "train.micro_batch_size": 2,
                                     "train.steps": 4, "train.lr": 1e-4, "train.batching": "packed", **QUIET}),
              tmp_path / "sft", log=lambda *a: None)
    m = rows(run)
    assert m[-1]["loss"] < m[0]["loss"]
    rl = train(load_config(None, {"model.name": str(run), "train.steps": 1, "train.lr": 0, "rollout.n": 2,
                                  "rollout.prompts_per_step": 2, "rollout.max_new_tokens": 8, "eval.before": False,
                                  "eval.after": False, **QUIET}), tmp_path / "rl", log=lambda *a: None)
    a, b = policy(run), policy(rl)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow  # about 15 s: out of the default suite's 15 minutes, run by CI's slow step
def test_cli_sft_then_rl_eval_and_export_from_its_run(data, tiny_model_dir, tmp_path, make_workdir):
    """tether sft end to end in a subprocess, then tether train model.name=<the SFT run> --steps 1 (lr 0: its
    policy stays the SFT run's), tether eval --model <the SFT run> and tether export <the SFT run>."""
    run = tmp_path / "sft"
    r = run_module("sft", "--data", data, "--model", tiny_model_dir, "--output-dir", run, "train.epochs=2",
                   "train.batch_size=4", "train.lr=1e-2", "run.progress=false")
    assert r.returncode == 0, r.stderr[-3000:]
    assert latest_checkpoint(run).name == "step-000012" and (run / "curves.png").is_file()
    sft_policy, base = policy(run), load_file(str(tiny_model_dir / "model.safetensors"))
    assert any(not torch.equal(sft_policy[k], base[k]) for k in base)
    work = make_workdir("sft_rl", DIGITS, n_rows=8)
    rl = tmp_path / "rl"
    r = run_module(*cli_args(work, run, rl, 1, **{"train.lr": 0}))
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"loading model '{run}' (the policy of run {run} at step-000012)" in r.stdout
    rl_policy = policy(rl)
    assert all(torch.equal(rl_policy[k], sft_policy[k]) for k in sft_policy)
    r = run_module("train", "--resume", run)  # the other kind's command: one clean error
    assert_clean_error(r.returncode, r.stderr, "tether sft --resume")

    from tether.eval.cli import load_eval_model
    from tether.export import export_run

    model, _, desc = load_eval_model(run)
    assert "[sft] step 12 policy" in desc
    named = dict(model.named_parameters())
    assert all(torch.equal(named[k], t) for k, t in sft_policy.items())
    out = export_run(run, tmp_path / "export")
    exported = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(exported[k], sft_policy[k]) for k in sft_policy)
    assert "from a tether SFT run" in (out / "README.md").read_text()
    shutil.rmtree(out)
