#!/usr/bin/env bash
# The calculator cold start of docs/results_search.md ("Calculator"), one stage at a time, resumable:
# SmolLM2-135M-Instruct on held-out arithmetic at difficulty 3 (the synthetic task's test split, seed 0, the
# first EVAL_LIMIT problems, greedy), with and without the calculator tool, before SFT, after SFT on teacher
# demonstrations (tether demos calculator: the train split only) and after RL from the SFT run.
#
#   bash scripts/coldstart_calculator.sh            # every stage (finished ones are skipped)
#
# Settings (environment variables): OUT (default runs/coldstart_calc), EVAL_LIMIT (100), DEMOS (400 train
# problems), SFT_LR (2e-5), RL_RECIPE (ema_pg), RL_STEPS (10), RL_PROMPTS (4), RL_LR (1e-5), RL_SEED (0).
set -euo pipefail
cd "$(dirname "$0")/.."
T=.venv/bin/tether
OUT=${OUT:-runs/coldstart_calc}
EVAL_LIMIT=${EVAL_LIMIT:-100}
DEMOS=${DEMOS:-400}
SFT_LR=${SFT_LR:-2e-5}
RL_RECIPE=${RL_RECIPE:-ema_pg}
RL_STEPS=${RL_STEPS:-10}
RL_PROMPTS=${RL_PROMPTS:-4}
RL_LR=${RL_LR:-1e-5}
RL_SEED=${RL_SEED:-0}
mkdir -p "$OUT"

evaluate() {  # evaluate MODEL OUTDIR tool|no_tool (skipped when done)
  if [ -f "$2/results.json" ] && ! grep -q '"complete": false' "$2/results.json"; then return; fi
  local agent=(--max-new-tokens 256)
  [ "$3" = tool ] && agent=(--agent multi_turn --env calculator --max-new-tokens 128)
  $T eval --model "$1" --benchmarks arithmetic-d3 --limit "$EVAL_LIMIT" --greedy "${agent[@]}" --no-progress \
    --out "$2" --overwrite
}

[ -f "$OUT/demos.jsonl" ] || $T demos calculator --difficulty 3 --limit "$DEMOS" --out "$OUT/demos.jsonl"
evaluate smollm2 "$OUT/eval_base_no_tool" no_tool
evaluate smollm2 "$OUT/eval_base_tool" tool
SFT="$OUT/sft"
if [ -f "$SFT/config.yaml" ]; then
  $T sft --resume "$SFT" || true  # a finished run says so and exits non-zero
else
  $T sft --data "$OUT/demos.jsonl" --output-dir "$SFT" train.epochs=1 train.lr="$SFT_LR" data.val_fraction=0.1 \
    run.progress=false run.save_every=5
fi
evaluate "$SFT" "$OUT/eval_sft_tool" tool
evaluate "$SFT" "$OUT/eval_sft_no_tool" no_tool
RL="$OUT/rl_${RL_RECIPE}_s${RL_SEED}"
extra=()
[ "$RL_RECIPE" = ema_pg ] && extra=(algo.anchor.every=2 algo.anchor.eta=0.9)  # the search runs' EMA, moving in 10 steps
if [ -f "$RL/config.yaml" ]; then
  $T train --resume "$RL" || true
else
  $T train --recipe "$RL_RECIPE" --model "$SFT" --data arithmetic --output-dir "$RL" --steps "$RL_STEPS" \
    data.difficulty=3 rollout.agent=multi_turn rollout.agent.env.name=calculator rollout.prompts_per_step="$RL_PROMPTS" \
    rollout.max_new_tokens=128 train.lr="$RL_LR" train.seed="$RL_SEED" eval.before=false eval.after=false \
    run.progress=false run.save_every=2 "${extra[@]}"
fi
evaluate "$RL" "$OUT/eval_rl_${RL_RECIPE}_s${RL_SEED}_tool" tool
