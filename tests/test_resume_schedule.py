"""The LR schedule when ``--resume`` extends a run: the LR never jumps (tether.schedule.LRSchedule.continue_from).

Recorded per optimizer step: the learning rate each ``optimizer.step()`` actually used.
"""

import pytest
import torch

from helpers import DIGITS, rows, tiny_config
from tether.config import TrainConfig
from tether.errors import ConfigError
from tether.rundir.checkpoint import latest_checkpoint
from tether.schedule import LRSchedule
from tether.train import Trainer, build_trainer

pytestmark = pytest.mark.usefixtures("one_thread")  # fast on a shared machine (no thread oversubscription)

QUIET = dict(log=lambda *a: None)
COSINE = {"train.schedule": "cosine", "train.warmup_steps": 2, "train.mini_batches": 2, "rollout.prompts_per_step": 2,
          "rollout.n": 2}


@pytest.fixture(scope="module")
def workdir(make_workdir):
    return make_workdir("resume_schedule", DIGITS)


def recording(t: Trainer, lrs: list) -> Trainer:
    """``t`` with the learning rate of each of its optimizer steps appended to ``lrs``."""
    t.optimizer.register_step_pre_hook(lambda opt, args, kwargs: lrs.append(opt.param_groups[0]["lr"]))
    return t


def stopped_at(cfg, run, steps: int, lrs: list, resume: bool = False) -> Trainer:
    """A run of ``cfg`` (resumed from its latest checkpoint when ``resume``) that stopped, with a
    checkpoint, at trainer step ``steps`` before its ``train.steps``."""
    t = recording(build_trainer(cfg, run, **QUIET), lrs)
    if resume:
        t.restore(latest_checkpoint(run))
    while t.step < steps:
        t.train_step()
    t.save()
    return t


def test_extended_cosine_run_continues_without_a_jump(workdir, tiny_model_dir, tmp_path):
    """A cosine run laid out for 6 steps, stopped at step 4, resumed with train.steps=8 and then 10: the LR
    goes on from where it was and decays to 0 at the new end, never rising after warm-up."""
    lrs = []
    stopped_at(tiny_config(workdir, tiny_model_dir, "grpo", 6, **COSINE), tmp_path / "run", 4, lrs)
    assert len(lrs) == 8 and lrs[-1] > 0
    stopped_at(tiny_config(workdir, tiny_model_dir, "grpo", 8, **COSINE), tmp_path / "run", 6, lrs, resume=True)
    recording(build_trainer(tiny_config(workdir, tiny_model_dir, "grpo", 10, **COSINE), tmp_path / "run", **QUIET),
              lrs).run(resume=True)
    assert len(lrs) == 20  # 10 trainer steps x 2 mini-batches
    assert lrs[:2] == [0.005, 0.01]  # warm-up
    after = lrs[1:]
    assert all(b <= a for a, b in zip(after, after[1:])), lrs  # no increase anywhere, joints included
    assert all(x > 0 for x in lrs)
    assert rows(tmp_path / "run")[-1]["lr"] == 0.0  # the decay ends at 0 after the last optimizer step


def test_extended_cosine_matches_the_saved_segment_on_an_exact_resume(workdir, tiny_model_dir, tmp_path):
    """After an extension, resuming again at the same train.steps continues the re-laid schedule exactly:
    the same LRs as when the extended run went on without a stop."""
    cfg8 = tiny_config(workdir, tiny_model_dir, "grpo", 8, **COSINE)
    a, b = [], []
    for run, lrs in ((tmp_path / "a", a), (tmp_path / "b", b)):
        stopped_at(tiny_config(workdir, tiny_model_dir, "grpo", 6, **COSINE), run, 4, lrs)
    recording(build_trainer(cfg8, tmp_path / "a", **QUIET), a).run(resume=True)
    stopped_at(cfg8, tmp_path / "b", 5, b, resume=True)  # stopped at step 5 of the extended run
    recording(build_trainer(cfg8, tmp_path / "b", **QUIET), b).run(resume=True)
    assert a == b


