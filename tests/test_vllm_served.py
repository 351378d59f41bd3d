"""rollout.engine.kind=vllm_server: generation through real vLLM servers (vLLM's CPU backend, on loopback) and weights
through vLLM's weight-transfer protocol with tether's gloo backend (a vLLM plugin entry point).

Needs vLLM, which lives in its own environment: skipped by the default suite, run by CI's vLLM step
(``TETHER_VENV=$PWD/.venv-vllm bash scripts/test.sh tests/test_vllm_served.py``). The tiny model has head_dim 64
(vLLM's CPU attention refuses 8). Servers start in 20-60 s each on 2 cores; the module shares one launched server
(engine-level tests) and one server started by the test itself, as a user would (``urls``), with an API key.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm")

from helpers import DIGITS, assert_clean_error, rows, subprocess_env, terminal_sigint  # noqa: E402
from tether.config.engine import VLLMServerEngineConfig  # noqa: E402
from tether.logprobs import response_stats  # noqa: E402
from tether.models import ModelConfig, load_model  # noqa: E402
from tether.procs import die_with_parent, group_alive  # noqa: E402
from tether.rollout import SamplingParams, weight_transfer  # noqa: E402
from tether.rollout.served import ServedEngine, ServedWeightSyncError  # noqa: E402
from tether.rollout.servers import LOGPROBS_MODE, free_port  # noqa: E402
from tether.rollout.vllm import VLLMEngine  # noqa: E402
from tether.testing import make_tiny_model_dir  # noqa: E402

SHAPE = dict(hidden_size=128, num_heads=2, num_kv_heads=2, intermediate_size=128)
PROMPTS = ["Hello world", "What is 2 + 2? The answer", "x", "Let x be a number such that 3x + 5 = 20. Then"]
SERVER = dict(dtype="float32", enforce_eager=True, kv_cache_gb=1, max_model_len=256)
KEY = "test-key-0123456789abcdef0123456789"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("served_tiny"), seed=1, **SHAPE)


@pytest.fixture(scope="module")
def served(tiny_dir, tmp_path_factory):
    """(model, tokenizer, a served engine on one launched server, an in-process vLLM engine on the same weights)."""
    model, tok = load_model(ModelConfig(name=str(tiny_dir)))
    eng = ServedEngine(model, tok, VLLMServerEngineConfig(launch=1, **SERVER),
                       log_dir=tmp_path_factory.mktemp("served_logs"), log=lambda m: None)
    local = VLLMEngine(model, tok, dtype="float32", enforce_eager=True, kv_cache_gb=1, max_model_len=256)
    yield model, tok, eng, local
    eng.close()


def _prompts(tok):
    return [tok(t)["input_ids"] for t in PROMPTS]


def _trainer_logp(model, rb):
    with torch.no_grad():
        return response_stats(model, rb.prompt_ids, rb.prompt_mask, rb.response_ids, rb.response_mask,
                              entropy=False).logp.float()


# ---------------------------------------------------------------- generation and weights, engine level


def test_served_samples_equal_the_in_process_engine(served):
    """Same weights and seeds: the same sampled ids as the in-process vLLM engine (one engine build, vLLM's own
    sampler), log-probs within the vLLM tests' 1e-4 of the in-process engine's and the trainer's; every token
    tagged with version 0."""
    model, tok, eng, local = served
    p = SamplingParams(n=3, temperature=1.0, top_p=0.9, max_new_tokens=16, seed=11, stop=["."])
    a, b = eng.generate(_prompts(tok), p), local.generate(_prompts(tok), p)
    assert a.response_ids.tolist() == b.response_ids.tolist() and a.finish_reason == b.finish_reason
    assert a.texts == b.texts and a.group.tolist() == b.group.tolist()
    m = a.response_mask
    assert float((a.sampler_logp - b.sampler_logp).abs()[m].max()) < 1e-4
    ref = _trainer_logp(model, a)  # top_p: the sampler's distribution differs from pi; greedy rows compare below
    g = SamplingParams(n=1, temperature=0.0, max_new_tokens=12)
    ga = eng.generate(_prompts(tok), g)
    assert ga.response_ids.tolist() == local.generate(_prompts(tok), g).response_ids.tolist()
    assert set(a.token_version[m].tolist()) == {0} and ref.shape == a.sampler_logp.shape
    t = SamplingParams(n=2, temperature=1.0, max_new_tokens=16, seed=3)  # temperature 1, no top-p: mu = pi
    ta = eng.generate(_prompts(tok), t)
    assert float((_trainer_logp(model, ta) - ta.sampler_logp).abs()[ta.response_mask].max()) < 1e-4


def test_a_weight_update_goes_through_vllms_protocol_and_matches_the_in_process_sync(served):
    """Every phase of the gloo backend (init at start, then start / update / finish with the requests paused):
    after an update the server samples as the in-process engine after its own sync, its /weight_info names the
    version, and its log-probs are the new policy's."""
    model, tok, eng, local = served
    with torch.no_grad():
        for prm in model.parameters():
            prm.add_(0.02 * torch.randn_like(prm))
    v = eng.version + 1
    eng.sync_weights(model)
    local.sync_weights(model)
    assert eng.version == v and eng.last_sync_mb > 0
    info = json.loads(urllib.request.urlopen(eng.servers[0] + "/weight_info").read())
    assert info["weight_version"] == str(v)
    p = SamplingParams(n=2, temperature=1.0, max_new_tokens=16, seed=5)
    a, b = eng.generate(_prompts(tok), p), local.generate(_prompts(tok), p)
    assert a.response_ids.tolist() == b.response_ids.tolist()
    assert set(a.token_version[a.response_mask].tolist()) == {v}
    assert float((_trainer_logp(model, a) - a.sampler_logp).abs()[a.response_mask].max()) < 1e-4


