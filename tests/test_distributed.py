"""FSDP2 data-parallel training under torchrun, on CPU with gloo (tether.distributed).

Every multi-process run is a subprocess with a hard timeout (a hang fails the test, it does not
stall the suite), and prints every thread's stack shortly before that timeout
(``TETHER_TEST_DUMP_AFTER_S`` in ``tests/dist_main.py``). The training runs use the scripted
engine (``tether.testing.ScriptedEngine``): a response depends only on its prompt and sample
index, so rank r trains on exactly the rows a single process holds for its groups, and the
parameters of both runs can be compared.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import DIGITS, cli_args, rows
from tether import distributed as dist

ROOT = Path(__file__).resolve().parents[1]
MAIN = str(ROOT / "tests" / "dist_main.py")
TIMEOUT = 480  # seconds per launch; a run takes 10-30 s on 2 idle CPU cores, minutes on an overloaded machine
TOL = 1e-5  # most weights of the single-process and the distributed run agree to this
MAX_TOL = 1e-3  # and every weight to this (see _assert_close)
FEW = 1e-3  # the fraction of elements allowed between TOL and MAX_TOL

def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(OMP_NUM_THREADS="1", TETHER_TEST_DUMP_AFTER_S=str(TIMEOUT - 20), TOKENIZERS_PARALLELISM="false")
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):  # never inherit a group
        env.pop(k, None)
    return env


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(nproc: int, *args, nnodes: int = 1, node_rank: int = 0, port: int = 0, rdzv: bool = False) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--nnodes", str(nnodes)]
    if rdzv:
        cmd += ["--node_rank", str(node_rank), "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}",
                "--rdzv_id", "tether-test"]
    else:
        cmd += ["--master_addr", "127.0.0.1", "--master_port", str(port or _port())]
    return cmd + [MAIN, *args]


def _start(cmd, cwd) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _wait(procs: list, timeout: float = TIMEOUT) -> list[str]:
    """Wait for every process; a timeout kills each one's process group and fails the test."""
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                try:
                    os.killpg(q.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            out = p.communicate()[0]
            pytest.fail(f"timed out after {timeout} s (a hang?):\n{out[-6000:]}")
        outs.append(out)
        assert p.returncode == 0, out[-6000:]
    return outs


def _run(cmd, cwd) -> str:
    return _wait([_start(cmd, cwd)])[0]


#: the distributed runs' settings over the tiny run's (helpers.TINY)
DIST = {
    "rollout.engine": "scripted",
    # 2 mini-batches of 8 rows drawn from the global permutation: ranks hold different numbers
    # of each one's rows, hence different numbers of micro-batches of 3
    "train.mini_batches": 2, "train.micro_batch_size": 3,
    # the single process forwards like the ranks do (see test_matches_single_process)
    "train.share_prompt": False,
    "algo.anchor.every": 1,  # the EMA anchor moves every step
    "algo.advantage": "reinforce_pp",  # batch-level normalization: needs the whole batch's rewards
    "run.save_every": 1,
}


def _train_args(work: Path, tiny_model_dir, out: str, steps: int = 2, **over) -> list[str]:
    return cli_args(work, tiny_model_dir, out, steps, **{**DIST, **over})


@pytest.fixture(scope="module")
def work(make_workdir):
    return make_workdir("dist", DIGITS)


@pytest.fixture(scope="module")
def runs(work, tiny_model_dir):
    """The same 2-step run in one process and on 2 processes (checkpoints after each step)."""
    _run([sys.executable, MAIN, *_train_args(work, tiny_model_dir, "one")], work)
    _run(_torchrun(2, *_train_args(work, tiny_model_dir, "two")), work)
    return work / "one", work / "two"


def _diffs(a: Path, b: Path, name: str, step: int = 2) -> tuple[float, float]:
    """(max |a - b|, fraction of elements with |a - b| > TOL) over one checkpoint file of two runs."""
    x = load_file(str(a / "checkpoints" / f"step-{step:06d}" / f"{name}.safetensors"))
    y = load_file(str(b / "checkpoints" / f"step-{step:06d}" / f"{name}.safetensors"))
    assert x.keys() == y.keys() and all(x[k].shape == y[k].shape for k in x)
    d = [(x[k].double() - y[k].double()).abs() for k in x]
    return max(float(t.max()) for t in d), sum(int((t > TOL).sum()) for t in d) / sum(t.numel() for t in d)


def _assert_close(a: Path, b: Path, step: int = 2, names=("policy", "anchor", "optimizer"),
                  max_tol: float = MAX_TOL) -> dict:
    """Two runs that should be the same computation (up to the order of float sums) agree: every element
    within max_tol and all but a FEW of them within TOL. Runs with the same sums in the same order
    (a resume on the same number of ranks) pass max_tol=TOL: every element within TOL.

    AdamW divides by sqrt(v) + eps, so a rounding difference in a near-zero gradient (|g| ~ eps) becomes
    an update difference up to lr (1e-2 here) in that one weight: measured 3e-6 at most on one CPU, and on
    an AVX-512 one 5.2e-5 in 3 of the tiny model's 43,168 weights (relative norm 4e-5). A real error (a
    sample or a rank's gradient missed, a wrong average) moves most weights by ~lr instead."""
    out = {}
    for n in names:
        mx, frac = _diffs(a, b, n, step)
        assert mx <= max_tol and frac <= FEW, (n, f"max |diff| {mx:.2e}", f"fraction > {TOL:g}: {frac:.2e}")
        out[n] = mx
    return out


def test_matches_single_process(runs):
    """2 steps on 2 ranks = 2 steps of one process on the same global batch: policy, EMA anchor, AdamW.

    Measured: ~3e-6 for the policy, ~3e-7 for the anchor (fp32, lr 1e-2; 5e-5 in 3 weights on an
    AVX-512 CPU, see _assert_close). With the shared-prompt forward on in the single process (its
    default; ranks never use it with gradients) the op order differs and AdamW's eps amplifies rounding
    in near-zero gradients: ~2e-4.
    """
    one, two = runs
    diffs = _assert_close(one, two)
    print(f"max |single - distributed| after 2 steps: {diffs}")
    # the logged metrics are the whole batch's, logged once (rank 0 only)
    r1, r2 = rows(one), rows(two)
    assert [r["step"] for r in r2] == [1, 2]
    for a, b in zip(r1, r2):
        for k in ("reward_mean", "reward_std", "accuracy", "response_len", "gen_tokens", "train_tokens",
                  "pg_loss", "kl", "entropy", "grad_norm", "ratio_max", "ratio_min", "anchor_updates"):
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), k
    samples = (two / "samples.jsonl").read_text().splitlines()
    assert len(samples) == len((one / "samples.jsonl").read_text().splitlines())


