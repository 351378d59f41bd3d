#!/usr/bin/env bash
# Choosing the RL settings of the search cold start (docs/results_search.md) on a validation slice of the TRAIN
# split, never on dev. Each candidate is one RL run from the SFT model, seed 0, that changes one setting of
# scripts/coldstart_search.sh's defaults (lr 1e-5, 5 steps, ema_pg: eta 0.9 every 2 steps); it is trained when
# missing (resumable, scripts/coldstart_lib.sh's rl_run) and evaluated greedily on the slice, like the dev
# evaluation. Finished stages are skipped.
#
#   bash scripts/coldstart_val.sh sft grpo ema_pg grpo_lr3e-5 ...   # the candidates, in order
#   # their table: the bench/search_report.py command in docs/results_search.md (paired s.e. against sft)
#
# Candidates: sft (no RL); grpo and ema_pg (the default runs runs/coldstart/rl_{grpo,ema_pg}_s0, at step 5);
# the lr: grpo_lr3e-5, ema_pg_lr3e-5; the anchor's eta and period at the chosen lr: ema_pg_lr3e-5_eta0.9_every1
# (the anchor twice as fast; eta 0.95 every step would keep the default's time scale, 0.9 ** 0.5); the steps:
# grpo_step4, ema_pg_step4, ema_pg_lr3e-5_step4 (step-4 checkpoints). The slice: scripts/search_val_slice.py
# (VAL_LIMIT train questions, 200, in no SFT demonstration and no RL prompt of seeds 0-2), of which each candidate
# is evaluated on the first VAL_EVAL (100: a 200-question evaluation took an hour of a loaded core).
# Two lanes fit this 2-core CPU with OMP_NUM_THREADS=1 each (taskset -c 0 / -c 1); never more.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/coldstart_lib.sh
VAL="$OUT/val"
SLICE="$VAL/val_slice.jsonl"
mkdir -p "$VAL"
[ -f "$SLICE" ] || .venv/bin/python scripts/search_val_slice.py --demos "$OUT/demos_search.jsonl" --out "$SLICE" \
  --limit "${VAL_LIMIT:-200}"

for name in "$@"; do
  case $name in
    sft) model=$SFT ;;
    grpo|ema_pg) model="$OUT/rl_${name}_s0" ;;
    grpo_step4|ema_pg_step4) model="$OUT/rl_${name%_step4}_s0/checkpoints/step-000004" ;;
    ema_pg_lr3e-5_step4) model="$VAL/rl_ema_pg_lr3e-5/checkpoints/step-000004" ;;
    grpo_lr3e-5) model="$VAL/rl_$name"; RL_LR=3e-5 rl_run "$model" grpo 0 ;;
    ema_pg_lr3e-5) model="$VAL/rl_$name"; RL_LR=3e-5 rl_run "$model" ema_pg 0 algo.anchor.every=2 algo.anchor.eta=0.9 ;;
    ema_pg_lr3e-5_eta0.9_every1) model="$VAL/rl_$name"
      RL_LR=3e-5 rl_run "$model" ema_pg 0 algo.anchor.every=1 algo.anchor.eta=0.9 ;;
    *) echo "unknown candidate '$name'" >&2; exit 2 ;;
  esac
  evaluate "$model" "$VAL/eval_$name" "$SLICE" "${VAL_EVAL:-100}"
done