@pytest.mark.faults
def test_a_corrupted_weight_update_is_caught(served, monkeypatch):
    """A tensor changed on its way (the trainer's broadcast perturbed) is caught by the probe after the update: a
    ServedWeightSyncError naming the server and the version; the next clean update repairs the server."""
    model, tok, eng, local = served
    real = weight_transfer._broadcast
    monkeypatch.setattr(weight_transfer, "_broadcast", lambda pg, t: real(pg, t + 0.05))
    with pytest.raises(ServedWeightSyncError, match=r"vLLM server http://127.0.0.1:\d+ does not sample with weights "
                                                    r"version \d+: its log-probs of the probe text differ"):
        eng.sync_weights(model)
    monkeypatch.setattr(weight_transfer, "_broadcast", real)
    eng.sync_weights(model)  # verified again: no error
    p = SamplingParams(n=1, temperature=0.0, max_new_tokens=8)
    a, b = eng.generate(_prompts(tok), p), local.generate(_prompts(tok), p)
    assert a.response_ids.tolist() == b.response_ids.tolist()


def test_the_plugin_registers_the_backend_once():
    """The vllm.general_plugins entry point (pyproject.toml) is idempotent: vLLM calls it in every process."""
    from importlib.metadata import entry_points

    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "tether_weight_transfer"]
    ep.load()()
    ep.load()()
    assert "gloo" in WeightTransferEngineFactory._registry


# ---------------------------------------------------------------- servers a user started (urls), an API key


def user_server(model_dir: Path, log: Path, key: str = KEY) -> tuple[subprocess.Popen, str]:
    """A server started as docs/async.md tells a user to (VLLM_SERVER_DEV_MODE=1 and the flags a trainer needs)."""
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--port", str(port),
           "--host", "127.0.0.1", "--enable-scale-out", "--logprobs-mode", LOGPROBS_MODE, "--generation-config", "vllm",
           "--enable-prefix-caching", "--weight-transfer-config", '{"backend": "gloo"}', "--dtype", "float32",
           "--enforce-eager", "--max-model-len", "256"]
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_API_KEY=key, VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    with open(log, "ab") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                preexec_fn=die_with_parent(new_session=True))  # gone with pytest, however it ends
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=5)
            return proc, url
        except OSError:
            assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(1)


