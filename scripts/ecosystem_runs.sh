#!/usr/bin/env bash
# docs/ecosystem.md: the default model (SmolLM2-135M-Instruct) before and after a short run, one environment per
# route (configs/ecosystem/*.yaml), one run at a time (two CPU-heavy runs at once are 5-10x slower). A run that was
# stopped resumes from its last checkpoint when this is run again; a finished one is skipped. Each finished run's
# config and metrics are copied to docs/evidence/ecosystem/<route>/ (commit them at once).
#   bash scripts/ecosystem_runs.sh [OUT_DIR] [ROUTE ...]     (OUT_DIR default runs/ecosystem; routes: all four)
# (verifiers: the classic API, with PYTHONPATH=.venv/verifiers-classic; verifiers_v1: verifiers 0.4's task API)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-$root/runs/ecosystem}"
shift || true
routes=("$@")
[ "${#routes[@]}" -gt 0 ] || routes=(reasoning_gym skyrl_gym verifiers verifiers_v1)
py="${TETHER_VENV:-$root/.venv}/bin/python"
export PYTHONPATH="$root/tests/vf_envs:$root/tests/vf1_envs${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
for r in "${routes[@]}"; do
  run="$out/$r"
  keep="$root/docs/evidence/ecosystem/$r"
  if [ -f "$keep/metrics.jsonl" ]; then echo "[ecosystem] $r: done ($keep)"; continue; fi
  start=$(date +%s)
  if compgen -G "$run/checkpoints/step-*" >/dev/null; then
    "$py" -m tether train --resume "$run" run.progress=false
  else
    "$py" -m tether train --config "$root/configs/ecosystem/$r.yaml" --output-dir "$run" --overwrite run.progress=false
  fi
  mkdir -p "$keep"
  cp "$run/config.yaml" "$run/metrics.jsonl" "$keep/"
  echo "[ecosystem] $r: $(( $(date +%s) - start )) s this session -> $keep"
done