@pytest.mark.slow  # about 35 s: out of the default suite's 15 minutes, run by CI's slow step
def test_async_staleness_1_matches_single_process(runs, work, tiny_model_dir):
    """train.async.max_staleness=1 on 2 ranks: rank 0's rollout worker (a spawned process) samples each whole step,
    every rank trains on its share of the prompts. The scripted engine's responses depend only on the prompt,
    not on the weights that sample them, so the run lands where the synchronous single process did, whatever
    the staleness (logged once, at most 1), with verified sync (the checksum of the gathered FSDP2 weights must
    leave them freeable); the checkpoint records the jobs consumed, and a resume from step 1
    continues the stream where it was."""
    one, _ = runs
    out = _run(_torchrun(2, *_train_args(work, tiny_model_dir, "two_async", **{"train.async.max_staleness": 1,
                                                                               "train.async.verify_sync": True})), work)
    assert "rollout worker 0 started" in out and out.count("rollout worker 0 started") == 1, out[-3000:]
    _assert_close(one, work / "two_async")
    r1, r2 = rows(one), rows(work / "two_async")
    assert [r["step"] for r in r2] == [1, 2] and all(0 <= r["async/staleness"] <= 1 for r in r2)
    for a, b in zip(r1, r2):
        for k in ("reward_mean", "train_tokens", "pg_loss", "kl"):
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), k
    state = json.loads((work / "two_async" / "checkpoints" / "step-000002" / "state.json").read_text())["trainer"]
    assert state["async_"]["jobs"] == 2 and sum(state["async_"]["staleness"]) == 2
    # resumed on 2 ranks from step 1: the job count and data position restored, the same run's end
    resumed = _truncate_to_step_1(work / "two_async", work / "two_async_resumed")
    _run(_torchrun(2, "train", "--resume", str(resumed)), work)
    _assert_close(one, resumed)


CRASH_SECOND = '''
from tether.agents import SingleTurnAgent


class CrashSecond(SingleTurnAgent):
    calls = 0

    def rollout(self, examples, params):
        type(self).calls += 1
        if type(self).calls == 2:
            raise RuntimeError("boom in the second job")
        return super().rollout(examples, params)


def crash_second(engine, tokenizer, **options):
    return CrashSecond(engine, tokenizer, **options)
'''


@pytest.mark.slow  # about 12 s: out of the default suite's 15 minutes, run by CI's slow step
def test_async_worker_failure_stops_every_rank_after_a_checkpoint(work, tiny_model_dir):
    """Rank 0's rollout worker raises in its second job: every rank stops with the worker's error (none waits
    on a collective rank 0 never reaches), after step 1's checkpoint, and the worker is gone."""
    (work / "crash_second.py").write_text(CRASH_SECOND)
    args = _train_args(work, tiny_model_dir, "two_async_crash", steps=3, **{
        "train.async.max_staleness": 1, "rollout.agent": f"{work / 'crash_second.py'}:crash_second"})
    p = _start(_torchrun(2, *args), work)
    try:
        out, _ = p.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        pytest.fail(f"timed out (a rank hung?):\n{p.communicate()[0][-6000:]}")
    assert p.returncode != 0, out[-3000:]
    # the error on the ranks (torchrun may end rank 0 with SIGTERM before it prints, once rank 1 exited 2)
    assert "tether: error: trainer step 2: rollout worker 0 (pid" in out, out[-4000:]
    assert "boom in the second job" in out and "step 1's checkpoint" in out, out[-4000:]
    assert (work / "two_async_crash" / "checkpoints" / "step-000001").is_dir()
    assert not (work / "two_async_crash" / "checkpoints" / "step-000002").exists()
    pids = [int(ln.split("pid ")[1].split(")")[0]) for ln in out.splitlines() if "rollout worker 0 started" in ln]
    assert len(pids) == 1 and _gone(pids[0]), out[-3000:]