@pytest.fixture(scope="module")
def user_url(tiny_dir, tmp_path_factory):
    proc, url = user_server(tiny_dir, tmp_path_factory.mktemp("user_server") / "server.log")
    yield url
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=60)


@pytest.fixture(scope="module")
def work(make_workdir):
    return make_workdir("served", DIGITS + "\nimport time\n\ndef slow(completion, example):\n    time.sleep(0.3)\n"
                                           "    return digits(completion, example)\n")


def train_cmd(work, model_dir, out, steps: int, engine: str, *more: str) -> list[str]:
    return [sys.executable, "-m", "tether", "train", "--recipe", "ema_pg", "--output-dir", str(out), "--steps",
            str(steps), f"model.name={model_dir}", f"data.task={work / 'prompts.jsonl'}",
            f"data.reward={work / 'rew.py'}:digits", "train.lr=0.01", "rollout.max_new_tokens=8",
            "rollout.prompts_per_step=4", "rollout.n=4", "run.progress=false", "run.plot=false",
            f"rollout.engine={engine}", *more]


LAUNCH = "{kind: vllm_server, launch: 1, dtype: float32, enforce_eager: true, kv_cache_gb: 1, max_model_len: 256}"


@pytest.mark.faults
def test_a_wrong_api_key_is_refused_before_the_first_step(user_url, work, tiny_dir, tmp_path):
    r = subprocess.run(train_cmd(work, tiny_dir, tmp_path / "run", 2, f"{{kind: vllm_server, urls: [{user_url}]}}"),
                       capture_output=True, text=True, env=subprocess_env(VLLM_API_KEY="wrong"), timeout=600)
    assert_clean_error(r.returncode, r.stderr, f"vLLM server 0 ({user_url}) refused the API key (HTTP 401)",
                       line_only=True)
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not rows(tmp_path / "run")


def test_servers_you_started_train_and_evaluate(user_url, work, tiny_dir, tmp_path):
    """urls: a 2-step run on the user's server (its key from $VLLM_API_KEY), then `tether eval --engine` on it."""
    engine = f"{{kind: vllm_server, urls: [{user_url}]}}"
    r = subprocess.run(train_cmd(work, tiny_dir, tmp_path / "run", 2, engine, "train.async=1"), capture_output=True,
                       text=True, env=subprocess_env(VLLM_API_KEY=KEY), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = rows(tmp_path / "run")
    assert [x["step"] for x in got] == [1, 2] and max(x["async/staleness"] for x in got) <= 1
    r = subprocess.run([sys.executable, "-m", "tether", "eval", "--model", str(tmp_path / "run"), "--benchmarks",
                        "arithmetic", "--limit", "4", "--max-new-tokens", "8", "--engine", engine, "--out",
                        str(tmp_path / "ev")], capture_output=True, text=True, env=subprocess_env(VLLM_API_KEY=KEY),
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "ev" / "results.json").read_text())
    assert [b["metrics"]["n_problems"] for b in res["benchmarks"].values()] == [4]


# ---------------------------------------------------------------- launched servers: async, faults, the exit paths


def _pids(output: str) -> list[int]:
    """The pids of the servers a trainer launched, from its log line "started N vLLM server(s): URL (pid P), ..."."""
    line = next(ln for ln in output.splitlines() if "vLLM server(s):" in ln)
    return [int(p) for p in re.findall(r"\(pid (\d+)\)", line)]


