"""The effective sample size of the rollout's importance weights r = pi_old / mu (tether.algo.correction:
``rollout_corr/ess_frac``, ``seq_ess_frac``) and the ESS-scaled step (``train.lr_scale``).

ESS / N = (sum w)^2 / (N sum w^2), checked against values computed here by hand: on a hand batch, over
every split of a batch into micro-batches (and mini-batches, epochs, ranks), exactly 1 on-policy, and 1/N
for one dominant weight. The scaled step: every optimizer step's LR is the scheduled LR times the ESS
fraction of its mini-batch; with mu = pi_old a run is bit for bit the run without the option; a resumed
run is the run that went on.
"""

import math
from itertools import product

import pytest
import torch

from helpers import DIGITS, rows, strip, tiny_config
from tether.algo import LossInputs, RegionConfig, compute_loss
from tether.algo.correction import ess_frac, ess_moments, lr_scale, mismatch_metrics
from tether.config.recipes import recipe, validate
from tether.errors import ConfigError
from tether.metrics import UpdateStats
from tether.train import Trainer, build_trainer

QUIET = dict(log=lambda *a: None)
LOG2 = math.log(2.0)


def algo(**over):
    cfg = recipe("dapo")
    cfg.region = RegionConfig("none")
    for k, v in over.items():
        setattr(cfg, k, v)
    return validate(cfg)


def batch(log_r_rows):
    """old_logp, sampler_logp and mask [B, T] of responses whose tokens have the given log r = log pi_old/mu
    (ragged rows; padding holds NaN, never read)."""
    B, T = len(log_r_rows), max(len(r) for r in log_r_rows)
    mask = torch.zeros(B, T, dtype=torch.bool)
    log_r = torch.full((B, T), math.nan, dtype=torch.float64)
    for i, r in enumerate(log_r_rows):
        mask[i, :len(r)] = True
        log_r[i, :len(r)] = torch.tensor(r, dtype=torch.float64)
    old = torch.where(mask, torch.full((B, T), -1.5, dtype=torch.float64), math.nan)
    return old, old - log_r, mask


def step_metrics(cfg, log_r_rows):
    """compute_loss's metrics on the batch (the trainer's path: on-policy, pi_old = the forward's own)."""
    old, samp, mask = batch(log_r_rows)
    lp = old.clone().requires_grad_(True)
    return compute_loss(cfg, LossInputs(logp=lp, mask=mask, adv=torch.ones(len(log_r_rows), dtype=torch.float64),
                                        old_logp=old, sampler_logp=samp)).metrics


# ---------------------------------------------------------------- the metric, by hand


HAND = [[LOG2, 0.0, 0.0], [-LOG2, 0.0]]  # token weights 2, 1, 1, 1/2, 1; response weights 2 and 1/2


@pytest.mark.parametrize("over", [{}, {"tis_cap": 2.0}, {"tis_cap": 1.5, "mask_token_low": 0.6}])
def test_ess_of_a_hand_batch(over):
    """Tokens: sum w = 5.5, sum w^2 = 7.25, N = 5 -> 30.25 / 36.25; responses (prod r = 2, 1/2): 6.25 / (2 x 4.25).
    The raw ratios, whatever the correction (a cap or a mask changes the weights it applies, not the ESS);
    reported without a correction too, since the engine's log-probs are given."""
    m = step_metrics(algo(**over), HAND)
    assert float(m["rollout_corr/ess_frac"]) == pytest.approx(30.25 / 36.25, abs=1e-14)
    assert float(m["rollout_corr/seq_ess_frac"]) == pytest.approx(6.25 / 8.5, abs=1e-14)


def test_ess_is_exactly_one_on_policy():
    """mu = pi_old: every weight is 1, ESS / N = 1 exactly at both levels, and the step's multiplier is 1."""
    m = step_metrics(algo(), [[0.0] * 5, [0.0] * 2, [0.0]])
    assert float(m["rollout_corr/ess_frac"]) == 1.0 and float(m["rollout_corr/seq_ess_frac"]) == 1.0
    assert float(lr_scale(m["rollout_corr/ess_frac"])) == 1.0


