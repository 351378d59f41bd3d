# Sourced by scripts/coldstart_search.sh and scripts/coldstart_val.sh: their settings, the RL run from the SFT model
# and the greedy search-agent evaluation, written once. Settings (environment variables): T (the tether command,
# .venv/bin/tether), OUT (runs/coldstart), SFT_EPOCHS (1; the SFT run is $OUT/sft_search_e$SFT_EPOCHS), RL_STEPS
# (5), RL_PROMPTS (4 prompts x 5 samples a step), RL_LR (1e-5), RL_CONTEXT (2048 tokens an episode while training;
# evaluation keeps 4096), RL_MICRO (1 episode a forward/backward: 8 took 20 GB of activations at 2048 tokens, 2 took
# 11 GB).
T=${T:-.venv/bin/tether}
OUT=${OUT:-runs/coldstart}
SFT_EPOCHS=${SFT_EPOCHS:-1}
SFT="$OUT/sft_search_e$SFT_EPOCHS"
RL_STEPS=${RL_STEPS:-5}
RL_PROMPTS=${RL_PROMPTS:-4}
RL_LR=${RL_LR:-1e-5}
RL_CONTEXT=${RL_CONTEXT:-2048}
RL_MICRO=${RL_MICRO:-1}

evaluate() {  # evaluate MODEL OUTDIR BENCHMARK LIMIT: greedy, the first LIMIT questions (skipped when complete)
  if [ -f "$2/results.json" ] && ! grep -q '"complete": false' "$2/results.json"; then return; fi
  $T eval --model "$1" --agent search --benchmarks "$3" --limit "$4" --greedy --max-new-tokens 128 --no-progress \
    --out "$2" --overwrite
}

rl_run() {  # rl_run RUN RECIPE SEED [OVERRIDES...]: RL_STEPS steps from $SFT into RUN (resumed when it exists)
  local run=$1 recipe=$2 seed=$3
  shift 3
  if [ -f "$run/config.yaml" ]; then  # `|| true`: a finished run says so and exits non-zero
    $T train --resume "$run" train.steps="$RL_STEPS" train.micro_batch_size="$RL_MICRO" || true
  else
    $T train --task search --recipe "$recipe" --model "$SFT" --output-dir "$run" --steps "$RL_STEPS" \
      train.lr="$RL_LR" train.seed="$seed" rollout.prompts_per_step="$RL_PROMPTS" rollout.max_new_tokens=128 \
      rollout.agent.env.max_context="$RL_CONTEXT" train.micro_batch_size="$RL_MICRO" eval.before=false eval.after=false \
      run.progress=false run.save_every=1 "$@"
  fi
}
