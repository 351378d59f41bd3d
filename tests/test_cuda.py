"""The GPU path (marker ``cuda``; skipped where ``torch.cuda.is_available()`` is False, tests/conftest.py).
The two bf16 numerics tests also run on the CPU, in the default suite.

Run them with ``pytest -m cuda`` or ``bash scripts/gpu_check.sh`` on a machine with a GPU: a bf16 policy's
forward and the chunked log-prob engine against fp32 within a bf16 tolerance, bf16 training steps with the
transformers engine, ``rollout.engine=vllm`` when vLLM imports, and FSDP2 over NCCL under torchrun when
there are two GPUs or more (tether's FSDP path is off at world size 1, so one GPU has nothing to shard).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import DIGITS, rows, subprocess_env, tiny_config, worker_pid
from tether.logprobs import response_stats
from tether.models import ModelConfig, load_model
from tether.testing import make_tiny_model_dir

CUDA = pytest.mark.cuda
#: the bf16 numerics tests, on the CPU (default suite) and on the GPU
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]

#: a bf16 model against the same model in fp32, per response token: the tiny model's random weights are peaked
#: (initializer_range 0.2; log-probs of magnitude ~8, logits up to ~10), and rounding its weights to bf16 alone
#: moves a log-prob by up to 0.17 (fp32 compute); with bf16 activations too the largest difference on this
#: batch was 0.63 on an H200 and 0.62 on the CPU, the mean 0.069 and 0.072 (2026-11-27). The first guess,
#: 0.1 / 0.03, had not been measured: the first GPU run failed it, and the CPU gives the same figures
BF16_VS_FP32_MAX, BF16_VS_FP32_MEAN = 1.0, 0.1
#: two bf16 forwards of the same weights on one device, in different shapes (a worker's sampling with a KV
#: cache against the trainer's full forward): only the kernels' rounding apart (passed on the H200)
SAME_BF16_MAX, SAME_BF16_MEAN = 0.1, 0.03
#: the chunked engine against the full-logits log-softmax of the same bf16 model: both compute the
#: softmax in fp32 from the same bf16 hidden states, so they differ by the logits' rounding only
CHUNK_MAX = 0.05

SHAPE = dict(hidden_size=128, num_heads=2, num_kv_heads=2, intermediate_size=128)  # head_dim 64, as vLLM needs


@pytest.fixture(scope="module")
def workdir(make_workdir):
    return make_workdir("cuda", DIGITS)


@pytest.fixture(scope="module")
def gpu_model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("gpu_model"), seed=1, **SHAPE)


def _batch(seed=0, B=4, P=12, T=16, vocab=384, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    pid, rid = torch.randint(4, vocab, (B, P), generator=g), torch.randint(4, vocab, (B, T), generator=g)
    pm = torch.ones(B, P, dtype=torch.long)
    pm[0, :3] = 0  # one left-padded prompt
    rm = torch.ones(B, T, dtype=torch.bool)
    rm[1, 10:] = False  # one shorter response
    return [x.to(device) for x in (pid, pm, rid, rm)]


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_forward_and_chunked_logprobs_match_fp32(device, gpu_model_dir):
    m32, _ = load_model(ModelConfig(name=str(gpu_model_dir), dtype="float32", device=device))
    m16, _ = load_model(ModelConfig(name=str(gpu_model_dir), dtype="bfloat16", device=device))
    assert next(m16.parameters()).dtype == torch.bfloat16 and next(m16.parameters()).device.type == device
    pid, pm, rid, rm = _batch(device=device)
    with torch.no_grad():
        lp32 = response_stats(m32, pid, pm, rid, rm, chunk_size=16).logp
        lp16 = response_stats(m16, pid, pm, rid, rm, chunk_size=16).logp
        diff = (lp32 - lp16.float())[rm].abs()
        assert diff.max() <= BF16_VS_FP32_MAX and diff.mean() <= BF16_VS_FP32_MEAN, (diff.max().item(),
                                                                                     diff.mean().item())
        # the chunked engine against the naive full-logits path on the same bf16 model
        ids = torch.cat([pid, rid], 1)
        mask = torch.cat([pm, rm.long()], 1)
        logits = m16(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
        naive = torch.log_softmax(logits[:, pid.shape[1] - 1:-1].float(), -1).gather(-1, rid.unsqueeze(-1)).squeeze(-1)
        d = (naive - lp16.float())[rm].abs()
        assert d.max() <= CHUNK_MAX, d.max().item()


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_chunked_logprob_gradient_matches_fp32(device, gpu_model_dir):
    """The gradient of the mean log-prob through the chunked engine, bf16 against fp32 (cosine >= 0.99)."""
    grads = []
    for dtype in ("float32", "bfloat16"):
        m, _ = load_model(ModelConfig(name=str(gpu_model_dir), dtype=dtype, device=device))
        pid, pm, rid, rm = _batch(seed=1, device=device)
        st = response_stats(m, pid, pm, rid, rm, chunk_size=16, entropy=False)
        st.logp[rm].float().mean().backward()
        grads.append(torch.cat([p.grad.float().flatten() for p in m.parameters()]))
    cos = torch.nn.functional.cosine_similarity(grads[0], grads[1], dim=0)
    assert cos >= 0.99, cos.item()


@CUDA
def test_bf16_training_steps_on_cuda_with_the_transformers_engine(workdir, gpu_model_dir, tmp_path):
    from tether.train import build_trainer

    cfg = tiny_config(workdir, gpu_model_dir, "grpo", 2, **{"model.dtype": "bfloat16", "model.device": "cuda"})
    t = build_trainer(cfg, tmp_path / "run", log=lambda *a: None)
    before = [p.detach().clone() for p in t.model.parameters()]
    for _ in range(2):
        m = t.train_step()
        assert m["peak_cuda_mb"] > 0 and m["grad_norm"] == m["grad_norm"]  # reported, finite
    assert t.anchor.master[0].dtype == torch.bfloat16 and not t.anchor.master[0].is_cpu
    assert any(not torch.equal(a, b) for a, b in zip(before, t.model.parameters()))


@CUDA
def test_memory_breakdown_on_cuda(workdir, gpu_model_dir, tmp_path, bench_script):
    """bench/_memory.py on the GPU: the per-phase CUDA peaks are recorded and the breakdown names the overhead."""
    from tether.train import build_trainer

    bm = bench_script("_memory")
    cfg = tiny_config(workdir, gpu_model_dir, "grpo", 2, **{"model.dtype": "bfloat16", "model.device": "cuda"})
    t = build_trainer(cfg, tmp_path / "run", log=lambda *a: None)
    t.train_step()
    _, mem = bm.StepMemory(t).step()
    assert all(r["cuda_peak_allocated"] > 0 for r in mem["phases"].values())
    n = sum(p.numel() for p in t.model.parameters())
    assert mem["sizes"]["gradients"] == 2 * n  # bf16 gradients
    assert dict((k, v) for k, v, _ in bm.breakdown_rows(mem))["allocator overhead"] >= 0


@CUDA
def test_tether_train_with_vllm_on_cuda(gpu_model_dir, tmp_path):
    pytest.importorskip("vllm")
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"question": f"Say some numbers {i}", "answer": str(i)}) + "\n"
                            for i in range(8)))
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "tether", "train", "--recipe", "grpo", f"model.name={gpu_model_dir}",
           f"data.task={data}", "model.device=cuda", "model.dtype=bfloat16", "train.steps=2",
           "rollout.prompts_per_step=2", "rollout.n=2", "rollout.max_new_tokens=8", "rollout.engine=vllm",
           "rollout.engine.gpu_memory_utilization=0.3", "rollout.engine.max_model_len=256", "algo.tis_cap=2",
           "run.progress=false", "run.plot=false", f"run.output_dir={out}"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=subprocess_env())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert [x["step"] for x in rows(out)] == [1, 2]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@CUDA
def test_fsdp2_over_nccl_on_two_gpus(workdir, gpu_model_dir, tmp_path):
    """Two ranks under torchrun, one GPU each (nccl): `tether train` with the policy sharded by FSDP2."""
    if torch.cuda.device_count() < 2:
        pytest.skip("FSDP2 needs two ranks (tether does not shard at world size 1); this machine has "
                    f"{torch.cuda.device_count()} GPU")
    out = tmp_path / "run"
    main = str(Path(__file__).resolve().parent / "dist_main.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_port()), main, "train", "--recipe", "grpo", "--output-dir", str(out), "--steps", "2",
           f"model.name={gpu_model_dir}", f"data.task={workdir / 'prompts.jsonl'}",
           f"data.reward={workdir / 'rew.py'}:digits", "model.device=cuda", "model.dtype=bfloat16",
           "rollout.prompts_per_step=2", "rollout.n=2", "rollout.max_new_tokens=8", "run.progress=false",
           "run.plot=false"]
    env = subprocess_env()
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert [x["step"] for x in rows(out)] == [1, 2]


# ---------------------------------------------------------------- asynchronous training on the GPU (#28)


@pytest.fixture(scope="module")
def gpu_tied_model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("gpu_tied"), seed=2, tie_word_embeddings=True, **SHAPE)


@CUDA
@pytest.mark.parametrize("kind", ["plain", "lora", "tied"])
def test_async_workers_sample_on_cuda_with_the_trainers_weights(kind, workdir, gpu_model_dir, gpu_tied_model_dir,
                                                               tmp_path):
    """K = 1 on the GPU in bf16: a spawned worker loads the model on CUDA, takes every pushed version (LoRA merged,
    a tied head under both names) with verified checksums, and its log-probs of the tokens it sampled at
    version 3 are a bf16 forward of that version's effective weights on the trainer's side, to the tolerance of
    two bf16 forwards of the same weights. Under LoRA those weights are the merged W + scale B A rounded to bf16,
    which the trainer's own forward (W x + scale B (A x)) does not round the same way: the first GPU run measured
    that gap at 0.13 per token at most, 0.041 on average, within bf16's tolerance against fp32 (the rollout
    correction's mu against pi_old sees it)."""
    from tether.asynchronous.weights import effective_weights
    from tether.asynchronous.workers import Job
    from tether.logprobs import response_stats
    from tether.rollout import SamplingParams
    from tether.train import build_trainer

    over = {"model.dtype": "bfloat16", "model.device": "cuda", "train.async.max_staleness": 1,
            "train.async.verify_sync": True,
            "algo.tis_cap": 2.0}
    model_dir = gpu_tied_model_dir if kind == "tied" else gpu_model_dir
    if kind == "lora":
        over.update({"model.lora_r": 4, "model.lora_target_modules": ["q_proj", "v_proj"]})
    t = build_trainer(tiny_config(workdir, model_dir, "grpo", 3, **over), tmp_path / "run", log=lambda *a: None)
    try:
        ms = [t.train_step() for _ in range(3)]
        for step, m in enumerate(ms):
            assert 0 <= m["async/staleness"] <= 1 and m["async/version"] == step - m["async/staleness"], m
            assert m["skipped_updates"] == 0 and m["pg_loss"] == m["pg_loss"]
            if m["async/staleness"] == 0:  # the same weights on both sides: only bf16's numerics apart
                assert m["rollout_corr/ppl_ratio"] == pytest.approx(1.0, abs=0.05), m
        pool = t.feed.pool
        pool.next_batch()  # the job submitted during step 3
        ex = t.data.take(2)
        pool.submit(Job(100, ex, SamplingParams(n=2, temperature=0.7, max_new_tokens=8, seed=100), t.data.position))
        r = pool.next_batch()
        assert r.version == 3 and r.checksum == pool.checksums[3]
        rb = r.rb
        batch = [x.to("cuda") for x in (rb.prompt_ids, rb.prompt_mask, rb.response_ids, rb.response_mask)]
        ref, _ = load_model(ModelConfig(name=str(model_dir), dtype="bfloat16", device="cuda"))  # plain, like a worker
        with torch.no_grad():
            eff = effective_weights(t.model)
            assert set(dict(ref.named_parameters())) <= set(eff)  # every parameter of a plain model is pushed
            assert not ref.load_state_dict(eff, strict=False).unexpected_keys
            merged = response_stats(ref, *batch, temperature=0.7, entropy=False).logp.float().cpu()
            own = response_stats(t.model, *batch, temperature=0.7, entropy=False).logp.float().cpu()
        m = rb.response_mask
        diff = (rb.sampler_logp[m] - merged[m]).abs()
        assert diff.max() <= SAME_BF16_MAX and diff.mean() <= SAME_BF16_MEAN, (diff.max().item(), diff.mean().item())
        gap = (rb.sampler_logp[m] - own[m]).abs()  # the trainer's own forward: equal but for LoRA's merge rounding
        tol = (BF16_VS_FP32_MAX, BF16_VS_FP32_MEAN) if kind == "lora" else (SAME_BF16_MAX, SAME_BF16_MEAN)
        assert gap.max() <= tol[0] and gap.mean() <= tol[1], (gap.max().item(), gap.mean().item())
    finally:
        t.close()
    assert all(not p.is_alive() for p in t.feed.pool.procs)