@pytest.mark.parametrize("n", [2, 5, 8])
def test_one_dominant_weight_gives_one_over_n(n):
    """Weights (M, 1, ..., 1): ESS / N = (M + N - 1)^2 / (N (M^2 + N - 1)), falling to 1/N as M grows; exactly
    1/N when the other weights are 0 (they underflow), and still 1/N for a weight beyond e^300 (clamped)."""
    for big in (3.0, 10.0, 100.0):
        log_w = torch.tensor([big] + [0.0] * (n - 1), dtype=torch.float64)
        ess = float(ess_frac(*ess_moments(log_w, torch.ones(n, dtype=torch.bool))))
        M = math.exp(big)
        assert ess == pytest.approx((M + n - 1) ** 2 / (n * (M * M + n - 1)), rel=1e-12)
    assert ess == pytest.approx(1 / n, rel=1e-40 + 1e-12)
    for big in (0.0, 1000.0):
        log_w = torch.tensor([big] + [-800.0] * (n - 1), dtype=torch.float64)
        assert float(ess_frac(*ess_moments(log_w, torch.ones(n, dtype=torch.bool)))) == pytest.approx(1 / n, rel=1e-15)
    # the same at the sequence level: one response of many tokens that mu drew far less often than pi_old
    m = step_metrics(algo(), [[5.0] * 40] + [[0.0, 0.0]] * (n - 1))
    assert float(m["rollout_corr/seq_ess_frac"]) == pytest.approx(1 / n, rel=1e-12)


def test_no_token_is_no_scale():
    """A batch without a loss token has no weight: ESS / N = 1 (it scales nothing)."""
    m = mismatch_metrics(torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.bool), torch.zeros(2, 3, dtype=torch.bool),
                         torch.zeros(2, 3, dtype=torch.bool))
    assert float(m["rollout_corr/ess_frac"]) == 1.0 and float(m["rollout_corr/seq_ess_frac"]) == 1.0


# ---------------------------------------------------------------- a step's value: micro-batches, mini-batches, ranks


ROWS = [[LOG2, 0.3, -0.2, 0.0], [-1.0], [0.7, 0.7], [0.0, -0.4, 1.1], [-0.3] * 6]


def by_hand(rows_):
    """(token ESS / N, sequence ESS / N) of these rows, in python floats from the definition."""
    def ess(w):
        return sum(w) ** 2 / (len(w) * sum(x * x for x in w))
    return ess([math.exp(x) for r in rows_ for x in r]), ess([math.exp(sum(r)) for r in rows_])


def splits(n):
    """Every partition of rows 0..n-1 into micro-batches (as a list of lists), in order of first element."""
    for labels in product(range(n), repeat=n):
        if all(labels[i] <= max(labels[:i], default=-1) + 1 for i in range(n)):
            yield [[i for i in range(n) if labels[i] == b] for b in range(max(labels) + 1)]


def test_step_value_is_the_same_for_every_micro_batch_split():
    """All 52 ways to split 5 responses of 1-6 tokens into micro-batches give the step's ESS, at both levels:
    the step's (sum w)^2 / (N sum w^2), not a mean of the micro-batches' values (which differ from it)."""
    cfg, want = algo(), by_hand(ROWS)
    seen = 0
    for split in splits(len(ROWS)):
        st = UpdateStats()
        for part in split:
            m = step_metrics(cfg, [ROWS[i] for i in part])
            st.add(m, torch.tensor(0.0), m["n_tokens"], m["n_tokens"])
        st.end_mini_batch()
        row = st.result()
        assert row["rollout_corr/ess_frac"] == pytest.approx(want[0], abs=1e-13), split
        assert row["rollout_corr/seq_ess_frac"] == pytest.approx(want[1], abs=1e-13), split
        assert not any(k.endswith(("_m1", "_m2")) for k in row)  # the moments are not logged
        seen += 1
    assert seen == 52  # the Bell number B_5
    naive = sum(float(step_metrics(cfg, [r])["rollout_corr/ess_frac"]) for r in ROWS) / len(ROWS)
    assert abs(naive - want[0]) > 0.01


