#!/usr/bin/env bash
# Set up (first run only) and train. With no arguments: the embedded default, SmolLM2-135M-Instruct
# on synthetic arithmetic with the ema_pg recipe, on the CPU, offline. Arguments go to `tether train`,
# e.g. `bash scripts/train.sh --recipe grpo --data gsm8k train.steps=50`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
export TETHER_DATA_DIR="${TETHER_DATA_DIR:-$root/../shared/data/math}"
exec "${TETHER_VENV:-$root/.venv}/bin/tether" train "$@"
