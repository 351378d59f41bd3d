"""End-to-end trainer tests on a tiny random model: every recipe, failures, resume, atomic checkpoints."""

import math

import pytest
import torch

from helpers import DIGITS, rows, strip, tiny_config
from tether.config.recipes import RECIPES
from tether.errors import ConfigError
from tether.resolve import load_config
from tether.rundir.checkpoint import latest_checkpoint, load_checkpoint
from tether.tasks.base import DataError
from tether.train import build_trainer, resume, train

REWARD = DIGITS + '''
CALLS = {"n": 0}

def half_constant(completion, example):
    """Prompts with an even answer always score 1 (a zero-variance group); odd ones score digits."""
    if int(example.answer) % 2 == 0:
        return 1.0
    return digits(completion, example)

def flaky(completion, example):
    CALLS["n"] += 1
    if CALLS["n"] % 5 == 0:
        raise RuntimeError("boom from a user reward")
    return 0.5
'''


@pytest.fixture(scope="module")
def workdir(make_workdir):
    return make_workdir("train", REWARD)


LEARNERS = ["grpo", "ema_pg", "rpg_reinforce_urkl", "atr_grpo"]


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_every_recipe_trains(recipe, workdir, tiny_model_dir, tmp_path, one_thread):
    learner = recipe in LEARNERS
    steps = 12 if learner else 2
    over = {}
    if recipe == "ema_pg":
        over["algo.anchor.every"] = 2  # let the EMA anchor move within the short run
    cfg = tiny_config(workdir, tiny_model_dir, recipe, steps, **over)
    run = train(cfg, tmp_path / recipe, log=lambda *a: None)
    m = rows(run)
    assert len(m) == steps
    for r in m:
        assert math.isfinite(r["pg_loss"]) and math.isfinite(r["grad_norm"]), (recipe, r)
        assert r["skipped_updates"] == 0
        if cfg.algo.kl.estimator != "none":
            assert math.isfinite(r["kl"])
    if learner:
        first = sum(r["reward_mean"] for r in m[:3]) / 3
        last = sum(r["reward_mean"] for r in m[-3:]) / 3
        assert last > first + 0.03, (recipe, [round(r["reward_mean"], 3) for r in m])
    if recipe == "ema_pg":
        assert m[-1]["anchor_updates"] == steps // 2 and m[-1]["kl"] > 0


def test_centered_topk_kl_leaves_a_step_without_reward_signal_at_rest(workdir, tiny_model_dir, tmp_path):
    """A first step whose groups carry no reward difference (every advantage 0), the policy equal to its
    anchor: the update is the KL gradient alone. topk_rev's per-sample terms cancel only on average, so its
    gradient is noise that Adam turns into lr-sized steps (docs/results_search.md, "The chosen settings,
    second seed"); topk_rev_centered's is zero up to float rounding between the anchor and policy passes."""
    norms = {}
    for est in ("topk_rev", "topk_rev_centered"):
        cfg = tiny_config(workdir, tiny_model_dir, "ema_pg", 1, **{"algo.kl.estimator": est, "algo.kl.topk": 4,
                                                                    "algo.kl.beta": 1.0})
        t = build_trainer(cfg, tmp_path / est, log=lambda *a: None)
        t.score_rewards = lambda texts, examples: ([0.0] * len(texts), [False] * len(texts), [])
        m = t.train_step()
        assert m["reward_mean"] == 0.0 and math.isfinite(m["kl"])
        norms[est] = m["grad_norm"]
    assert norms["topk_rev"] > 1e-4, norms
    assert norms["topk_rev_centered"] < 1e-4 * norms["topk_rev"], norms


def test_anchor_every_counts_trainer_steps(workdir, tiny_model_dir, tmp_path):
    """anchor.every is in trainer steps: with 2 optimizer steps per trainer step (mini_batches=2)
    and every=2, 4 trainer steps move the EMA anchor exactly twice, at trainer steps 2 and 4."""
    cfg = tiny_config(workdir, tiny_model_dir, "ema_pg", 4, **{"train.mini_batches": 2, "algo.anchor.every": 2})
    m = rows(train(cfg, tmp_path / "run", log=lambda *a: None))
    assert [r["anchor_moved"] for r in m] == [False, True, False, True]
    assert m[-1]["anchor_updates"] == 2