def test_extending_a_run_decayed_to_zero_is_refused(workdir, tiny_model_dir, tmp_path):
    """A finished cosine run has lr 0: extending it would train at lr 0, so it is an error naming the fix."""
    build_trainer(tiny_config(workdir, tiny_model_dir, "grpo", 4, **COSINE), tmp_path / "run", **QUIET).run()
    t = build_trainer(tiny_config(workdir, tiny_model_dir, "grpo", 8, **COSINE), tmp_path / "run", **QUIET)
    with pytest.raises(ConfigError, match="decayed to 0.*train.schedule=constant"):
        t.run(resume=True)
    assert [r["step"] for r in rows(tmp_path / "run")] == [1, 2, 3, 4]  # nothing trained


@pytest.mark.parametrize("first", ["cosine", "constant"])
def test_extending_with_a_constant_schedule_trains_at_train_lr(first, workdir, tiny_model_dir, tmp_path):
    """train.schedule=constant on resume (the fix the refusal names, or a constant run extended): the
    new steps train at train.lr from the first one (not at the 0 the finished cosine run had reached)."""
    lrs = []
    recording(build_trainer(tiny_config(workdir, tiny_model_dir, "grpo", 4, **{**COSINE, "train.schedule": first}),
                            tmp_path / "run", **QUIET), lrs).run()
    over = {**COSINE, "train.schedule": "constant"}
    recording(build_trainer(tiny_config(workdir, tiny_model_dir, "grpo", 6, **over), tmp_path / "run", **QUIET),
              lrs).run(resume=True)
    assert lrs[8:] == [0.01] * 4
    assert [r["lr"] for r in rows(tmp_path / "run")][4:] == [0.01, 0.01]


def test_train_lr_given_on_resume_applies(workdir, tiny_model_dir, tmp_path):
    """train.lr=... on --resume changes the learning rate from the next step on (it was silently ignored:
    the optimizer's saved learning rate won)."""
    lrs = []
    over = {"rollout.prompts_per_step": 2, "rollout.n": 2}
    recording(build_trainer(tiny_config(workdir, tiny_model_dir, "grpo", 2, **over), tmp_path / "run", **QUIET),
              lrs).run()
    recording(build_trainer(tiny_config(workdir, tiny_model_dir, "grpo", 4, **{**over, "train.lr": 1e-3}),
                            tmp_path / "run", **QUIET), lrs).run(resume=True)
    assert lrs == [1e-2, 1e-2, 1e-3, 1e-3]


def test_schedule_state_is_a_plain_lambdalr_and_continues_exactly(tmp_path):
    """LRSchedule's scheduler checkpoints exactly what torch's LambdaLR does (old checkpoints load), and
    continuing from an unchanged plan gives the LRs of a run that never stopped (no model needed)."""
    train = TrainConfig(schedule="cosine", warmup_steps=2, steps=5, lr=0.1)
    opt = lambda: torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=train.lr)  # noqa: E731
    a = LRSchedule(opt(), train.schedule, train.warmup_steps, train.steps, train.lr)
    plain = torch.optim.lr_scheduler.LambdaLR(opt(), lambda s: 1.0)
    assert set(a.scheduler.state_dict()) == set(plain.state_dict())
    lrs = []
    for _ in range(3):
        lrs.append(a.scheduler.get_last_lr()[0])
        a.scheduler.optimizer.step()
        a.scheduler.step()
    saved, state = dict(a.plan), a.scheduler.state_dict()
    b = LRSchedule(opt(), train.schedule, train.warmup_steps, train.steps, train.lr)
    b.scheduler.load_state_dict(state)
    b.continue_from(saved, 3, tmp_path)
    for s in (a, b):
        s.scheduler.optimizer.step()
        s.scheduler.step()
    assert b.plan == a.plan and b.scheduler.get_last_lr() == a.scheduler.get_last_lr()
    assert b.scheduler.optimizer.param_groups[0]["lr"] == a.scheduler.optimizer.param_groups[0]["lr"]
    assert lrs[:2] == [0.05, 0.1]  # warm-up