def test_mini_batches_epochs_and_ranks():
    """Two mini-batches (each optimizer step's own ESS: `UpdateStats.mini_batch_ess`), two epochs over them
    (each token counted twice: the step's value is unchanged), and the same step on two data-parallel ranks
    (sums all-reduced before dividing): the values computed by hand."""
    cfg = algo()
    minis = [[0, 1], [2, 3, 4]]
    st, per_step = UpdateStats(), []
    for _epoch in range(2):
        for mini in minis:
            for i in mini:
                m = step_metrics(cfg, [ROWS[i]])
                st.add(m, torch.tensor(0.0), m["n_tokens"], m["n_tokens"])
            st.end_mini_batch()
            per_step.append((float(st.mini_batch_ess("token")), float(st.mini_batch_ess("sequence"))))
    row = st.result()
    assert row["rollout_corr/ess_frac"] == pytest.approx(by_hand(ROWS)[0], abs=1e-13)
    assert row["rollout_corr/seq_ess_frac"] == pytest.approx(by_hand(ROWS)[1], abs=1e-13)
    for got, mini in zip(per_step, minis * 2):
        assert got == pytest.approx(by_hand([ROWS[i] for i in mini]), abs=1e-13)

    ranks = []  # rank 0 holds rows 0-1, rank 1 rows 2-4, of one mini-batch
    for part in minis:
        s = UpdateStats()
        m = step_metrics(cfg, [ROWS[i] for i in part])
        s.add(m, torch.tensor(0.0), m["n_tokens"], m["n_tokens"])
        s.end_mini_batch()
        ranks.append(s)
    other = []
    ranks[1].mini_batch_ess("token", reduce=lambda x, op="sum": other.append(x) or x)
    ranks[1].result(reduce=lambda x, op="sum": other.append(x) or x)

    def all_reduce(x, op="sum"):  # rank 0's view of the two-rank all-reduce, names in the same order
        y = other.pop(0)
        return {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}[op](torch.as_tensor(x), y)

    assert float(ranks[0].mini_batch_ess("token", reduce=all_reduce)) == pytest.approx(by_hand(ROWS)[0], abs=1e-13)
    row = ranks[0].result(reduce=all_reduce)
    assert not other
    assert row["rollout_corr/ess_frac"] == pytest.approx(by_hand(ROWS)[0], abs=1e-13)
    assert row["rollout_corr/seq_ess_frac"] == pytest.approx(by_hand(ROWS)[1], abs=1e-13)


def test_lr_scale_clips_the_power_of_the_ess_fraction():
    """lr_step / lr_sched = clip((ESS/N)^p, floor, 1)."""
    assert float(lr_scale(torch.tensor(0.25))) == 0.25
    assert float(lr_scale(torch.tensor(0.25), power=0.5)) == 0.5
    assert float(lr_scale(torch.tensor(0.25), floor=0.4)) == 0.4
    assert float(lr_scale(torch.tensor(0.25), floor=0.4, power=0.5)) == 0.5
    assert float(lr_scale(torch.tensor(1.0 + 1e-15))) == 1.0  # rounding above 1 never raises the LR


# ---------------------------------------------------------------- train.lr_scale in a run


@pytest.fixture(scope="module")
def workdir(make_workdir):
    return make_workdir("ess", DIGITS)


def _engine(delta_even: float):
    """An ENGINES builder: HFEngine whose batches report mu = the policy's own log-probs, lowered by
    ``delta_even`` on the first token of every even row: r = pi_old / mu = e^delta_even there, 1 elsewhere
    (up to the engine's forward against the trainer's: ~1e-6)."""
    from tether.logprobs import response_stats
    from tether.rollout import HFEngine

    class Shifted(HFEngine):
        def generate(self, prompts, params):
            rb = super().generate(prompts, params)
            with torch.no_grad():
                st = response_stats(self.model, rb.prompt_ids, rb.prompt_mask, rb.response_ids, rb.response_mask,
                                    temperature=params.temperature, entropy=False)
            first = rb.response_mask & (rb.response_mask.cumsum(-1) == 1)
            first[1::2] = False
            rb.sampler_logp = torch.where(rb.response_mask, st.logp.float() - delta_even * first.float(), 0.0)
            return rb

    def build(cfg, model, tokenizer, **over):
        return Shifted(model, tokenizer, batch_size=cfg.batch_size)

    build.reports_logp = True
    return build