def test_train_step_emits_no_future_warning(workdir, tiny_model_dir, tmp_path):
    """A trainer step reads no deprecated transformers attribute (``tether train`` printed a
    FutureWarning for ``is_gradient_checkpointing`` at its first step)."""
    import warnings

    cfg = tiny_config(workdir, tiny_model_dir, "grpo", 1)
    t = build_trainer(cfg, tmp_path / "run", log=lambda *a: None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        m = t.train_step()
    assert math.isfinite(m["pg_loss"])


def test_bad_row_fails_before_training(workdir, tiny_model_dir, tmp_path, monkeypatch):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "a", "answer": "1"}\n{"question": "b"}\n')
    cfg = tiny_config(workdir, tiny_model_dir, "grpo", 1, **{"data.task": str(bad)})
    import tether.models
    monkeypatch.setattr(tether.models, "load_model", lambda *a, **k: pytest.fail("model loaded before data check"))
    with pytest.raises(DataError, match=r"bad.jsonl.* 2.*answer"):
        build_trainer(cfg, tmp_path / "run")


def test_a_trainer_given_a_run_directory_says_what_builds_it(workdir, tiny_model_dir, tmp_path):
    """Trainer(cfg, parts) runs built parts; the earlier Trainer(cfg, run_dir) is one TypeError naming build_trainer,
    before anything is built or made on disk."""
    from tether.train import Trainer

    cfg = tiny_config(workdir, tiny_model_dir, "grpo", 1)
    with pytest.raises(TypeError, match=r"got PosixPath .*build_trainer\(cfg, run_dir"):
        Trainer(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_yaml_then_overrides_and_saved_config(workdir, tiny_model_dir, tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("recipe: atr_grpo\ntrain:\n  lr: 0.5\n  steps: 1\nalgo:\n  kl:\n    beta: 0.01\n")
    cfg = load_config(str(y), {"train.lr": 0.25})
    assert cfg.recipe == "atr_grpo" and cfg.train.lr == 0.25 and cfg.algo.kl.beta == 0.01
    assert cfg.algo.name == "atr_grpo+custom" and cfg.algo.region.kind == "kl3"
    cfg = tiny_config(workdir, tiny_model_dir, "dapo", 1)
    run = train(cfg, tmp_path / "run", log=lambda *a: None)
    saved = load_config(str(run / "config.yaml"))
    assert saved == cfg


def test_raising_reward_scores_zero_and_training_goes_on(workdir, tiny_model_dir, tmp_path):
    logs = []
    cfg = tiny_config(workdir, tiny_model_dir, "dapo", 2, **{"data.reward": f"{workdir / 'rew.py'}:flaky"})
    run = train(cfg, tmp_path / "run", log=logs.append)
    m = rows(run)
    assert len(m) == 2 and m[-1]["reward_errors"] >= 5
    assert "boom from a user reward" in (run / "reward_errors.log").read_text()
    assert sum("reward function raised" in str(x) for x in logs) == 1  # the first traceback only




def test_non_finite_loss_skips_the_update(workdir, tiny_model_dir, tmp_path, monkeypatch):
    import tether.train as train_mod

    real = train_mod.compute_loss
    calls = {"n": 0}

    def poisoned(*a, **k):
        out = real(*a, **k)
        calls["n"] += 1
        if calls["n"] == 1:
            out.loss = out.loss * float("nan")
        return out

    monkeypatch.setattr(train_mod, "compute_loss", poisoned)
    cfg = tiny_config(workdir, tiny_model_dir, "grpo", 1, **{"train.micro_batch_size": 16})
    t = build_trainer(cfg, tmp_path / "run", log=lambda *a: None)
    before = [p.detach().clone() for p in t.params]
    m = t.train_step()
    assert m["skipped_updates"] == 1
    assert all(torch.equal(a, p) for a, p in zip(before, t.params))
    assert all(p.grad is None for p in t.params)
    m = t.train_step()  # the next step trains normally
    assert m["skipped_updates"] == 1 and any(not torch.equal(a, p) for a, p in zip(before, t.params))


@pytest.mark.parametrize("recipe", ["ema_pg", "rpg_reinforce_urkl"])
def test_resume_is_exact(recipe, workdir, tiny_model_dir, tmp_path):
    over = {"run.save_every": 2, "algo.anchor.every": 1} if recipe == "ema_pg" else {"run.save_every": 2}
    full = train(tiny_config(workdir, tiny_model_dir, recipe, 4, **over), tmp_path / "full", log=lambda *a: None)
    part = tiny_config(workdir, tiny_model_dir, recipe, 2, **over)
    train(part, tmp_path / "part", log=lambda *a: None)
    resume(tmp_path / "part", {"train.steps": 4}, log=lambda *a: None)
    a, b = rows(full), rows(tmp_path / "part")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for x, y in zip(a[2:], b[2:]):
        assert strip(x) == strip(y)


def test_interrupted_checkpoint_write_leaves_previous_loadable(workdir, tiny_model_dir, tmp_path, monkeypatch):
    import tether.rundir.checkpoint as ck

    cfg = tiny_config(workdir, tiny_model_dir, "ema_pg", 1, **{"run.save_every": 1})
    t = build_trainer(cfg, tmp_path / "run", log=lambda *a: None)
    t.train_step()
    good = t.save()
    t.train_step()
    real = ck._save_tensors

    def dies(tensors, path):
        if path.name == "optimizer.safetensors":
            raise KeyboardInterrupt("killed mid-write")
        real(tensors, path)

    monkeypatch.setattr(ck, "_save_tensors", dies)
    with pytest.raises(KeyboardInterrupt):
        t.save()
    monkeypatch.setattr(ck, "_save_tensors", real)
    assert latest_checkpoint(tmp_path / "run") == good
    assert any(".tmp-" in p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    t2 = build_trainer(cfg, tmp_path / "run", log=lambda *a: None)
    st = load_checkpoint(good, t2.model, t2.anchor, t2.optimizer, t2.scheduler)
    assert st["step"] == 1
    t.save()  # the next successful save cleans the leftover
    assert not any(".tmp-" in p.name for p in (tmp_path / "run" / "checkpoints").iterdir())


def test_cli_bad_key_exit_code(capsys):
    from tether.cli import main

    assert main(["train", "train.lrr=1"]) == 2
    assert "Did you mean 'train.lr'" in capsys.readouterr().err
    assert main(["recipes"]) == 0
    assert "ema_pg" in capsys.readouterr().out


@pytest.mark.parametrize("recipe,want", [
    ("grpo", ["anchor"]),                        # on-policy: no sampler pass
    ("dapo", []),                                # no KL, on-policy: neither pass
    ("ema_pg", ["sampler", "anchor"]),           # reverse top-k needs the sampler's top-k ids
    ("rpg_reinforce_urkl", ["sampler"]),         # iterative anchor: the sampler pass is the anchor pass
])
def test_needless_passes_are_skipped(recipe, want, workdir, tiny_model_dir, tmp_path, monkeypatch):
    cfg = tiny_config(workdir, tiny_model_dir, recipe, 1)
    t = build_trainer(cfg, tmp_path / "run", log=lambda *a: None)
    calls = []
    real = t.passes._pass
    monkeypatch.setattr(t.passes, "_pass",
                        lambda b, **k: calls.append("anchor" if k.get("with_anchor") else "sampler") or real(b, **k))
    t.train_step()
    assert calls == want


@pytest.mark.parametrize("over", [
    {"model.lora_r": 4, "model.lora_target_modules": ["q_proj", "v_proj"]},
    {"model.dtype": "bfloat16"},
    {"model.gradient_checkpointing": True},
])
def test_lora_bf16_and_checkpointing(over, workdir, tiny_model_dir, tmp_path):
    cfg = tiny_config(workdir, tiny_model_dir, "ema_pg", 2, **{"algo.anchor.every": 1, **over})
    t = build_trainer(cfg, tmp_path / "run", log=lambda *a: None)
    if "model.lora_r" in over:
        assert t.anchor.names and all("lora_" in n for n in t.anchor.names)
    assert all(m.dtype == torch.float32 for m in t.anchor.master)  # the EMA is fp32 whatever the policy
    for _ in range(2):
        m = t.train_step()
        assert math.isfinite(m["pg_loss"]) and m["skipped_updates"] == 0
    assert t.anchor.num_updates == 2


def test_plot_cli_overlays_runs(workdir, tiny_model_dir, tmp_path, monkeypatch, capsys):
    from tether.cli import main

    a = train(tiny_config(workdir, tiny_model_dir, "dapo", 2), tmp_path / "a", log=lambda *x: None)
    b = train(tiny_config(workdir, tiny_model_dir, "grpo", 2), tmp_path / "b", log=lambda *x: None)
    out = tmp_path / "cmp.png"
    assert main(["plot", str(a), str(b), "--out", str(out)]) == 0
    assert out.stat().st_size > 10_000 and out.read_bytes()[:4] == b"\x89PNG"
    # without --out, an overlay goes to the current directory, not into a run (whose curves.png shows it alone)
    assert main(["plot", str(a)]) == 0  # one run: its own RUN/curves.png
    own = (a / "curves.png").read_bytes()
    monkeypatch.chdir(tmp_path)
    assert main(["plot", str(a), str(b)]) == 0
    assert (tmp_path / "curves_a_vs_b.png").read_bytes()[:4] == b"\x89PNG" and (a / "curves.png").read_bytes() == own
    assert capsys.readouterr().out.splitlines()[-1] == "curves_a_vs_b.png"  # the path written




def test_dynamic_sampling_drops_zero_variance_groups_and_refills(workdir, tiny_model_dir, tmp_path):
    cfg = tiny_config(workdir, tiny_model_dir, "dapo", 1, reward="half_constant",
                      **{"data.shuffle": False, "rollout.overlong_buffer_frac": 0.0})
    t = build_trainer(cfg, tmp_path / "run", log=lambda *a: None)
    b, m = t._rollout()
    # prompts 0..3 give 2 informative groups; one refill round of 2 prompts (4, 5) gives 1 more, then 6, 7 ...
    answers = sorted({int(e.answer) for e in b.examples})
    assert all(a % 2 == 1 for a in answers) and len(answers) == 4 == m["ds_groups_kept"]
    assert m["ds_rounds"] > 1 and t.data.position > 4
    assert len(b.rb) == 16 and b.adv.abs().sum() > 0


def test_overlong_penalty_and_truncation_mask(workdir, tiny_model_dir, tmp_path):
    cfg = tiny_config(workdir, tiny_model_dir, "grpo", 1, **{"rollout.overlong_buffer_frac": 0.5,
                                                              "rollout.overlong_penalty": 2.0,
                                                              "rollout.mask_truncated": True,
                                                              "data.reward": f"{workdir / 'rew.py'}:flaky"})
    t = build_trainer(cfg, tmp_path / "run", log=lambda *a: None)
    b, _ = t._rollout()
    L = b.rb.response_mask.sum(-1).float()
    start, cache = 4.0, 4.0  # max_new_tokens 8, buffer 50%
    pen = 2.0 * ((L - start).clamp(min=0) / cache).clamp(max=1)
    base = b.rewards + pen
    assert torch.allclose(base, torch.where(base.abs() < 1e-6, base, torch.full_like(base, 0.5)), atol=1e-6)
    assert (pen > 0).any()
    trunc = torch.tensor([f == "length" for f in b.rb.finish_reason])
    assert trunc.any() and not b.loss_mask[trunc].any()
    assert torch.equal(b.loss_mask[~trunc], b.rb.response_mask[~trunc])


def test_evaluation_during_training(workdir, tiny_model_dir, tmp_path):
    cfg = tiny_config(workdir, tiny_model_dir, "ema_pg", 2, **{
        "eval.every": 2, "eval.benchmarks": ["arithmetic", str(workdir / "prompts.jsonl")], "eval.limit": 3,
        "eval.max_new_tokens": 4, "eval.anchor": True, "algo.anchor.every": 1})
    run = train(cfg, tmp_path / "run", log=lambda *a: None)
    m = rows(run)
    assert [r["step"] for r in m] == [0, 1, 2]  # step 0: the initial policy (eval.before)
    assert "eval/arithmetic/avg@1" in m[0] and "reward_mean" not in m[0]
    assert "eval/arithmetic/avg@1" not in m[1]  # only every 2 steps
    for k in ("eval/arithmetic/avg@1", "eval/prompts/avg@1", "eval_anchor/arithmetic/avg@1"):
        assert k in m[2], sorted(m[2])
    with pytest.raises(ConfigError, match="eval.limit has no effect while evaluation is off"):
        load_config(None, {"eval.limit": 3, "eval.before": False, "eval.after": False})
    with pytest.raises(ConfigError, match="eval.anchor=true needs an anchor"):
        load_config(None, {"eval.every": 1, "eval.anchor": True}, recipe_name="dapo")


def test_default_run_prints_held_out_accuracy_before_and_after(workdir, tiny_model_dir, tmp_path):
    """By default (eval.before, eval.after, eval.benchmarks=auto) an arithmetic run evaluates its held-out
    split before step 1 and after the last step, and ends by printing both accuracies; the numbers printed
    are the ones logged. A resumed run finds its 'before' in metrics.jsonl."""
    lines = []
    cfg = tiny_config(workdir, tiny_model_dir, "grpo", 2, **{"data.task": "arithmetic", "data.reward": "auto",
                                                            "eval.limit": 4, "eval.max_new_tokens": 4})
    run = train(cfg, tmp_path / "run", log=lambda *a: lines.append(" ".join(map(str, a))))
    m = rows(run)
    assert [r["step"] for r in m] == [0, 1, 2]
    assert m[0]["eval/arithmetic/n_problems"] == 4 and "eval/arithmetic/avg@1" not in m[1]
    before, after = m[0]["eval/arithmetic/avg@1"], m[2]["eval/arithmetic/avg@1"]
    assert any(ln.startswith("[tether] held-out before training: arithmetic") for ln in lines), lines
    want = (f"held-out accuracy, before -> after training: arithmetic (4 problems, greedy, 4 tokens): "
            f"{100 * before:.1f} % -> {100 * after:.1f} % (step 2)")
    assert any(want in ln for ln in lines), lines
    # resume to 3 steps: no second 'before', and the summary still has it
    lines.clear()
    resume(run, {"train.steps": 3}, log=lambda *a: lines.append(" ".join(map(str, a))))
    m = rows(run)
    assert [r["step"] for r in m] == [0, 1, 2, 3]
    assert f"{100 * before:.1f} % -> {100 * m[3]['eval/arithmetic/avg@1']:.1f} % (step 3)" in "\n".join(lines)
    # off: no step-0 row, no summary
    lines.clear()
    cfg = tiny_config(workdir, tiny_model_dir, "grpo", 1, **{"data.task": "arithmetic", "data.reward": "auto",
                                                            "eval.before": False, "eval.after": False})
    run = train(cfg, tmp_path / "off", log=lambda *a: lines.append(" ".join(map(str, a))))
    assert [r["step"] for r in rows(run)] == [1] and not any("held-out" in ln for ln in lines)


def test_auto_benchmarks_follow_the_task(workdir, tiny_model_dir, tmp_path):
    """auto -> the training task's held-out set; a task without one evaluates nothing and says so, and
    asking for periodic evaluation of it is a configuration error."""
    from tether.resolve import eval_benchmarks
    assert eval_benchmarks(load_config(None, {})) == ["arithmetic"]
    assert eval_benchmarks(load_config(None, {"data.task": "gsm8k"})) == ["gsm8k"]
    assert eval_benchmarks(load_config(None, {"data.task": "gsm8k", "eval.benchmarks": ["auto", "math500"]})) == \
        ["gsm8k", "math500"]
    lines = []
    run = train(tiny_config(workdir, tiny_model_dir, "grpo", 1), tmp_path / "run",
                log=lambda *a: lines.append(" ".join(map(str, a))))
    assert [r["step"] for r in rows(run)] == [1]
    assert any("no held-out evaluation: data.task=" in ln and "prompts.jsonl" in ln for ln in lines), lines
    with pytest.raises(ConfigError, match="has no held-out set tether knows"):
        tiny_config(workdir, tiny_model_dir, "grpo", 1, **{"eval.every": 1})
    with pytest.raises(ConfigError, match="eval.every must be >= 0"):
        load_config(None, {"eval.every": -1})




def test_lockstep_helpers_are_the_identity_in_one_process():
    """The update's distributed helpers (tether.distributed.rank_share, lockstep) leave one process's
    update as it reads: all the mini-batch's rows, its own token count, no idle backward."""
    from tether import distributed as dist
    mask = torch.tensor([[True, False], [True, True], [False, False]])
    assert dist.rank_share([2, 0], 0, mask) == ([2, 0], 1.0)
    idle = []
    assert list(dist.lockstep([[0], [1, 2]], idle=lambda: idle.append(1))) == [[0], [1, 2]] and idle == []


def test_exact_kl_sample_matches_full_logits(workdir, tiny_model_dir, tmp_path):
    cfg = tiny_config(workdir, tiny_model_dir, "grpo", 1, **{"run.exact_kl_samples": 2})
    t = build_trainer(cfg, tmp_path / "run", log=lambda *a: None)
    with torch.no_grad():  # move the policy away from the fixed anchor so the KL is not zero
        for p in t.params:
            p.add_(0.05 * torch.randn_like(p))
    b, _ = t._rollout()
    assert t.passes.anchor_pass(b)
    got = t._exact_kl(b)
    mb = b.rb.select([0, 1])
    ids, att = mb.input_ids()
    P, T = mb.prompt_ids.shape[1], mb.response_ids.shape[1]
    pos = (att.long().cumsum(-1) - 1).clamp(min=0)

    def full():
        with torch.no_grad():
            logits = t.model(input_ids=ids, attention_mask=att.long(), position_ids=pos).logits[:, P - 1:P + T - 1]
            return (logits / cfg.rollout.temperature).log_softmax(-1)  # log-probs at the sampling temperature

    lp = full()
    with t.anchor.applied(t.model):
        la = full()
    m = mb.response_mask.float()
    want = float(((lp.exp() * (lp - la)).sum(-1) * m).sum() / m.sum())
    assert want > 1e-3 and got == pytest.approx(want, rel=1e-4)


def test_exact_estimator_trains(workdir, tiny_model_dir, tmp_path):
    cfg = tiny_config(workdir, tiny_model_dir, "grpo", 2,
                      **{"algo.kl.estimator": "exact_rev", "run.exact_kl_samples": 1})
    m = rows(train(cfg, tmp_path / "run", log=lambda *a: None))
    assert all(math.isfinite(r["kl"]) for r in m) and m[-1]["kl"] > 0


@pytest.mark.parametrize("recipe", ["grpo", "ema_pg"])
def test_shared_prompt_training_equals_unshared(recipe, workdir, tiny_model_dir, tmp_path):
    """Running each group's prompt once (rollout pre-fill and training passes) changes no metric.

    Same seed, so the same rollouts; losses, KL and rewards then agree to float32 rounding
    over 3 steps of updates (grouped micro-batches change only the summation order)."""
    runs = {}
    for share in (True, False):
        # temperature 1: a rounding-level difference in the logits can flip a sampled token, and at the
        # default 0.7 one does at step 3 (steps 1-2 agree exactly); at 1.0 the 3 steps sample the same tokens
        cfg = tiny_config(workdir, tiny_model_dir, recipe, 3, **{"train.share_prompt": share,
                                                               "rollout.engine.share_prompt": share,
                                                               "train.micro_batch_size": 4, "rollout.temperature": 1.0})
        runs[share] = rows(train(cfg, tmp_path / f"share-{share}", log=lambda *a: None))
    for a, b in zip(runs[True], runs[False]):
        keys = [k for k in ("reward_mean", "pg_loss", "kl", "entropy", "response_len", "grad_norm") if k in a]
        assert {"reward_mean", "pg_loss", "entropy", "grad_norm"} <= set(keys)
        for k in keys:
            assert a[k] == pytest.approx(b[k], rel=1e-3, abs=1e-5), k


def test_sync_weights_is_called_once_per_trainer_step_as_documented(workdir, tiny_model_dir, tmp_path):
    """Defect: Engine.sync_weights' docstring said 'after every optimizer step'; the trainer calls it once per
    trainer step (here 2 optimizer steps each)."""
    from tether.rollout.base import Engine

    assert "once per trainer step" in " ".join(Engine.sync_weights.__doc__.split())
    cfg = tiny_config(workdir, tiny_model_dir, "grpo", 2, **{"train.mini_batches": 2})
    t = build_trainer(cfg, tmp_path / "run", log=lambda *a: None)
    calls = []
    real = t.engine.sync_weights
    t.engine.sync_weights = lambda model: calls.append(t.step) or real(model)
    t.train_step()
    t.train_step()
    assert calls == [1, 2] and t.scheduler.last_epoch == 4  # 4 optimizer steps, 2 syncs


# ---------------------------------------------------------------- rollout correction (algo.tis_cap)


def _logp_engine(shift: float):
    """An ENGINES builder: HFEngine whose batches report sampler_logp = the policy's own log-probs + shift."""
    from tether.logprobs import response_stats
    from tether.rollout import HFEngine

    class LogpEngine(HFEngine):
        def generate(self, prompts, params):
            rb = super().generate(prompts, params)
            with torch.no_grad():
                st = response_stats(self.model, rb.prompt_ids, rb.prompt_mask, rb.response_ids, rb.response_mask,
                                    temperature=params.temperature, entropy=False)
            rb.sampler_logp = torch.where(rb.response_mask, st.logp.float() + shift, 0.0)
            return rb

    def build(cfg, model, tokenizer, **over):
        return LogpEngine(model, tokenizer, batch_size=cfg.batch_size)

    build.reports_logp = True
    return build


@pytest.mark.parametrize("shift,trunc", [(0.0, 0.0), (-1.0, 1.0)])
def test_rollout_correction_with_an_engine_that_reports_logprobs(shift, trunc, workdir, tiny_model_dir, tmp_path,
                                                                 monkeypatch):
    """sampler_logp == the trainer's own log-probs: ratio 1, nothing truncated; pi_vllm = pi_old / e: every
    token's ratio is e > C = 2. The sampler pass runs although grpo is on-policy (pi_old is needed)."""
    from tether.config.recipes import describe
    from tether.rollout import ENGINES

    monkeypatch.setitem(ENGINES, "logp", _logp_engine(shift))
    cfg = tiny_config(workdir, tiny_model_dir, "grpo", 2, **{"rollout.engine": "logp", "algo.tis_cap": 2.0})
    assert cfg.algo.name == "grpo+custom" and "tis=token(C=2)" in describe(cfg.algo)
    t = build_trainer(cfg, tmp_path / "run", log=lambda *a: None)
    calls = []
    real = t.passes._pass
    monkeypatch.setattr(t.passes, "_pass",
                        lambda b, **k: calls.append("anchor" if k.get("with_anchor") else "sampler") or real(b, **k))
    for _ in range(2):
        m = t.train_step()
        assert m["rollout_corr/ratio_mean"] == pytest.approx(math.exp(-shift), rel=1e-4)
        assert m["rollout_corr/ratio_max"] == pytest.approx(math.exp(-shift), rel=1e-4)
        assert m["rollout_corr/trunc_frac"] == trunc
        assert math.isfinite(m["pg_loss"]) and m["skipped_updates"] == 0
    assert calls.count("sampler") == 2
