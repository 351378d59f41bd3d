#!/usr/bin/env bash
# The cold-start experiment of docs/results_search.md, one stage at a time, resumable: SmolLM2-135M-Instruct
# on the closed-pool search task, evaluated greedily on a fixed subset of multihop_dev before SFT, after SFT on
# teacher demonstrations (tether demos search, train split only), and after RL from the SFT run (grpo and
# ema_pg, seeds given as arguments). A finished stage is skipped; an interrupted one continues (--resume).
#
#   bash scripts/coldstart_search.sh                 # demos, base eval, SFT, SFT eval
#   bash scripts/coldstart_search.sh rl 0 1          # then RL (grpo, ema_pg) with seeds 0 and 1, and their evals
#
# Settings (environment variables): OUT (default runs/coldstart), DEV_LIMIT (300 dev questions), SFT_EPOCHS (3),
# SFT_LR (2e-5), RL_STEPS (30), RL_LR (1e-5, tether train's CPU default). Run nothing else CPU-heavy at the same time.
set -euo pipefail
cd "$(dirname "$0")/.."
T=.venv/bin/tether
OUT=${OUT:-runs/coldstart}
DEV_LIMIT=${DEV_LIMIT:-300}
SFT_EPOCHS=${SFT_EPOCHS:-3}
SFT_LR=${SFT_LR:-2e-5}
RL_STEPS=${RL_STEPS:-30}
RL_LR=${RL_LR:-1e-5}
mkdir -p "$OUT"

evaluate() {  # evaluate MODEL OUTDIR: greedy, the first DEV_LIMIT multihop_dev questions (skipped when done)
  if [ -f "$2/results.json" ] && ! grep -q '"complete": false' "$2/results.json"; then return; fi
  $T eval --model "$1" --agent search --benchmarks multihop_dev --limit "$DEV_LIMIT" --greedy \
    --max-new-tokens 128 --no-progress --out "$2" --overwrite
}

if [ "${1:-}" != rl ]; then
  [ -f "$OUT/demos_search.jsonl" ] || $T demos search --out "$OUT/demos_search.jsonl"
  evaluate smollm2 "$OUT/eval_base"
  if [ -f "$OUT/sft_search/config.yaml" ]; then
    $T sft --resume "$OUT/sft_search" run.save_every=5 || true  # a finished run says so and exits non-zero
  else
    $T sft --data "$OUT/demos_search.jsonl" --output-dir "$OUT/sft_search" train.epochs="$SFT_EPOCHS" \
      train.lr="$SFT_LR" data.val_fraction=0.1 run.progress=false run.save_every=5
  fi
  evaluate "$OUT/sft_search" "$OUT/eval_sft"
  exit 0
fi

shift
for seed in "${@:-0}"; do
  for recipe in grpo ema_pg; do
    run="$OUT/rl_${recipe}_s${seed}"
    if [ -f "$run/config.yaml" ]; then
      $T train --resume "$run" || true
    else
      $T train --task search --recipe "$recipe" --model "$OUT/sft_search" --output-dir "$run" --steps "$RL_STEPS" \
        train.lr="$RL_LR" train.seed="$seed" eval.before=false eval.after=false run.progress=false run.save_every=2
    fi
    evaluate "$run" "$OUT/eval_${recipe}_s${seed}"
  done
done