@pytest.fixture
def shifted(monkeypatch):
    from tether.rollout import ENGINES

    monkeypatch.setitem(ENGINES, "shifted", _engine(LOG2))
    monkeypatch.setitem(ENGINES, "same", _engine(0.0))


def recording(t: Trainer, lrs=None) -> list:
    """``lrs`` (a new list by default) with the learning rate of each optimizer step of ``t`` appended."""
    lrs = [] if lrs is None else lrs
    t.optimizer.register_step_pre_hook(lambda opt, args, kwargs: lrs.append(opt.param_groups[0]["lr"]))
    return lrs


def test_options_are_never_silent(workdir, tiny_model_dir, shifted):
    def cfg(**over):
        return tiny_config(workdir, tiny_model_dir, "grpo", 2, **over)

    with pytest.raises(ConfigError, match="lr_scale=ess has no effect here.*train.async none and "
                                          "rollout.engine.kind=hf"):
        cfg(**{"train.lr_scale": "ess"})
    with pytest.raises(ConfigError, match="unknown train.lr_scale"):
        cfg(**{"train.lr_scale": "ESS", "train.async.max_staleness": 1})
    with pytest.raises(ConfigError, match="train.lr_scale_floor only applies with train.lr_scale"):
        cfg(**{"train.lr_scale_floor": 0.1})
    with pytest.raises(ConfigError, match="train.lr_scale_power only applies with train.lr_scale"):
        cfg(**{"train.lr_scale_power": 0.5})
    with pytest.raises(ConfigError, match=r"train.lr_scale_floor must be in \[0, 1\)"):
        cfg(**{"train.lr_scale": "ess", "rollout.engine": "shifted", "train.lr_scale_floor": 1.0})
    with pytest.raises(ConfigError, match=r"train.lr_scale_power must be in \(0, 1\]"):
        cfg(**{"train.lr_scale": "seq_ess", "rollout.engine": "shifted", "train.lr_scale_power": 2.0})
    cfg(**{"train.lr_scale": "ess", "train.async.max_staleness": 1})  # the workers report mu
    cfg(**{"train.lr_scale": "seq_ess", "rollout.engine": "shifted", "train.lr_scale_floor": 0.2,
           "train.lr_scale_power": 0.5})


def _first_tokens(b):
    """(N, k, a, c): loss tokens, even rows' first loss tokens (r = 2), and the responses with a loss token:
    even (weight 2) and odd (weight 1)."""
    m = b.loss_mask.cpu()
    has = m.any(-1)
    even = torch.zeros_like(has)
    even[0::2] = True
    first = m & (b.rb.response_mask.cpu().cumsum(-1) == 1)
    k = int((first & even[:, None]).sum())
    return int(m.sum()), k, int((has & even).sum()), int((has & ~even).sum())


@pytest.mark.parametrize("level,over", [("ess", {}), ("ess", {"train.epochs": 2}), ("seq_ess", {}),
                                        ("ess", {"train.lr_scale_power": 0.5, "train.lr_scale_floor": 0.9})])
def test_the_scaled_lr_is_lr_times_the_ess_of_a_constructed_batch(level, over, workdir, tiny_model_dir, tmp_path,
                                                                    shifted):
    """mu lowered by log 2 on the first token of every even row: of N loss tokens k have r = 2, so the token
    ESS / N = (N + k)^2 / (N (N + 3k)); of the responses, a (even) weigh 2 and c (odd) 1, so the sequence
    ESS / N = (2a + c)^2 / ((a + c)(4a + c)). Every optimizer step applies train.lr times it (both epochs'
    steps see the whole batch), the logged lr_scale is it and equals the logged ESS, and the optimizer keeps
    the scheduled LR between steps."""
    cfg = tiny_config(workdir, tiny_model_dir, "grpo", 2, **{"rollout.engine": "shifted", "train.lr_scale": level,
                                                            **over})
    t = build_trainer(cfg, tmp_path / "run", **QUIET)
    lrs = recording(t)
    p, floor = cfg.train.lr_scale_power, cfg.train.lr_scale_floor
    for step in range(2):
        m = t.train_step()
        N, k, a, c = _first_tokens(t._last_batch)
        token, seq = (N + k) ** 2 / (N * (N + 3 * k)), (2 * a + c) ** 2 / ((a + c) * (4 * a + c))
        want = min(1.0, max(floor, (token if level == "ess" else seq) ** p))
        assert k > 0 and want < 1
        assert m["rollout_corr/ess_frac"] == pytest.approx(token, rel=1e-5)
        assert m["rollout_corr/seq_ess_frac"] == pytest.approx(seq, rel=1e-5)
        assert m["lr_scale"] == pytest.approx(want, rel=1e-5)
        logged = m["rollout_corr/ess_frac" if level == "ess" else "rollout_corr/seq_ess_frac"]
        assert m["lr_scale"] == pytest.approx(min(1.0, max(floor, logged ** p)), rel=1e-12)
        n_opt = cfg.train.epochs
        assert lrs[-n_opt:] == [pytest.approx(cfg.train.lr * m["lr_scale"], rel=1e-12)] * n_opt
        assert m["lr"] == cfg.train.lr and t.optimizer.param_groups[0]["lr"] == cfg.train.lr


