"""Seconds per trainer step: the synchronous loop (train.async=none) against K = 1 and K = 4 rollout
workers (docs/async.md), at the same samples, on this CPU, in one run.

Every run trains the same model with the same recipe (grpo), the same prompts in the same order
(``--prompts`` per step), ``--n`` samples each, ``--max-new-tokens`` per response with EOS banned below it
(every response full length, so the runs generate the same number of tokens whatever their weights), and
the same number of steps. The runs go one after the other (K >= 1 runs own worker processes that would
compete with another run's); the first ``--warmup`` steps of each are not timed.

Threads: the synchronous run uses ``--sync-threads`` torch threads (default: all of the split); a K >= 1 run
gives its trainer ``--trainer-threads`` and each of its ``--workers`` worker processes ``--worker-threads``
(through OMP_NUM_THREADS, which spawned workers read when torch starts).

Prints per run the median step time, generation time (the sync rollout; a worker's ``async/worker_gen_s``),
update time (the rest of the step) and the trainer's wait for batches, then the ratios sync / K and the
speed-up that bench/async_model.py predicts from the synchronous run's own generation and update times
(those of the same threads as the async sides would be another input: the model's formula is in
docs/async.md).

Usage::

    python bench/async.py                                   # SmolLM2-135M, 4 x 4 samples, 64 tokens, 6 timed steps
    python bench/async.py --model /path/to/tiny --steps 2 --warmup 1 --max-new-tokens 8   # plumbing check
    python bench/async.py --trainer-threads 1 --worker-threads 1 --ks 0,1,4
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _benchutil import machine_info  # noqa: E402
from async_model import simulate, speedup  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cores = os.cpu_count() or 2
    p.add_argument("--model", default="smollm2", help="model (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step (default 4)")
    p.add_argument("--n", type=int, default=4, help="samples per prompt (default 4)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens per response, EOS banned (default 64)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per run (default 6)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    p.add_argument("--ks", default="0,1,4", help="staleness bounds, 0 = synchronous (default 0,1,4)")
    p.add_argument("--workers", default="1",
                   help="rollout workers of a K >= 1 run; a comma list runs every K >= 1 with each (default 1)")
    p.add_argument("--device", default="cpu", help="model.device of every run, trainer and workers (default cpu; "
                   "on a GPU they share it)")
    p.add_argument("--dtype", default="float32", help="model.dtype (default float32; bfloat16 on a GPU)")
    p.add_argument("--random-weights", action="store_true",
                   help="--model's architecture and tokenizer with random weights (only its config and tokenizer "
                        "files are read: a machine without the weights times the same shapes, since EOS is banned "
                        "and every response is full length whatever the weights)")
    p.add_argument("--trainer-threads", type=int, default=max(1, cores // 2),
                   help=f"torch threads of a K >= 1 run's trainer (default {max(1, cores // 2)})")
    p.add_argument("--worker-threads", type=int, default=max(1, cores - cores // 2),
                   help=f"torch threads of each rollout worker (default {max(1, cores - cores // 2)})")
    p.add_argument("--sync-threads", type=int, default=0,
                   help="torch threads of the synchronous run (default: trainer + workers x worker threads)")
    a = p.parse_args(argv)
    try:
        a.ks = [int(k) for k in a.ks.split(",") if k.strip()]
        a.workers = [int(w) for w in a.workers.split(",") if w.strip()]
    except ValueError:
        p.error("--ks and --workers are comma lists of integers")
    if not a.ks or any(k < 0 for k in a.ks) or not a.workers or any(w < 1 for w in a.workers) or a.steps < 1 \
            or a.warmup < 0:
        p.error("--ks: staleness bounds >= 0; --workers: counts >= 1; --steps >= 1; --warmup >= 0")
    a.sync_threads = a.sync_threads or a.trainer_threads + max(a.workers) * a.worker_threads
    # the runs, in order: (K, workers); the synchronous run has none
    a.runs = [(k, w) for k in a.ks for w in (a.workers if k else [0])]
    return a


def random_like(name: str, dtype: str, out: Path, seed: int = 0) -> Path:
    """A directory holding model ``name``'s config and tokenizer files with random weights (the config's own
    initialization, torch seed ``seed``)."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tether.models import resolve_dtype, resolve_model_path

    src = Path(resolve_model_path(name))
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".bin", ".pt", ".gguf")) and f.name != "config.json":
            shutil.copy(f, out / f.name)
    torch.manual_seed(seed)
    cfg = AutoConfig.from_pretrained(src)
    AutoModelForCausalLM.from_config(cfg, dtype=resolve_dtype(dtype)).save_pretrained(out)
    return out


