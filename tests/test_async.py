"""Asynchronous RL (train.async.max_staleness K, tether.asynchronous.workers): real worker processes on the tiny model.

K = 0 is the synchronous loop, bit for bit; K >= 1 trains with every consumed batch at most K versions old,
tagged with the version that sampled it; verified sync catches a corrupted or stale push; LoRA and tied
embeddings reach the workers as the weights the trainer samples with (checksums and log-probs); a
multi-turn environment runs in a worker; a failing worker is a named error and a SIGTERM a graceful stop,
with no process left behind. No timing thresholds: staleness depends on timing, its bound does not.
"""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import ALWAYS_ENV, DIGITS, cli_args, rows, run_module, strip, subprocess_env, tiny_config
from tether.asynchronous.weights import WeightSyncError, effective_weights
from tether.asynchronous.workers import Job
from tether.errors import ConfigError
from tether.rollout import SamplingParams
from tether.rundir.checkpoint import latest_checkpoint
from tether.train import build_trainer, train

REWARD = DIGITS + '''
import os, signal


def signals_self(completion, example):
    """digits; sends $TETHER_TEST_SIGNAL to this very process once (the trainer's: data.reward_timeout=0)."""
    name = os.environ.pop("TETHER_TEST_SIGNAL", None)
    if name:
        os.kill(os.getpid(), getattr(signal, name))
    return digits(completion, example)
'''

CRASHING_AGENT = '''
from tether.agents import SingleTurnAgent


class Crashing(SingleTurnAgent):
    def rollout(self, examples, params):
        raise RuntimeError("boom in the rollout worker")


def crashing(engine, tokenizer, **options):
    return Crashing(engine, tokenizer, **options)
'''

QUIET = dict(log=lambda *a: None)
pytestmark = pytest.mark.usefixtures("one_thread")
TIMEOUT = 240


@pytest.fixture(scope="module")
def workdir(make_workdir):
    return make_workdir("async", REWARD)


def asynchronous(k: int, **over) -> dict:
    return {"train.async.max_staleness": k, "train.async.verify_sync": True, **over}


