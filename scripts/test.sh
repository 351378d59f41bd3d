#!/usr/bin/env bash
# Set up (first run only) and run the default test suite. Extra arguments go to pytest,
# e.g. `bash scripts/test.sh -m slow` for the end-to-end tests on the real model.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
cd "$root"
export TETHER_DATA_DIR="${TETHER_DATA_DIR:-$root/../shared/data/math}"
if [ "$#" -eq 0 ]; then set -- -m "not slow"; fi
exec "${TETHER_VENV:-$root/.venv}/bin/python" -m pytest -q "$@"
