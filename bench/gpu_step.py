"""The vs-TRL job (bench/vs_trl.py, docs/benchmarks.md) for a few steps in bf16 on a CUDA GPU; run by
scripts/gpu_check.sh, once per rollout engine, then once with ``--table`` to print the rows.

A run reads its settings from the environment that gpu_check.sh sets (GPU_CHECK_OUT, GPU_CHECK_MODEL,
GPU_CHECK_DATA, GPU_CHECK_STEPS, GPU_CHECK_ENGINE), trains in this process with ``model.dtype=bfloat16
model.device=cuda`` and the engine, records the memory breakdown of one more step (bench/_memory.py), and
writes ``<engine>.json`` into GPU_CHECK_OUT. ``--table DIR`` prints those results in the format of the
benchmark table of docs/benchmarks.md, with the GPU's columns (peak CUDA memory, generated tokens/s).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _benchutil as bu  # noqa: E402

_T_START = time.perf_counter()


def run() -> int:
    import torch

    import vs_trl
    from _memory import rss_bytes
    from tether.resolve import load_config
    from tether.train import build_trainer

    baseline = rss_bytes()
    out, engine, steps = Path(os.environ["GPU_CHECK_OUT"]), os.environ.get("GPU_CHECK_ENGINE", "hf"), \
        int(os.environ.get("GPU_CHECK_STEPS", "2"))
    a = SimpleNamespace(model=os.environ.get("GPU_CHECK_MODEL", "smollm2"), data_dir=os.environ.get("GPU_CHECK_DATA"),
                        prompts=4, samples=4, max_new_tokens=64, steps=steps, lr=1e-6, seed=0, beta=0.04)
    ov = {**vs_trl._tether_overrides(a, "grpo"), "model.dtype": "bfloat16", "model.device": "cuda",
          "rollout.engine": engine, "data.limit": a.prompts * (steps + 1)}
    if engine == "vllm":
        ov["rollout.engine.gpu_memory_utilization"] = 0.3
    cfg = load_config(None, ov, recipe_name="grpo")
    cfg.run.output_dir = tempfile.mkdtemp(prefix=f"gpu-{engine}-")
    trainer = build_trainer(cfg, Path(cfg.run.output_dir), log=lambda *x: print(*x, flush=True))
    load_s = time.perf_counter() - _T_START
    rows = []
    for _ in range(steps):
        m = trainer.train_step()
        rows.append({k: v for k, v in m.items() if isinstance(v, (int, float))})
        print(f"[gpu_step {engine}] step {len(rows)}: {m['time_step_s']:.2f} s, {m.get('gen_tokens')} generated "
              f"tokens, peak CUDA {m.get('peak_cuda_mb', 0):.0f} MB", flush=True)
    timed_peak = bu.peak_rss()["peak_rss_mb"]
    peak_cuda = torch.cuda.max_memory_allocated() / 2**20
    mem = bu.memory_breakdown(trainer, baseline)
    res = {"engine": engine, "steps": rows, "load_s": load_s, "peak_rss_mb": timed_peak, "peak_cuda_mb": peak_cuda,
           "memory": mem, "device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    (out / f"{engine}.json").write_text(json.dumps(res))
    return 0


def table(out: Path) -> int:
    header = ["run", "median step s (2..N)", "mean step s (all)", "steps s", "rollout s", "sampler pass s",
              "anchor pass s", "update s", "gen tokens/step", "gen tokens/s", "peak RSS MB", "peak CUDA MB", "start s"]
    rows, mems, device = [], [], None
    for path in sorted(out.glob("*.json")):
        r = json.loads(path.read_text())
        device = f"{r['device']}, torch {r['torch']}"
        st = r["steps"]
        med = lambda k: bu.median([s[k] for s in bu.after_warmup(st) if k in s])  # noqa: E731
        gen = [s.get("gen_tokens", 0) for s in bu.after_warmup(st)]
        roll = [s.get("time_rollout_s", 0) for s in bu.after_warmup(st)]
        rows.append([f"tether_grpo bf16 cuda ({r['engine']})", bu.fmt(med("time_step_s")),
                     bu.fmt(bu.mean([s["time_step_s"] for s in st])), ", ".join(f"{s['time_step_s']:.2f}" for s in st),
                     bu.fmt(med("time_rollout_s")), bu.fmt(med("time_sampler_pass_s")),
                     bu.fmt(med("time_anchor_pass_s")), bu.fmt(med("time_update_s")),
                     bu.fmt(bu.mean([float(s.get("gen_tokens", 0)) for s in st]), 0),
                     bu.fmt(sum(gen) / sum(roll) if sum(roll) > 0 else None, 1), bu.fmt(r["peak_rss_mb"], 0),
                     bu.fmt(r["peak_cuda_mb"], 0), bu.fmt(r["load_s"], 1)])
        mems.append((r["engine"], r["memory"]))
    if not rows:
        print("[gpu_step] no results")
        return 1
    print(f"\n- device: {device}; job: the vs-TRL job (P=4 x G=4, max 64 new tokens, k3 beta=0.04 to a fixed "
          f"reference, lr=1e-06), SmolLM2-135M unless MODEL says otherwise, bf16 on cuda\n")
    print(bu.md_table(header, rows))
    for engine, mem in mems:
        print(f"\n### Memory breakdown ({engine} engine, one more step)\n")
        print("\n".join(bu.memory_table(mem)))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--table":
        sys.exit(table(Path(sys.argv[2])))
    sys.exit(run())
