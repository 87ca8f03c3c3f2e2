#!/usr/bin/env bash
# Record the run behind docs/TRADEOFFS.md, then regenerate it. Run on an otherwise idle machine: timings taken
# while other jobs share the CPU are not the model's. Resumable: rerun the same command after a stop.
# Usage: scripts/record_tradeoffs.sh [REPORT_DIR] [extra spekit bench flags, e.g. --draft DIR]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${1:-runs/tradeoffs}"
shift || true
python=".venv/bin/python"
[[ -x "$python" ]] || python=python3
"$python" -m spekit bench --limit 3 --sweep-limit 1 --max-new-tokens 128 --report "$out" \
  --sweep batch=1,2,4,8,16 --sweep num_draft_tokens=2,4,8,16 --sweep temperature=0,0.7,1.0 \
  --sweep dtype=float32,bfloat16 --sweep quantize=none,int8,int4 --sweep max_new_tokens=64,256,1024 "$@" | tee "$out.table.txt"
"$python" -m spekit.bench.tradeoffs "$out" --out docs/TRADEOFFS.md