def label(k: int, w: int, a) -> str:
    return "sync" if k == 0 else f"K={k}" + (f" W={w}" if len(a.workers) > 1 else "")


def run(a, k: int, w: int, out: Path) -> list[dict]:
    """The timed steps' metrics of one run with train.async.max_staleness=k and w rollout workers."""
    import torch

    from tether.resolve import load_config
    from tether.train import build_trainer

    over = {"model.name": a.model, "rollout.prompts_per_step": a.prompts, "rollout.n": a.n,
            "rollout.max_new_tokens": a.max_new_tokens, "rollout.min_new_tokens": a.max_new_tokens,
            "train.steps": a.steps + a.warmup, "run.progress": False, "run.plot": False, "run.save_every": 0,
            "run.exact_kl_samples": 0, "eval.before": False, "eval.after": False, "train.async": k,
            "model.device": a.device, "model.dtype": a.dtype}
    if k:
        over["train.async.workers"] = w
        if w > k + 1:
            over["train.async.stale_batches"] = "keep"  # every batch trains, as in the synchronous run
    torch.set_num_threads(a.trainer_threads if k else a.sync_threads)
    os.environ["OMP_NUM_THREADS"] = str(a.worker_threads)  # read by the spawned workers' torch
    t = build_trainer(load_config(None, over, recipe_name="grpo"), out / f"k{k}w{w}", log=lambda *x: None)
    rows = []
    try:
        for step in range(a.steps + a.warmup):
            t0 = time.perf_counter()
            m = t.train_step()
            m["wall_s"] = time.perf_counter() - t0
            gen = m.get("async/worker_gen_s", m["time_rollout_s"])
            print(f"[async] {label(k, w, a)} step {step}{' (warm-up)' if step < a.warmup else ''}: "
                  f"{m['wall_s']:.2f} s, generation {gen:.2f} s, {m['gen_tokens']} tokens", flush=True)
            if step >= a.warmup:
                rows.append(m)
    finally:
        t.close()
    return rows


def summary(rows: list[dict]) -> dict:
    med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    wait = med("async/wait_s") if "async/wait_s" in rows[0] else 0.0
    gen = [r.get("async/worker_gen_s", r["time_rollout_s"]) for r in rows]
    upd = [r["wall_s"] - r["time_rollout_s"] for r in rows]  # K >= 1: the rollout time is the wait + scoring
    return {"step": med("wall_s"), "gen": statistics.median(gen), "upd": statistics.median(upd), "wait": wait,
            "tokens": med("gen_tokens"), "gen_all": gen, "upd_all": upd}


def main(argv=None) -> int:
    a = parse_args(argv)
    print(machine_info())
    if a.device.startswith("cuda"):
        import torch

        print(f"device: {torch.cuda.get_device_name(a.device)}, {a.dtype}; torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        if a.random_weights:
            a.model = str(random_like(a.model, a.dtype, Path(tmp) / "model"))
            print(f"model: {a.model}, random weights")
        res = {(k, w): summary(run(a, k, w, Path(tmp))) for k, w in a.runs}
    print(f"\n{a.prompts} prompts x {a.n} samples, {a.max_new_tokens} tokens each (EOS banned), median of "
          f"{a.steps} steps after {a.warmup} warm-up; {a.device}, {a.dtype}; threads: sync {a.sync_threads}, async "
          f"trainer {a.trainer_threads} + worker(s) x {a.worker_threads}; workers {','.join(map(str, a.workers))}")
    print(f"{'run':10s} {'step s':>8s} {'gen s':>8s} {'update s':>9s} {'wait s':>7s} {'gen tok':>8s}")
    for (k, w), s in res.items():
        print(f"{label(k, w, a):10s} {s['step']:8.2f} {s['gen']:8.2f} {s['upd']:9.2f} {s['wait']:7.2f} "
              f"{s['tokens']:8.0f}")
    if (0, 0) in res:
        s0 = res[(0, 0)]
        for (k, w) in (r for r in res if r[0]):
            pred = speedup(s0["gen_all"], s0["upd_all"], k, w)
            own = s0["step"] / simulate(res[(k, w)]["gen_all"], res[(k, w)]["upd_all"], k, w)
            print(f"ratio step time sync/{label(k, w, a)} = {s0['step'] / res[(k, w)]['step']:.2f} (model: {pred:.2f} "
                  f"from the sync run's times, {own:.2f} from this run's own generation and update times)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