@pytest.mark.parametrize("servers", [1, 2])
def test_async_k1_over_launched_servers_keeps_the_bound(work, tiny_dir, tmp_path, servers):
    """train.async=1 over one and two launched servers: staleness <= 1 at every step, every update verified (a
    failed probe stops the run), versions in order, and the servers gone when the run ends."""
    engine = LAUNCH.replace("launch: 1", f"launch: {servers}")
    r = subprocess.run(train_cmd(work, tiny_dir, tmp_path / "run", 4, engine, "train.async=1"), capture_output=True,
                       text=True, env=subprocess_env(), timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    got = rows(tmp_path / "run")
    assert [x["step"] for x in got] == [1, 2, 3, 4]
    assert all(x["async/staleness"] <= 1 and x["async/version"] >= x["step"] - 2 for x in got)
    pids = _pids(r.stdout + r.stderr)
    assert len(pids) == servers
    _wait_gone(pids)
    logs = sorted(p.name for p in (tmp_path / "run" / "servers").iterdir())
    assert logs == [f"server-{i}.log" for i in range(servers)]


@pytest.mark.faults
def test_a_server_that_never_starts_is_refused_before_step_1(work, tiny_dir, tmp_path):
    engine = LAUNCH.replace("}", ", extra_args: [--no-such-vllm-flag]}")
    r = subprocess.run(train_cmd(work, tiny_dir, tmp_path / "run", 2, engine), capture_output=True, text=True,
                       env=subprocess_env(), timeout=600)
    err = assert_clean_error(r.returncode, r.stderr, "vLLM server 0", "exited with code", "before it answered /health")
    assert "no-such-vllm-flag" in err  # the last lines of its log are quoted
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not rows(tmp_path / "run")


def _wait_rows(run: Path, n: int, proc, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while True:
        try:
            if len(rows(run)) >= n:
                return
        except (OSError, ValueError):
            pass
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read() if proc.poll() is not None else ""
        time.sleep(0.5)


@pytest.mark.faults
def test_a_server_killed_mid_run_is_one_error_after_a_checkpoint_and_the_run_resumes(work, tiny_dir, tmp_path):
    run = tmp_path / "run"
    cmd = train_cmd(work, tiny_dir, run, 4, LAUNCH, "run.save_every=1", "data.reward=" + f"{work / 'rew.py'}:slow")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env())
    try:
        _wait_rows(run, 1, proc)
        pids = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _is_server_of(int(p.name), run)]
        assert pids, "no launched server found"
        os.killpg(pids[0], signal.SIGKILL)
        _, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
    line = assert_clean_error(proc.returncode, err, "vLLM server 0", "step", "checkpoint", line_only=True)
    assert "resume with" in line
    done = len(rows(run))
    r = subprocess.run([sys.executable, "-m", "tether", "train", "--resume", str(run)], capture_output=True, text=True,
                       env=subprocess_env(), timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [x["step"] for x in rows(run)] == [1, 2, 3, 4] and done < 4


def _is_server_of(pid: int, run: Path) -> bool:
    """Process ``pid`` is a vLLM API server whose log is in ``run``/servers (it was started by that run)."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        return b"vllm.entrypoints.openai.api_server" in cmd and os.readlink(f"/proc/{pid}/fd/1").startswith(
            str(run / "servers"))
    except OSError:
        return False


@pytest.mark.faults
@pytest.mark.parametrize("signals", [[signal.SIGTERM], [signal.SIGINT, signal.SIGINT]], ids=["SIGTERM", "ctrl-c-twice"])
def test_every_launched_server_is_gone_after_a_stop_signal(work, tiny_dir, tmp_path, signals):
    run = tmp_path / "run"
    cmd = train_cmd(work, tiny_dir, run, 50, LAUNCH, f"data.reward={work / 'rew.py'}:slow")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env(),
                            preexec_fn=terminal_sigint)  # Ctrl-C reaches it even when the tests run in the background
    try:
        _wait_rows(run, 1, proc)
        pids = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _is_server_of(int(p.name), run)]
        assert pids
        for s in signals:
            proc.send_signal(s)
            time.sleep(0.3)
        proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode in (130, 143, 2), proc.returncode
    _wait_gone(pids)


def _wait_gone(pids: list[int], timeout: float = 30) -> None:
    """Every launched server's process group is gone (its engine and workers reaped) within ``timeout``."""
    deadline = time.time() + timeout
    while any(group_alive(p) for p in pids):
        assert time.time() < deadline, f"a launched server outlived its trainer: {pids}"
        time.sleep(0.5)


# ---------------------------------------------------------------- the two-node layout on loopback


def test_the_two_node_layout_torchrun_trainer_and_a_server_elsewhere(user_url, work, tiny_dir, tmp_path):
    """Node A: `torchrun --nproc_per_node 2` gloo trainer ranks; node B: the user's server (here a separate process on
    loopback). Every rank generates its share through the server; rank 0 sends the weights (the FSDP2 shards
    gathered on every rank)."""
    engine = f"{{kind: vllm_server, urls: [{user_url}]}}"
    cmd = train_cmd(work, tiny_dir, tmp_path / "run", 2, engine)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), "-m", "tether", *cmd[3:]]
    r = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env(VLLM_API_KEY=KEY), timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    got = rows(tmp_path / "run")
    assert [x["step"] for x in got] == [1, 2]
    assert abs(got[0]["rollout_corr/kl_k1"]) < 1e-3  # the server sampled with the trainer's weights


