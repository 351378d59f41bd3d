#!/usr/bin/env bash
# The cold-start experiment of docs/results_search.md, one stage at a time, resumable: SmolLM2-135M-Instruct
# on the closed-pool search task, evaluated greedily on a fixed subset of multihop_dev before SFT, after SFT on
# teacher demonstrations (tether demos search, train split only), and after RL from the SFT run. A finished
# stage is skipped; an interrupted one continues (--resume).
#
#   bash scripts/coldstart_search.sh                            # demos, base eval, SFT, SFT eval
#   bash scripts/coldstart_search.sh rl grpo:0 ema_pg:0 ...     # RL runs (recipe:seed), each followed by its eval
#
# RL recipes: grpo, ema_pg (EMA anchor every RL_EVERY steps with eta RL_ETA), ema_pg_fixed (ema_pg with a fixed
# anchor: its only change). Settings (environment variables): OUT (default runs/coldstart), DEV_LIMIT (300 dev
# questions), SFT_EPOCHS (1), SFT_LR (2e-5), RL_STEPS (5), RL_PROMPTS (4 prompts x 5 samples a step), RL_LR
# (1e-5), RL_CONTEXT (2048 tokens an episode while training; evaluation keeps 4096), RL_EVERY (2), RL_ETA (0.9),
# RL_MICRO (1 episode a forward/backward: 8 took 20 GB of activations at 2048 tokens, 2 took 11 GB).
# Two lanes fit this 2-core CPU with OMP_NUM_THREADS=1 each (taskset -c 0 / -c 1); never more.
set -euo pipefail
cd "$(dirname "$0")/.."
T=.venv/bin/tether
OUT=${OUT:-runs/coldstart}
DEV_LIMIT=${DEV_LIMIT:-300}
SFT_EPOCHS=${SFT_EPOCHS:-1}
SFT_LR=${SFT_LR:-2e-5}
SFT="$OUT/sft_search_e$SFT_EPOCHS"
RL_STEPS=${RL_STEPS:-5}
RL_PROMPTS=${RL_PROMPTS:-4}
RL_LR=${RL_LR:-1e-5}
RL_CONTEXT=${RL_CONTEXT:-2048}
RL_EVERY=${RL_EVERY:-2}
RL_ETA=${RL_ETA:-0.9}
RL_MICRO=${RL_MICRO:-1}
mkdir -p "$OUT"

evaluate() {  # evaluate MODEL OUTDIR: greedy, the first DEV_LIMIT multihop_dev questions (skipped when done)
  if [ -f "$2/results.json" ] && ! grep -q '"complete": false' "$2/results.json"; then return; fi
  $T eval --model "$1" --agent search --benchmarks multihop_dev --limit "$DEV_LIMIT" --greedy \
    --max-new-tokens 128 --no-progress --out "$2" --overwrite
}

if [ "${1:-}" != rl ]; then
  [ -f "$OUT/demos_search.jsonl" ] || $T demos search --out "$OUT/demos_search.jsonl"
  evaluate smollm2 "$OUT/eval_base"
  if [ -f "$SFT/config.yaml" ]; then
    $T sft --resume "$SFT" run.save_every=5 || true  # a finished run says so and exits non-zero
  else
    $T sft --data "$OUT/demos_search.jsonl" --output-dir "$SFT" train.epochs="$SFT_EPOCHS" \
      train.lr="$SFT_LR" data.val_fraction=0.1 run.progress=false run.save_every=5
  fi
  evaluate "$SFT" "$OUT/eval_sft_e$SFT_EPOCHS"
  exit 0
fi

shift
for spec in "${@:-grpo:0}"; do
  name=${spec%%:*}; seed=${spec##*:}
  case $name in
    grpo) recipe=grpo; extra=() ;;
    ema_pg) recipe=ema_pg; extra=(algo.anchor.every="$RL_EVERY" algo.anchor.eta="$RL_ETA") ;;
    ema_pg_fixed) recipe=ema_pg; extra=(algo.anchor.kind=fixed) ;;
    *) echo "unknown RL run '$name' (grpo | ema_pg | ema_pg_fixed)" >&2; exit 2 ;;
  esac
  run="$OUT/rl_${name}_s${seed}"
  if [ -f "$run/config.yaml" ]; then
    $T train --resume "$run" train.steps="$RL_STEPS" train.micro_batch_size="$RL_MICRO" || true  # a finished run says so and exits non-zero
  else
    $T train --task search --recipe "$recipe" --model "$SFT" --output-dir "$run" --steps "$RL_STEPS" \
      train.lr="$RL_LR" train.seed="$seed" rollout.prompts_per_step="$RL_PROMPTS" rollout.max_new_tokens=128 \
      search.max_context="$RL_CONTEXT" train.micro_batch_size="$RL_MICRO" eval.before=false eval.after=false \
      run.progress=false run.save_every=1 "${extra[@]}"
  fi
  evaluate "$run" "$OUT/eval_${name}_s${seed}"
done