def _gone(pid: int, wait_s: float = 30.0) -> bool:
    """Whether process ``pid`` has exited (within ``wait_s``: a worker whose trainer was killed notices it)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def _truncate_to_step_1(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    shutil.rmtree(dst / "checkpoints" / "step-000002")
    (dst / "checkpoints" / "latest").write_text("step-000001\n")
    return dst


@pytest.mark.slow  # about 8 s: out of the default suite's 15 minutes, run by CI's slow step
def test_resume_same_world_size(runs, work):
    """Resuming the 2-rank run from its step-1 checkpoint on 2 ranks lands where the unbroken run did."""
    one, two = runs
    resumed = _truncate_to_step_1(two, work / "two_resumed")
    _run(_torchrun(2, "train", "--resume", str(resumed)), work)
    _assert_close(two, resumed, max_tol=TOL)
    assert [r["step"] for r in rows(resumed)] == [1, 2]


def test_resume_other_world_size_reshards(runs, work):
    """Checkpoints hold whole tensors, so a 2-rank checkpoint resumes in one process (and back)."""
    one, two = runs
    resumed = _truncate_to_step_1(two, work / "two_resumed_on_1")
    _run([sys.executable, MAIN, "train", "--resume", str(resumed)], work)
    _assert_close(one, resumed)


def test_pitfalls_generation_anchor_head(work, tiny_model_dir):
    """Different response lengths per rank do not hang; the anchor swap, resharding after edits and
    the chunked log-prob head are right under FSDP (each against an unsharded copy; dist_main.check)."""
    out = _run(_torchrun(2, "check", str(tiny_model_dir)), work)
    assert "generated widths [2, 16]" in out, out[-3000:]
    assert out.count("[check] rank") >= 4 and "rank 0: ok" in out and "rank 1: ok" in out


@pytest.mark.slow  # about 15 s: out of the default suite's 15 minutes, run by CI's slow step
def test_two_node_rendezvous_with_lora(work, tiny_model_dir):
    """Two torchrun agents (--nnodes 2, c10d rendezvous on 127.0.0.1) complete a 1-step run; with LoRA
    and gradient checkpointing (frozen sharded base, adapters trained), it equals one process."""
    port = _port()
    lora = {"model.lora_r": 4, "model.gradient_checkpointing": True}
    args = _train_args(work, tiny_model_dir, "two_nodes", steps=1, **lora)
    procs = [_start(_torchrun(1, *args, nnodes=2, node_rank=i, port=port, rdzv=True), work) for i in (0, 1)]
    procs.append(_start([sys.executable, MAIN, *_train_args(work, tiny_model_dir, "lora_one", steps=1, **lora)], work))
    _wait(procs)
    assert [r["step"] for r in rows(work / "two_nodes")] == [1]
    _assert_close(work / "lora_one", work / "two_nodes", step=1)
    assert all("lora_" in k for k in load_file(str(work / "two_nodes/checkpoints/step-000001/policy.safetensors")))


def test_prompts_must_divide_over_ranks(monkeypatch):
    """rollout.prompts_per_step is split over the ranks; an uneven split is an error naming the option."""
    monkeypatch.setattr(dist, "world_size", lambda: 4)
    monkeypatch.setattr(dist, "rank", lambda: 1)
    assert dist.rank_slice(8) == slice(2, 4)
    with pytest.raises(ValueError, match=r"rollout.prompts_per_step=6 does not divide over 4 ranks"):
        dist.rank_slice(6)


def test_rank_seeds_differ_and_are_reproducible(monkeypatch):
    """Each rank samples with its own seed (rank 0 keeps the single-process one), fixed per step."""
    seeds = []
    for r in range(4):
        monkeypatch.setattr(dist, "rank", lambda r=r: r)
        seeds.append(dist.rank_seed(123456))
    assert seeds[0] == 123456 and len(set(seeds)) == 4 and all(0 <= s < 2**31 for s in seeds)
    monkeypatch.setattr(dist, "rank", lambda: 3)
    assert dist.rank_seed(123456) == seeds[3]


def test_helpers_are_identities_in_one_process():
    """Without torchrun nothing changes: no group, rank 0 of 1, reductions return their input."""
    assert not dist.enabled() and dist.world_size() == 1 and dist.rank() == 0 and dist.is_main()
    t = torch.tensor([1.0, 2.0])
    assert dist.all_reduce(t) is t and dist.all_reduce(3.0) == 3.0
    full, off = dist.all_gather_cat(t)
    assert full is t and off == 0
    assert dist.rank_slice(6) == slice(0, 6) and dist.rank_seed(123) == 123
    m = torch.nn.Linear(2, 2)
    assert dist.shard_model(m) is m and not dist.is_sharded(m)
    with dist.gathered(m) as g:
        assert g is m