@CUDA
def test_async_cli_on_cuda_survives_a_worker_killed_mid_run(workdir, gpu_model_dir, tmp_path):
    """`tether train` with K = 1 on the GPU: the worker (a process with its own CUDA context) is killed with SIGKILL
    after the first step; it is restarted on the GPU, its job resubmitted, and training goes on within K until a
    SIGTERM stops the run gracefully (exit 143; the run is planned far longer than the test lets it go)."""
    import os
    import signal
    import time

    out, log = tmp_path / "run", tmp_path / "train.log"
    cmd = [sys.executable, "-m", "tether", "train", "--recipe", "grpo", f"model.name={gpu_model_dir}",
           f"data.task={workdir / 'prompts.jsonl'}", f"data.reward={workdir / 'rew.py'}:digits",
           "model.device=cuda", "model.dtype=bfloat16", "train.steps=10000", "rollout.prompts_per_step=2",
           "rollout.n=2", "rollout.max_new_tokens=8", "train.async.max_staleness=1", "train.async.verify_sync=true",
           "run.progress=false", "run.plot=false", "run.save_every=0", "eval.before=false", "eval.after=false",
           f"run.output_dir={out}"]

    def wait_rows(n: int) -> list[dict]:
        deadline = time.monotonic() + 600
        while not ((out / "metrics.jsonl").is_file() and len(rows(out)) >= n):
            assert p.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        return rows(out)

    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=subprocess_env())
    try:
        wait_rows(1)
        pid = worker_pid(log)
        os.kill(pid, signal.SIGKILL)
        done = len(rows(out))
        wait_rows(done + 3)
        p.send_signal(signal.SIGTERM)
        assert p.wait(600) == 143, log.read_text()[-3000:]
    finally:
        if p.poll() is None:
            p.kill()
    text = log.read_text()
    assert f"rollout worker 0 (pid {pid}) died with exit code -9" in text and "restarting it" in text, text[-3000:]
    rs = rows(out)
    assert [x["step"] for x in rs] == list(range(1, len(rs) + 1)) and len(rs) >= done + 3
    assert all(x["async/staleness"] <= 1 for x in rs) and rs[-1]["async/restarts"] == 1