# ---------------------------------------------------------------- verifiers 0.4's task API through the served engine


def test_a_verifiers_v1_environment_runs_token_exact_on_the_served_engine(served, monkeypatch):
    """rollout.agent.env.name=verifiers:<id> with verifiers 0.4: its TrainClient reaches the vLLM server through
    tether's endpoint (vLLM 0.32 answers log-probs without the `token: "token_id:N"` field the client reads), and
    each trace's ids, masks and log-probs are the server's sampled ids and the trainer's log-probs."""
    pytest.importorskip("verifiers.v1")
    from tether.agents.build import RolloutPlan
    from tether.resolve import load_config

    envs = Path(__file__).parent / "vf1_envs"
    monkeypatch.syspath_prepend(str(envs))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(envs), os.environ.get("PYTHONPATH", "")]))
    model, tok, eng, _ = served
    cfg = load_config(None, {"rollout.agent.kind": "multi_turn", "rollout.agent.env.name": "verifiers:tether_vf1_add",
                             "rollout.agent.env.observation_format": "chat", "rollout.agent.env.max_turns": 2,
                             "rollout.agent.env.options": {"taskset": {"size": 2, "reward": "spread"}}})
    plan = RolloutPlan(cfg)
    agent = plan.agent(eng, tok)
    try:
        rb = agent.rollout(plan.tools["env"].examples("train"), SamplingParams(n=2, temperature=1.0,
                                                                               max_new_tokens=12, seed=0))
    finally:
        agent.close()
    assert rb.group.tolist() == [0, 0, 1, 1] and agent.metrics()["verifiers/errors"] == 0
    d = (_trainer_logp(model, rb) - rb.sampler_logp).abs()[rb.loss_mask]
    assert d.numel() > 0 and float(d.max()) < 1e-4


@pytest.mark.slow  # about 5 minutes on 2 cores: SmolLM2-135M in a server (135 s to start) and in process
def test_smollm2_served_samples_equal_the_in_process_engine(tmp_path):
    """The real small model: one launched server and the in-process engine, same weights and seeds, give the same
    sampled ids, and log-probs within the vLLM tests' tolerance (float32)."""
    model, tok = load_model(ModelConfig(name="smollm2"))
    eng = ServedEngine(model, tok, VLLMServerEngineConfig(launch=1, dtype="float32", kv_cache_gb=2,
                                                          max_model_len=1024),
                       log_dir=tmp_path / "logs", log=lambda m: None)
    try:
        local = VLLMEngine(model, tok, dtype="float32", kv_cache_gb=2, max_model_len=1024)
        prompts = [tok(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                               tokenize=False), add_special_tokens=False).input_ids
                   for q in ("What is 12 + 30?", "Name a prime number.", "Write one word.")]
        p = SamplingParams(n=2, temperature=0.7, max_new_tokens=24, seed=4)
        a, b = eng.generate(prompts, p), local.generate(prompts, p)
        assert a.response_ids.tolist() == b.response_ids.tolist() and a.finish_reason == b.finish_reason
        assert float((a.sampler_logp - b.sampler_logp).abs()[a.response_mask].max()) < 1e-4
        with torch.no_grad():
            for prm in model.parameters():
                prm.mul_(1.001)
        eng.sync_weights(model)  # through vLLM's protocol, verified by the probe
        local.sync_weights(model)
        a, b = eng.generate(prompts, p), local.generate(prompts, p)
        assert a.response_ids.tolist() == b.response_ids.tolist()
    finally:
        eng.close()