def gone(pid: int, wait_s: float = 10.0) -> bool:
    """Whether process ``pid`` has ended (a zombie counts as ended) within ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ")[-1].startswith("Z"):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


# ---------------------------------------------------------------- K = 0 and the options


def test_k0_is_the_synchronous_loop_bit_for_bit(workdir, tiny_model_dir, tmp_path):
    """train.async=none is today's loop: the same metrics and weights, to exact equality, as the config
    without the option, and no worker process, no async/* metric."""
    out = []
    for name, over in (("absent", {}), ("none", {"train.async": None})):
        cfg = tiny_config(workdir, tiny_model_dir, "grpo", 3, **{"train.mini_batches": 2, **over})
        t = build_trainer(cfg, tmp_path / name, **QUIET)
        assert t.feed is None
        ms = [strip(t.train_step()) for _ in range(3)]
        assert not any(k.startswith("async/") for m in ms for k in m)
        out.append((ms, [p.detach().clone() for p in t.model.parameters()]))
    assert out[0][0] == out[1][0]
    assert all(torch.equal(a, b) for a, b in zip(out[0][1], out[1][1]))


@pytest.mark.parametrize("over,msg", [
    ({"train.async.max_staleness": 1, "train.async.stale_batches": "keep"}, "train.async.stale_batches has no effect"),
    ({"train.async.max_staleness": 1, "train.async.workers": 3, "train.async.stale_batches": "maybe"},
     "unknown train.async.stale_batches 'maybe'. Valid choices: drop, keep"),
    ({"train.async.max_staleness": 0}, "train.async.max_staleness must be >= 1, got 0"),
    ({"train.async": -1}, "train.async.max_staleness must be >= 1, got -1"),
    ({"train.async.workers": 0}, "train.async.workers must be >= 1, got 0"),
    ({"train.async.max_staleness": 1, "rollout.dynamic_sampling": True}, "does not support rollout.dynamic_sampling"),
    ({"train.async.verify_logp_tol": 0.1}, "verify_logp_tol only applies with train.async.verify_sync=true and "
                                           "rollout.engine.kind=vllm"),
    ({"train.async.correction": False, "algo.tis_cap": 2.0}, "train.async.correction=false has no effect"),
    ({"train.async.transport.kind": "remote"}, "the remote transport .* was retired"),
])
def test_async_options_are_never_silent(over, msg, workdir, tiny_model_dir):
    with pytest.raises(ConfigError, match=msg):
        tiny_config(workdir, tiny_model_dir, "grpo", 2, **over)


def test_rollout_correction_needs_a_logp_engine_only_when_synchronous(workdir, tiny_model_dir):
    with pytest.raises(ConfigError, match="or train.async: the rollout workers record them"):
        tiny_config(workdir, tiny_model_dir, "grpo", 2, **{"algo.tis_cap": 2.0})
    tiny_config(workdir, tiny_model_dir, "grpo", 2, **{"algo.tis_cap": 2.0, "train.async.max_staleness": 1})


def test_asynchronous_training_is_corrected_by_default(workdir, tiny_model_dir, monkeypatch):
    """train.async.correction (docs/evidence.md, staleness): with K >= 1, an engine whose workers pass log-probs
    on and no correction key set, the resolved config carries TIS cap 2 + IcePop [0.5, 5]; false leaves the lag
    uncorrected; a correction set by hand is used as given (and then false is refused as having no effect, as it is
    with K = 0); a Config built in Python gets the same default from build_parts (apply_async_correction,
    idempotent)."""
    from tether.config import Config
    from tether.resolve import apply_async_correction

    def corr(c):
        return (c.algo.tis_cap, c.algo.mask_token_low, c.algo.mask_token_high)

    assert corr(tiny_config(workdir, tiny_model_dir, "grpo", 2)) == (0.0, 0.0, 0.0)
    assert corr(tiny_config(workdir, tiny_model_dir, "grpo", 2, **asynchronous(1))) == (2.0, 0.5, 5.0)
    off = tiny_config(workdir, tiny_model_dir, "grpo", 2, **asynchronous(1, **{"train.async.correction": False}))
    assert corr(off) == (0.0, 0.0, 0.0)
    own = tiny_config(workdir, tiny_model_dir, "grpo", 2, **asynchronous(2, **{"algo.tis_cap": math.inf}))
    assert corr(own) == (math.inf, 0.0, 0.0)
    sampler = tiny_config(workdir, tiny_model_dir, "rpg_fkl", 2, **asynchronous(1, **{"algo.kl_sampler": "mu"}))
    assert corr(sampler) == (0.0, 0.0, 0.0) and sampler.algo.kl_sampler == "mu"
    with pytest.raises(ConfigError, match="train.async.correction=false has no effect: a rollout correction is set"):
        tiny_config(workdir, tiny_model_dir, "grpo", 2,
                    **asynchronous(1, **{"train.async.correction": False, "algo.tis_cap": 2.0}))
    # a key of the async section turns it on, with its defaults (K = 1): nothing is set without effect
    on = tiny_config(workdir, tiny_model_dir, "grpo", 2, **{"train.async.correction": False})
    assert on.train.max_staleness == 1 and corr(on) == (0.0, 0.0, 0.0)
    # an engine whose workers pass no log-probs on (a registered test engine): no default, and a correction set
    # by hand is refused before the run rather than failing at its first update
    # (registered for this test only: the registry is global, and docs/config.md lists its engines)
    from tether.rollout import ENGINES
    from tether.testing import ScriptedEngine
    monkeypatch.setitem(ENGINES._items, "scripted", lambda cfg, model, tok, **o: ScriptedEngine(model, tok))
    monkeypatch.setitem(ENGINES._meta, "scripted", {"reports_logp": False})
    assert corr(tiny_config(workdir, tiny_model_dir, "grpo", 2, **asynchronous(1, **{"rollout.engine": "scripted"}))) \
        == (0.0, 0.0, 0.0)
    with pytest.raises(ConfigError, match="rollout workers' rollout.engine.kind=scripted passes none on"):
        tiny_config(workdir, tiny_model_dir, "grpo", 2,
                    **asynchronous(1, **{"rollout.engine": "scripted", "algo.tis_cap": 2.0}))
    py = Config()
    py.train.async_ = 1  # the shorthand, as in a YAML file
    assert corr(apply_async_correction(py)) == (2.0, 0.5, 5.0) and corr(apply_async_correction(py)) == (2.0, 0.5, 5.0)
    py.algo.tis_cap = 3.0  # set by hand after resolution: kept
    assert corr(apply_async_correction(py)) == (3.0, 0.5, 5.0)


DROP_LOGP_AGENT = '''
from tether.agents import SingleTurnAgent


class DropLogp(SingleTurnAgent):
    def rollout(self, examples, params):
        rb = super().rollout(examples, params)
        rb.sampler_logp = None
        return rb


def drop_logp(engine, tokenizer, **options):
    return DropLogp(engine, tokenizer, **options)
'''


def test_an_agent_that_drops_the_log_probs_is_a_named_error(workdir, tiny_model_dir, tmp_path):
    """The default correction with a user agent that does not pass the engine's log-probs on: the first update
    stops with a ConfigError naming the agent and the way out (train.async.correction=false), not a ValueError
    from inside the loss."""
    (tmp_path / "drop.py").write_text(DROP_LOGP_AGENT)
    cfg = tiny_config(workdir, tiny_model_dir, "grpo", 2,
                      **asynchronous(1, **{"rollout.agent": f"{tmp_path / 'drop.py'}:drop_logp"}))
    t = build_trainer(cfg, tmp_path / "run", **QUIET)
    try:
        with pytest.raises(ConfigError, match=r"rollout.agent.kind=.*drop.py:drop_logp did not pass them on \(or "
                                              r"train.async.correction=false"):
            t.train_step()
    finally:
        t.close()


# ---------------------------------------------------------------- K >= 1 trains, staleness <= K


@pytest.mark.parametrize("k,over", [(1, {"algo.tis_cap": 2.0}), (2, {}), (1, {"train.async.workers": 3}),
                                    (2, {"train.lr_scale": "ess"})])
def test_async_trains_with_staleness_at_most_k(k, over, workdir, tiny_model_dir, tmp_path):
    """Every consumed batch is at most K versions old (or dropped, with more than K + 1 workers), tagged with
    the version that sampled it; the loss is finite and the weights move; with algo.tis_cap the correction
    runs on the workers' log-probs (ratio exactly 1 on a batch of the current version). The mismatch metrics
    and their ESS are logged with or without a correction; train.lr_scale=ess scales each step by it."""
    steps = 5
    cfg = tiny_config(workdir, tiny_model_dir, "grpo", steps, **asynchronous(k, **over))
    t = build_trainer(cfg, tmp_path / "run", **QUIET)
    try:
        before = [p.detach().clone() for p in t.model.parameters()]
        ms = [t.train_step() for _ in range(steps)]
    finally:
        t.close()
    for step, m in enumerate(ms):
        assert 0 <= m["async/staleness"] <= k, m
        assert m["async/version"] == step - m["async/staleness"]  # the trainer was at version `step`
        assert math.isfinite(m["pg_loss"]) and m["skipped_updates"] == 0
        assert m["async/worker_gen_s"] > 0 and m["async/wait_s"] >= 0
        assert math.isfinite(m["rollout_corr/ratio_mean"]) and 0 < m["rollout_corr/ess_frac"] <= 1
        if m["async/staleness"] == 0:
            assert m["rollout_corr/ratio_max"] == pytest.approx(1.0, abs=1e-4)
            assert m["rollout_corr/ess_frac"] == pytest.approx(1.0, abs=1e-8)
        if "train.lr_scale" in over:  # one mini-batch: the step's ESS
            assert m["lr_scale"] == pytest.approx(m["rollout_corr/ess_frac"], rel=1e-12)
    last = ms[-1]
    hist = [last[f"async/staleness_{s}"] for s in range(max(k + 1, cfg.train.async_.workers))]
    assert sum(hist) == steps and hist == [sum(m["async/staleness"] == s for m in ms) for s in range(len(hist))]
    assert all(hist[s] == 0 for s in range(k + 1, len(hist)))
    assert t.feed.consumed == steps + last["async/dropped"]
    assert any(not torch.equal(a, p) for a, p in zip(before, t.model.parameters()))
    assert all(not p.is_alive() for p in t.feed.pool.procs)


def test_async_at_staleness_0_is_the_synchronous_loop_bit_for_bit(workdir, tiny_model_dir, tmp_path, monkeypatch):
    """With one job in flight (each submitted after the last push, so sampled by the newest version) a K = 1 run
    is the synchronous loop to the last bit: every metric and every weight equal, the EMA anchor's period
    included. The worker's sampling, the batch's trip back, the trainer's passes and update add nothing; all a
    K >= 1 run changes is which version samples a batch (#28's held-out deficit is the lag's, not the pipeline's)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the worker's torch threads, as the trainer's (one_thread)
    steps, over = 3, {"train.mini_batches": 2, "algo.anchor.every": 2}
    sync = build_trainer(tiny_config(workdir, tiny_model_dir, "ema_pg", steps, **over), tmp_path / "sync", **QUIET)
    ms = [strip(sync.train_step()) for _ in range(steps)]
    # uncorrected (train.async.correction=false): the default correction re-weights by pi_old / mu, which at the
    # current version is 1 only up to the engine's numerics, so it would not be bit for bit
    t = build_trainer(tiny_config(workdir, tiny_model_dir, "ema_pg", steps,
                                  **asynchronous(1, **over, **{"train.async.correction": False})), tmp_path / "k1",
                      **QUIET)
    t.feed.pool.lookahead = 1
    try:
        ma = [strip(t.train_step()) for _ in range(steps)]
    finally:
        t.close()
    assert all(m["async/staleness"] == 0 for m in ma)
    # the rollout_corr/* metrics are the workers' log-probs against the trainer's (which the synchronous loop has
    # none of): at the current version, the same numbers up to the engine's numerics
    assert all(m["rollout_corr/ess_frac"] == pytest.approx(1.0, abs=1e-8) for m in ma)
    assert [{k: v for k, v in m.items() if not k.startswith(("async/", "rollout_corr/"))} for m in ma] == ms
    assert all(torch.equal(a, b) for a, b in zip(sync.model.parameters(), t.model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(sync.anchor.master, t.anchor.master))


# ---------------------------------------------------------------- verified sync


def _job(t, i: int, n_examples: int = 2) -> Job:
    return Job(i, t.data.take(n_examples), SamplingParams(n=2, temperature=0.7, max_new_tokens=6, seed=i),
               t.data.position)


def test_verified_sync_catches_a_corrupted_and_a_stale_push(workdir, tiny_model_dir, tmp_path, monkeypatch):
    cfg = tiny_config(workdir, tiny_model_dir, "grpo", 2, **asynchronous(1))
    t = build_trainer(cfg, tmp_path / "run", **QUIET)
    w = t.feed.pool
    try:
        w.submit(_job(t, 100))  # version 0, as pushed: checksums agree
        r = w.next_batch()
        assert r.version == 0 and r.checksum == w.checksums[0] and r.rb.sampler_logp is not None

        real = w.shared.write

        def corrupted(weights, version):  # the push lands, then one number flips in the shared copy
            real(weights, version)
            next(iter(w.shared.tensors.values())).view(-1)[0] += 1.0

        monkeypatch.setattr(w.shared, "write", corrupted)
        w.push(t.model, 1)
        w.submit(_job(t, 101))
        with pytest.raises(WeightSyncError, match="not version 1's"):
            w.next_batch()

        # a stale push: the version moves on, the weights do not
        monkeypatch.setattr(w.shared, "write", lambda weights, version: setattr(w.shared.version, "value", version))
        with torch.no_grad():
            next(t.model.parameters()).add_(0.01)
        w.push(t.model, 2)
        w.submit(_job(t, 102))
        with pytest.raises(WeightSyncError, match="not version 2's"):
            w.next_batch()
    finally:
        t.close()


@pytest.mark.parametrize("kind", ["lora", "tied"])
def test_lora_and_tied_weights_reach_the_workers(kind, workdir, tiny_model_dir, tmp_path_factory, tmp_path):
    """After a trainer step the worker samples with the trainer's weights at that version: LoRA merged into the
    base (not the base alone), a tied lm_head = the new embeddings. Checksums agree and the worker's
    log-probs of its sampled tokens equal the trainer's own forward at that version."""
    from tether.logprobs import response_stats
    from tether.testing import make_tiny_model_dir

    if kind == "lora":
        model_dir, over = tiny_model_dir, {"model.lora_r": 4, "model.lora_target_modules": ["q_proj", "v_proj"]}
    else:
        model_dir, over = make_tiny_model_dir(tmp_path_factory.mktemp("tied"), tie_word_embeddings=True), {}
    cfg = tiny_config(workdir, model_dir, "grpo", 2, **asynchronous(1, **over))
    t = build_trainer(cfg, tmp_path / "run", **QUIET)
    try:
        t.train_step()  # the update changes the adapter / the (tied) embeddings; version 1 is pushed
        eff = effective_weights(t.model)
        if kind == "lora":
            base = dict(t.model.get_base_model().named_parameters())
            q = "model.layers.0.self_attn.q_proj"
            assert not torch.equal(eff[f"{q}.weight"], base[f"{q}.base_layer.weight"])  # the adapter moved
        else:
            assert eff["lm_head.weight"].data_ptr() == eff["model.embed_tokens.weight"].data_ptr()  # one tensor
            shared = t.feed.pool.shared  # stored once, pushed under both names
            assert {"lm_head.weight", "model.embed_tokens.weight"} <= shared.names() and len(shared.alias) == 1
        t.feed.pool.next_batch()  # job 1, submitted during step 1
        t.feed.pool.submit(_job(t, 200, n_examples=1))
        r = t.feed.pool.next_batch()
        assert r.version == 1 and r.checksum == t.feed.pool.checksums[1]
        rb = r.rb
        with torch.no_grad():
            st = response_stats(t.model, rb.prompt_ids, rb.prompt_mask, rb.response_ids, rb.response_mask,
                                temperature=0.7, entropy=False)
        m = rb.response_mask
        assert torch.allclose(rb.sampler_logp[m], st.logp.float()[m], atol=1e-5, rtol=0)
    finally:
        t.close()


# ---------------------------------------------------------------- agents and environments in a worker


@pytest.mark.parametrize("env", ["calculator", "user"])
def test_a_multi_turn_environment_runs_in_a_worker(env, tiny_model_dir, tmp_path):
    from tether.resolve import load_config

    over = {"model.name": str(tiny_model_dir), "rollout.max_new_tokens": 12, "rollout.prompts_per_step": 2,
            "rollout.n": 2, "train.steps": 2, "run.progress": False, "run.plot": False, "run.save_every": 0,
            "eval.before": False, "eval.after": False, "rollout.agent": "multi_turn",
            "rollout.agent.env.max_context": 600, **asynchronous(1)}
    if env == "user":
        (tmp_path / "always.py").write_text(ALWAYS_ENV)
        over["rollout.agent.env.name"] = f"{tmp_path / 'always.py'}:Always"
    run = train(load_config(None, over), tmp_path / "run", **QUIET)
    for r in rows(run):
        assert r["async/staleness"] <= 1 and r["skipped_updates"] == 0 and math.isfinite(r["pg_loss"])
        if env == "calculator":
            assert r["calculator/turns"] >= 1 and "calculator/invalid_action_rate" in r
        else:  # two turns, an observation each; the environment's reward parts came back with the batch
            assert r["always/turns"] == 2 and r["reward_mean"] >= 10.0


# ---------------------------------------------------------------- failures and signals


def test_a_failing_worker_is_a_named_error_and_leaves_no_process(workdir, tiny_model_dir, tmp_path, capsys):
    from tether.cli import main

    (tmp_path / "crash.py").write_text(CRASHING_AGENT)
    args = cli_args(workdir, tiny_model_dir, tmp_path / "run", 2, "grpo",
                    **{**asynchronous(1), "rollout.agent": f"{tmp_path / 'crash.py'}:crashing", "eval.before": False,
                       "eval.after": False})
    assert main(args) == 2
    err = capsys.readouterr()
    assert "tether: error: trainer step 1: rollout worker 0 (pid" in err.err
    assert "failed: RuntimeError: boom in the rollout worker (at crash.py:" in err.err
    pids = [int(ln.split("pid ")[1].rstrip(")")) for ln in err.out.splitlines() if "rollout worker 0 started" in ln]
    assert len(pids) == 1 and gone(pids[0])


@pytest.mark.slow  # about 23 s: out of the default suite's 15 minutes, run by CI's slow step
def test_sigterm_stops_with_a_checkpoint_no_orphan_workers_and_resumes(workdir, tiny_model_dir, tmp_path):
    """`tether train` in a subprocess sends itself SIGTERM during step 1 (its reward): the step finishes, a
    checkpoint is written, the process exits 143 and its workers are gone; --resume regenerates the batches
    that were in flight and trains to the end."""
    run, log = tmp_path / "run", tmp_path / "train.log"
    args = cli_args(workdir, tiny_model_dir, run, 3, "grpo", reward="signals_self",
                    **{**asynchronous(2), "data.reward_timeout": 0, "eval.before": False, "eval.after": False})
    tether = str(Path(sys.executable).parent / "tether")
    env = subprocess_env(OMP_NUM_THREADS="1", TETHER_TEST_SIGNAL="SIGTERM")
    with open(log, "w") as out:
        p = subprocess.run([tether, *args], stdout=out, stderr=subprocess.STDOUT, env=env, timeout=TIMEOUT)
    text = log.read_text()
    assert p.returncode == 128 + signal.SIGTERM, text[-3000:]
    assert "stopped by SIGTERM after step 1" in text, text[-3000:]
    assert latest_checkpoint(run).name.endswith("1"), text[-3000:]
    pids = [int(ln.split("pid ")[1].rstrip(")")) for ln in text.splitlines() if "rollout worker 0 started" in ln]
    assert len(pids) == 1 and gone(pids[0]), text[-3000:]
    state = json.loads((latest_checkpoint(run) / "state.json").read_text())["trainer"]
    assert state["async_"]["jobs"] == 1 and state["data_position"] == 4  # job 1 and 2 were in flight: not saved
    env.pop("TETHER_TEST_SIGNAL")
    r = subprocess.run([tether, "train", "--resume", str(run)], env=env, capture_output=True, text=True,
                       timeout=TIMEOUT)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    ms = rows(run)
    assert [m["step"] for m in ms] == [1, 2, 3] and all(m["async/staleness"] <= 2 for m in ms)
    assert not any(os.path.exists(f"/proc/{pid}") and not gone(pid, 0.1) for pid in pids)


# ---------------------------------------------------------------- drop / keep, deterministically


class ScriptedWorkers:
    """RolloutWorkers' interface in this process: batches from the trainer's own agent, tagged with the
    versions of ``VERSIONS`` in turn (what timing decides with real workers)."""

    VERSIONS: list = []
    restarts = 0

    def __init__(self, cfg, model, n, lookahead, verify, version=0, log=print, tokenizer=None):
        self.lookahead, self.jobs, self.agent, self.versions = lookahead, [], None, list(self.VERSIONS)

    def wants_job(self):
        return len(self.jobs) < self.lookahead

    def submit(self, job):
        self.jobs.append(job)

    def next_batch(self):
        from tether.asynchronous.workers import Rollout

        job = self.jobs.pop(0)
        return Rollout(job=job, rb=self.agent.rollout(job.examples, job.params), version=self.versions.pop(0),
                       worker=0, checksum=None)

    def push(self, model, version):
        pass

    def close(self):
        pass


@pytest.mark.parametrize("policy", ["drop", "keep"])
def test_a_batch_older_than_k_is_dropped_or_kept(policy, workdir, tiny_model_dir, tmp_path, monkeypatch):
    """K = 1 with 3 workers: the third job was sampled by version 0 and is consumed at version 2. drop discards
    it (its prompts skipped, counted; the checkpointed data position is past it) and trains on the next
    batch; keep trains on it at staleness 2."""
    import tether.asynchronous.feed as feed

    monkeypatch.setattr(ScriptedWorkers, "VERSIONS", [0, 0, 0, 2, 2])
    monkeypatch.setattr(feed, "RolloutWorkers", ScriptedWorkers)
    # scripted batches carry no engine log-probs: uncorrected (train.async.correction=false)
    over = {"train.async.workers": 3, "train.async.stale_batches": policy, "train.async.correction": False}
    t = build_trainer(tiny_config(workdir, tiny_model_dir, "grpo", 3, **asynchronous(1, **over)), tmp_path / "r",
                      **QUIET)
    t.feed.pool.agent = t.agent
    sampled = []  # per step: the batch was stale, and the sampler pass recomputed pi_old
    sampler = t.passes.sampler

    def recording(b):
        sampler(b)
        sampled.append((b.stale, b.old_logp is not None))

    monkeypatch.setattr(t.passes, "sampler", recording)
    ms = [t.train_step() for _ in range(3)]
    assert [m["async/staleness"] for m in ms] == ([0, 1, 0] if policy == "drop" else [0, 1, 2])
    assert ms[-1]["async/dropped"] == (1 if policy == "drop" else 0)
    assert [ms[-1][f"async/staleness_{s}"] for s in range(3)] == ([2, 1, 0] if policy == "drop" else [1, 1, 1])
    # grpo, one optimizer step a batch: pi_old is recomputed by the trainer exactly for a stale batch
    assert sampled == [(False, False), (True, True), (policy == "keep",) * 2]
    jobs = 4 if policy == "drop" else 3
    assert t.state()["async_"]["jobs"] == jobs and t.state()["data_position"] == 4 * jobs


def test_tether_worker_is_gone():
    """`tether worker` (the remote transport's worker) was retired for served rollouts
    (rollout.engine.kind=vllm_server): the command no longer exists."""
    r = run_module("worker", "127.0.0.1:1")
    assert r.returncode == 2 and "invalid choice: 'worker'" in r.stderr