def test_with_mu_equal_to_pi_old_the_scaled_run_is_the_plain_run_bit_for_bit(workdir, tiny_model_dir, tmp_path,
                                                                             shifted, monkeypatch):
    """The engine's log-probs replaced by the trainer's own pi_old (two mini-batches: recomputed by the sampler
    pass): every weight is 1, ESS / N = 1 exactly, and a run with train.lr_scale=ess is the run without it to
    the last bit: weights and every metric but lr_scale (exactly 1)."""
    out = []
    for name, over in (("plain", {}), ("scaled", {"train.lr_scale": "ess"})):
        cfg = tiny_config(workdir, tiny_model_dir, "grpo", 3, **{"rollout.engine": "same", "train.mini_batches": 2,
                                                                **over})
        t = build_trainer(cfg, tmp_path / name, **QUIET)
        real = t.passes.sampler

        def sampler(b, real=real):
            real(b)
            b.rb.sampler_logp = b.old_logp.clone()  # mu = pi_old, exactly

        monkeypatch.setattr(t.passes, "sampler", sampler)
        ms = [strip(t.train_step()) for _ in range(3)]
        out.append((ms, [p.detach().clone() for p in t.model.parameters()]))
    (plain, w0), (scaled, w1) = out
    assert all(m["lr_scale"] == 1.0 and m["rollout_corr/ess_frac"] == 1.0 for m in scaled)
    assert [{k: v for k, v in m.items() if k != "lr_scale"} for m in scaled] == plain
    assert all(torch.equal(a, b) for a, b in zip(w0, w1))


def test_resume_with_the_scaled_lr_is_exact(workdir, tiny_model_dir, tmp_path, shifted):
    """A 4-step cosine run with train.lr_scale=ess and two mini-batches, stopped after step 2 with a checkpoint
    and resumed, applies the LRs and logs the rows of the run that went on, to the last bit: the multiplier is
    in no checkpointed state (the optimizer's groups hold the scheduled LR)."""
    cfg = tiny_config(workdir, tiny_model_dir, "grpo", 4, **{
        "rollout.engine": "shifted", "train.lr_scale": "ess", "train.schedule": "cosine", "train.warmup_steps": 1,
        "train.mini_batches": 2})
    full = build_trainer(cfg, tmp_path / "full", **QUIET)
    lrs_full = recording(full)
    full.run()
    part = build_trainer(cfg, tmp_path / "part", **QUIET)
    lrs_part = recording(part)
    for _ in range(2):
        part.train_step()
    part.save()
    assert part.optimizer.state_dict()["param_groups"][0]["lr"] == part.scheduler.get_last_lr()[0]
    again = build_trainer(cfg, tmp_path / "part", **QUIET)
    recording(again, lrs_part)
    again.run(resume=True)
    a, b = rows(tmp_path / "full"), rows(tmp_path / "part")
    assert [r["step"] for r in b] == [3, 4] and all(r["lr_scale"] < 1 for r in a)
    assert [strip(r) for r in a[2:]] == [strip(r) for r in b]
    assert lrs_part == lrs_full  # 8 optimizer steps, each at the scheduled LR x its mini-batch's ESS
    assert all(torch.equal(x, y) for x, y in zip(full.model.parameters(), again.model.parameters()))
