"""Served rollouts (rollout.engine.kind=vllm_server) against in-process vLLM, measured in one run on this machine.

Three ratios (docs/async.md, "Served rollouts"):

1. **Generation tokens per second**, the served engine (one launched ``vllm serve`` on this node, requests over
   loopback HTTP) against the in-process engine (``rollout.engine=vllm``), on the same weights, prompts, seeds and
   sampling (``--prompts`` x ``--n`` samples of ``--max-new-tokens``, EOS banned so that both generate the same
   number of tokens); the median of ``--reps`` batches after one warm-up.
2. **Weight-update seconds per GB**: the served engine's update (vLLM's weight-transfer protocol over tether's
   gloo backend: pause, start, broadcast + ``load_weights``, finish, version, probe, resume) against the
   in-process engine's ``sync_weights`` (``reload_weights`` through ``collective_rpc``); median of ``--reps``.
3. **Asynchronous K = 1 over a server against the synchronous loop over the same server**: seconds per trainer
   step (the Trainer, grpo, ``--steps`` timed after one warm-up), both on the served engine, so that the ratio is
   what serving buys a run: generation in the server while the trainer updates.

The server is one process tree beside this one on the same cores: on a 2-core machine it competes with the
trainer for them, which the ratios include (the closing figures say so).

Usage::

    python bench/served.py                                    # SmolLM2-135M, 4 x 4 samples of 64 tokens
    python bench/served.py --model /path/to/tiny --max-new-tokens 8 --reps 2 --steps 2   # plumbing check
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _benchutil import machine_info  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="model (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--prompts", type=int, default=4, help="prompts per batch (default 4)")
    p.add_argument("--n", type=int, default=4, help="samples per prompt (default 4)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens per response, EOS banned (default 64)")
    p.add_argument("--reps", type=int, default=3, help="timed batches and updates (default 3)")
    p.add_argument("--steps", type=int, default=4, help="timed trainer steps per loop (default 4)")
    p.add_argument("--kv-cache-gb", type=int, default=2, help="CPU: each engine's KV cache in GiB (default 2)")
    p.add_argument("--device", default="cpu", help="model.device of the trainer (default cpu; cuda on a GPU)")
    p.add_argument("--dtype", default="float32", help="model.dtype and the servers' dtype (default float32)")
    p.add_argument("--weight-transfer", default="auto", choices=["auto", "gloo", "nccl", "ipc"],
                   help="rollout.engine.weight_transfer (default auto: gloo on CPU, ipc on the trainer's GPU)")
    p.add_argument("--devices", default="", help="GPU: comma list of the servers' CUDA devices (default: the "
                   "trainer's; '1' puts the server on GPU 1, NCCL)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3,
                   help="GPU: each engine's share of its GPU (default 0.3, so that the trainer and two engines fit)")
    p.add_argument("--no-loops", action="store_true", help="skip ratio 3 (the trainer's steps)")
    a = p.parse_args(argv)
    a.cuda = a.device.startswith("cuda")
    if min(a.prompts, a.n, a.max_new_tokens, a.reps, a.steps) < 1:
        p.error("every count must be >= 1")
    return a


def _params(a, seed: int):
    from tether.rollout import SamplingParams

    return SamplingParams(n=a.n, temperature=1.0, max_new_tokens=a.max_new_tokens, min_new_tokens=a.max_new_tokens,
                          seed=seed)


def server_keys(a) -> dict:
    """The rollout.engine section of the bench's launched server."""
    keys = {"launch": 1, "dtype": a.dtype, "weight_transfer": a.weight_transfer}
    if a.cuda:
        keys.update(gpu_memory_utilization=a.gpu_memory_utilization,
                    devices=[d for d in a.devices.split(",") if d])
    else:
        keys.update(kv_cache_gb=a.kv_cache_gb)
    return keys


