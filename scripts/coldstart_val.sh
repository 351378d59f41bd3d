#!/usr/bin/env bash
# Choosing the RL settings of the search cold start (docs/results_search.md) on a validation slice of the TRAIN
# split, never on dev. Each candidate is one RL run from the SFT model, seed 0, that changes one setting of
# scripts/coldstart_search.sh's defaults (lr 1e-5, 5 steps, ema_pg: eta 0.9 every 2 steps); it is trained when
# missing (resumable) and evaluated greedily on the slice, like the dev evaluation. Finished stages are skipped.
#
#   bash scripts/coldstart_val.sh sft grpo ema_pg grpo_lr3e-5 ...   # the candidates, in order
#   .venv/bin/python bench/search_report.py runs/coldstart/val/eval_*  # their table (paired s.e. against the first)
#
# Candidates: sft (no RL), grpo and ema_pg (the default runs runs/coldstart/rl_{grpo,ema_pg}_s0, evaluated at step
# 5), grpo_step4 and ema_pg_step4 (their step-4 checkpoints: the number of steps; ema_pg_lr3e-5_step4 that of the
# lr-3e-5 candidate), grpo_lr3e-5, ema_pg_lr3e-5
# (the lr), ema_pg_eta0.95_every1 (the anchor's eta and period). The slice: scripts/search_val_slice.py (VAL_LIMIT
# train questions, 200, in no SFT demonstration and no RL prompt of seeds 0-2), of which each candidate is evaluated
# on the first VAL_EVAL (100: a 200-question evaluation took an hour of a loaded core). OUT: runs/coldstart.
# Two lanes fit this 2-core CPU with OMP_NUM_THREADS=1 each (taskset -c 0 / -c 1); never more.
set -euo pipefail
cd "$(dirname "$0")/.."
T=.venv/bin/tether
OUT=${OUT:-runs/coldstart}
VAL="$OUT/val"
SLICE="$VAL/val_slice.jsonl"
SFT="$OUT/sft_search_e1"
mkdir -p "$VAL"
[ -f "$SLICE" ] || .venv/bin/python scripts/search_val_slice.py --demos "$OUT/demos_search.jsonl" --out "$SLICE" \
  --limit "${VAL_LIMIT:-200}"

train() {  # train NAME RECIPE OVERRIDES...: the default RL run of coldstart_search.sh (seed 0) with OVERRIDES
  local run="$VAL/rl_$1" recipe=$2; shift 2
  if [ -f "$run/config.yaml" ]; then
    $T train --resume "$run" train.steps=5 train.micro_batch_size=1 || true  # a finished run says so, exits non-zero
  else
    $T train --task search --recipe "$recipe" --model "$SFT" --output-dir "$run" --steps 5 train.lr=1e-5 \
      train.seed=0 rollout.prompts_per_step=4 rollout.max_new_tokens=128 search.max_context=2048 \
      train.micro_batch_size=1 eval.before=false eval.after=false run.progress=false run.save_every=1 "$@"
  fi
}

for name in "$@"; do
  case $name in
    sft) model=$SFT ;;
    grpo|ema_pg) model="$OUT/rl_${name}_s0" ;;
    grpo_step4|ema_pg_step4) model="$OUT/rl_${name%_step4}_s0/checkpoints/step-000004" ;;
    ema_pg_lr3e-5_step4) model="$VAL/rl_ema_pg_lr3e-5/checkpoints/step-000004" ;;
    grpo_lr3e-5) train "$name" grpo train.lr=3e-5; model="$VAL/rl_$name" ;;
    ema_pg_lr3e-5) train "$name" ema_pg algo.anchor.every=2 algo.anchor.eta=0.9 train.lr=3e-5; model="$VAL/rl_$name" ;;
    ema_pg_eta0.95_every1) train "$name" ema_pg algo.anchor.every=1 algo.anchor.eta=0.95; model="$VAL/rl_$name" ;;
    *) echo "unknown candidate '$name'" >&2; exit 2 ;;
  esac
  out="$VAL/eval_$name"
  if [ -f "$out/results.json" ] && ! grep -q '"complete": false' "$out/results.json"; then continue; fi
  $T eval --model "$model" --agent search --benchmarks "$SLICE" --limit "${VAL_EVAL:-100}" --greedy \
    --max-new-tokens 128 --no-progress --out "$out" --overwrite
done
