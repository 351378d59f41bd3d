#!/usr/bin/env bash
# The cold-start experiment of docs/results_search.md, one stage at a time, resumable: SmolLM2-135M-Instruct
# on the closed-pool search task, evaluated greedily on a fixed subset of multihop_dev before SFT, after SFT on
# teacher demonstrations (tether demos search, train split only), and after RL from the SFT run. A finished
# stage is skipped; an interrupted one continues (--resume).
#
#   bash scripts/coldstart_search.sh                            # demos, base eval, SFT, SFT eval
#   bash scripts/coldstart_search.sh rl grpo:0 ema_pg:0 ...     # RL runs (recipe:seed), each followed by its eval
#
# RL recipes: grpo, ema_pg (EMA anchor every RL_EVERY steps with eta RL_ETA), ema_pg_lr3e-5 (ema_pg at the lr
# chosen on the validation slice, scripts/coldstart_val.sh), ema_pg_centered_lr3e-5 (that, with the top-k KL whose
# per-sample gradient is zero at the anchor: docs/algorithms.md), ema_pg_fixed (ema_pg with a fixed anchor: its
# only change). Settings (environment variables): DEV_LIMIT (300 dev questions), SFT_LR (2e-5),
# RL_EVERY (2), RL_ETA (0.9), and those of scripts/coldstart_lib.sh (OUT, SFT_EPOCHS, RL_STEPS, RL_PROMPTS, RL_LR,
# RL_CONTEXT, RL_MICRO).
# Two lanes fit this 2-core CPU with OMP_NUM_THREADS=1 each (taskset -c 0 / -c 1); never more.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/coldstart_lib.sh
DEV_LIMIT=${DEV_LIMIT:-300}
SFT_LR=${SFT_LR:-2e-5}
RL_EVERY=${RL_EVERY:-2}
RL_ETA=${RL_ETA:-0.9}
mkdir -p "$OUT"

if [ "${1:-}" != rl ]; then
  [ -f "$OUT/demos_search.jsonl" ] || $T demos search --out "$OUT/demos_search.jsonl"
  evaluate smollm2 "$OUT/eval_base" multihop_dev "$DEV_LIMIT"
  if [ -f "$SFT/config.yaml" ]; then
    $T sft --resume "$SFT" run.save_every=5 || true  # a finished run says so and exits non-zero
  else
    $T sft --data "$OUT/demos_search.jsonl" --output-dir "$SFT" train.epochs="$SFT_EPOCHS" \
      train.lr="$SFT_LR" data.val_fraction=0.1 run.progress=false run.save_every=5
  fi
  evaluate "$SFT" "$OUT/eval_sft_e$SFT_EPOCHS" multihop_dev "$DEV_LIMIT"
  exit 0
fi

shift
for spec in "${@:-grpo:0}"; do
  name=${spec%%:*}; seed=${spec##*:}; lr=$RL_LR
  ema=(algo.anchor.every="$RL_EVERY" algo.anchor.eta="$RL_ETA")
  case $name in
    grpo) recipe=grpo; extra=() ;;
    ema_pg) recipe=ema_pg; extra=("${ema[@]}") ;;
    ema_pg_lr3e-5) recipe=ema_pg; lr=3e-5; extra=("${ema[@]}") ;;
    ema_pg_centered_lr3e-5) recipe=ema_pg; lr=3e-5; extra=("${ema[@]}" algo.kl.estimator=topk_rev_centered) ;;
    ema_pg_fixed) recipe=ema_pg; extra=(algo.anchor.kind=fixed) ;;
    *) echo "unknown RL run '$name' (grpo | ema_pg | ema_pg_lr3e-5 | ema_pg_centered_lr3e-5 | ema_pg_fixed)" >&2
       exit 2 ;;
  esac
  RL_LR=$lr rl_run "$OUT/rl_${name}_s${seed}" "$recipe" "$seed" "${extra[@]}"
  evaluate "$OUT/rl_${name}_s${seed}" "$OUT/eval_${name}_s${seed}" multihop_dev "$DEV_LIMIT"
done
