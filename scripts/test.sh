#!/usr/bin/env bash
# Set up (first run only), lint (ruff) and run the default test suite. Extra arguments go to pytest
# (and skip the lint),
# e.g. `bash scripts/test.sh -m slow` for the end-to-end tests on the real model.
# With TETHER_VENV pointing at a vLLM environment (made by `setup.sh --vllm`), that
# environment is kept one: e.g. `TETHER_VENV=$PWD/.venv-vllm bash scripts/test.sh tests/test_vllm.py`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${TETHER_VENV:-$root/.venv}"
if compgen -G "$venv/.tether-setup-vllm-*" >/dev/null; then
  TETHER_VLLM_VENV="$venv" bash "$root/scripts/setup.sh" --vllm
else
  bash "$root/scripts/setup.sh"
fi
cd "$root"
export TETHER_DATA_DIR="${TETHER_DATA_DIR:-$root/../shared/data/math}"
if [ "$#" -eq 0 ]; then
  # the default suite starts with the linter (pyproject.toml [tool.ruff]): zero findings or no tests
  "$venv/bin/python" -m ruff check src bench tests
  # --durations: the slowest tests, to watch the default suite's 15-minute budget (mark a slower one `slow`)
  set -- -m "not slow" --durations=15
fi
exec "$venv/bin/python" -m pytest -q "$@"