def engines_compared(a, log_dir: Path) -> dict:
    """Ratios 1 and 2: the same batches and updates on a served engine and an in-process one."""
    import torch

    from tether.config.engine import VLLMServerEngineConfig
    from tether.models import ModelConfig, load_model
    from tether.rollout.served import ServedEngine
    from tether.rollout.vllm import VLLMEngine

    model, tok = load_model(ModelConfig(name=a.model, device=a.device, dtype=a.dtype))
    prompts = [tok(f"Question {i}: what is {i} + {2 * i}? Think step by step.")["input_ids"] for i in range(a.prompts)]
    t0 = time.perf_counter()
    served = ServedEngine(model, tok, VLLMServerEngineConfig(**server_keys(a)), log_dir=log_dir,
                          log=lambda m: print(m, flush=True))
    start_served = time.perf_counter() - t0
    t0 = time.perf_counter()
    local = VLLMEngine(model, tok, dtype=a.dtype, **({"gpu_memory_utilization": a.gpu_memory_utilization} if a.cuda
                                                     else {"kv_cache_gb": a.kv_cache_gb}))
    start_local = time.perf_counter() - t0
    out = {"start_s": {"served": start_served, "in-process": start_local}, "tok_s": {}, "sync_s_per_gb": {}}
    try:
        for name, eng in (("served", served), ("in-process", local)):
            eng.generate(prompts, _params(a, 0))  # warm-up
            rates = []
            for r in range(a.reps):
                t0 = time.perf_counter()
                rb = eng.generate(prompts, _params(a, r + 1))
                rates.append(rb.num_response_tokens / (time.perf_counter() - t0))
            out["tok_s"][name] = statistics.median(rates)
            print(f"[served] {name}: {out['tok_s'][name]:.1f} tokens/s (median of {a.reps})", flush=True)
        for name, eng in (("served", served), ("in-process", local)):
            times = []
            for _ in range(a.reps):
                with torch.no_grad():
                    for prm in model.parameters():
                        prm.mul_(1.0 + 1e-4)
                t0 = time.perf_counter()
                eng.sync_weights(model)
                times.append(time.perf_counter() - t0)
            gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
            out["sync_s_per_gb"][name] = statistics.median(times) / gb
            print(f"[served] {name}: weight update {statistics.median(times):.3f} s for {gb:.3f} GB", flush=True)
    finally:
        served.close()
        del local
    return out


def loops_compared(a, out_dir: Path) -> dict:
    """Ratio 3: seconds per trainer step, synchronous and K = 1, both over one launched server: each loop is its
    own ``tether train`` process, as a user runs it (run as two Trainers in this process, after the in-process
    engine of ratios 1-2, the K = 1 loop's server failed on this 2-core machine with HTTP 500 from its engine
    core; the same loop alone runs), timed by the run's own ``time_step_s`` (the median after the first step)."""
    import json
    import subprocess

    import yaml

    from tether.metrics import read_metrics

    res = {}
    for name, k in (("sync", 0), ("K=1", 1)):
        over = {"model.name": a.model, "rollout.prompts_per_step": a.prompts, "rollout.n": a.n,
                "rollout.max_new_tokens": a.max_new_tokens, "rollout.min_new_tokens": a.max_new_tokens,
                "train.steps": a.steps + 1, "run.progress": False, "run.plot": False, "run.save_every": 0,
                "run.exact_kl_samples": 0, "eval.before": False, "eval.after": False, "train.async": k,
                "model.device": a.device, "model.dtype": a.dtype, "run.output_dir": str(out_dir / name)}
        engine = yaml.safe_dump({"kind": "vllm_server", **server_keys(a)}, default_flow_style=True).strip()
        cmd = [sys.executable, "-m", "tether", "train", "--recipe", "grpo",
               *(f"{key}={json.dumps(v) if isinstance(v, bool) else v}" for key, v in over.items()),
               f"rollout.engine={engine}"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        rows = read_metrics(out_dir / name)
        walls = [r["time_step_s"] for r in rows if r.get("step", 0) > 1 and "time_step_s" in r]
        res[name] = statistics.median(walls)
        print(f"[served] {name} over a server: {res[name]:.2f} s per step (median of {len(walls)})", flush=True)
    return res


def main(argv=None) -> int:
    a = parse_args(argv)
    print(machine_info())
    with tempfile.TemporaryDirectory() as tmp:
        eng = engines_compared(a, Path(tmp) / "logs")
        loops = None if a.no_loops else loops_compared(a, Path(tmp))
    print(f"\n{a.model}: {a.prompts} prompts x {a.n} samples, {a.max_new_tokens} tokens each (EOS banned); "
          f"{a.device}, {a.dtype}, weight transfer {a.weight_transfer}")
    print(f"{'':28s} {'served':>10s} {'in-process':>11s} {'ratio':>7s}")
    for key, label, fmt in (("start_s", "engine start, s", "{:10.1f}"), ("tok_s", "generation, tokens/s", "{:10.1f}"),
                            ("sync_s_per_gb", "weight update, s per GB", "{:10.3f}")):
        s, i = eng[key]["served"], eng[key]["in-process"]
        print(f"{label:28s} {fmt.format(s)} {fmt.format(i)}  {s / i:6.2f}")
    if loops:
        print(f"{'trainer step, s (served)':28s} {'sync':>10s} {'K=1':>11s}")
        print(f"{'':28s} {loops['sync']:10.2f} {loops['K=1']:11.2f}  ratio sync/K=1 = "
              f"{loops['sync'] / loops['K=1']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
